"""sha256 of a file while it is being written, on a background thread.

A writer that fills a file out of order knows how far its written prefix
reaches; ``PrefixHasher.advance(upto)`` hands the new part of that prefix to a
thread that reads it back through its own descriptor (from the page cache)
and hashes it.  hashlib drops the GIL for large updates, so the hash runs
beside the writer instead of as one long pass after the file is complete, and
after ``finish`` it goes on while the writer moves to its next file: with many
workers the output arrives faster than one thread hashes (sha256 runs at a
few hundred MB/s without SHA extensions), and each file's hash then gets a
thread of its own.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading

_STEP = 32 << 20      # hand work to the thread in pieces of at least this much
_CHUNK = 8 << 20


class PrefixHasher:
    """Hash ``path`` (of final size ``size``) as ``advance`` reports its written prefix."""

    def __init__(self, path: str | os.PathLike, size: int):
        self._fd = os.open(path, os.O_RDONLY)
        self._size = size
        self._queued = 0
        self._hash = hashlib.sha256()
        self._error: BaseException | None = None
        self._abandoned = False
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="k3ckpt-hash", daemon=True)
        self._thread.start()

    def advance(self, upto: int) -> None:
        """Bytes [0, upto) are written and will not change."""
        if upto - self._queued >= _STEP or (upto == self._size and upto > self._queued):
            self._work.put((self._queued, upto))
            self._queued = upto

    def finish(self) -> None:
        """All of the file is written: hash the rest without waiting (see ``ready``)."""
        self.advance(self._size)
        assert self._queued == self._size
        self._work.put(None)

    def ready(self) -> bool:
        """``hexdigest`` will not wait (after ``finish``)."""
        return not self._thread.is_alive()

    def hexdigest(self) -> str:
        """The file's sha256, once all of it is written (waits for the thread)."""
        if self._queued < self._size:
            self.finish()
        self._stop()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()

    def close(self) -> None:
        """Stop without a result (the file is abandoned): queued work is dropped."""
        self._abandoned = True
        self._stop()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._work.put(None)     # a second stop mark after finish() is never read
            self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            if self._error is not None or self._abandoned:
                continue
            first, end = item
            start = first
            try:
                while start < end and not self._abandoned:
                    chunk = os.pread(self._fd, min(_CHUNK, end - start), start)
                    if not chunk:
                        raise OSError(f"file ended at {start:,} bytes while hashing up to {end:,}")
                    self._hash.update(chunk)
                    start += len(chunk)
                _start_writeback(self._fd, first, end)
            except BaseException as e:   # re-raised in the writer's thread by hexdigest
                self._error = e


def _start_writeback(fd: int, start: int, end: int) -> None:
    """Start writing [start, end) to disk now and let its pages go once written (Linux
    begins writeback for dirty pages under POSIX_FADV_DONTNEED).  Otherwise the kernel
    holds the output dirty until its own threshold or age, and the file's final fsync
    waits for all of it; the pages are not read again after they are hashed."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass   # only advice
