"""Streaming, atomic safetensors writer (one file or many shards plus an index).

The layout is fixed before any byte is written: every shard's header is known
from the ``TensorSpec`` list, so tensor data can arrive in any order, whole or
in chunks, and is placed with ``pwrite`` at its final offset.  Each shard is
written to a hidden temporary file in the destination folder and only renamed
to its final name (after flush, fsync and chmod 0644) once every byte of every
tensor in it has been written; the index is written last.  An error or
``abort()`` removes the temporaries and never touches a final name.
"""

from __future__ import annotations

import bisect
import errno
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Sequence

import numpy as np

from ..errors import DiskSpaceError, OutputExistsError, ResumeMismatchError, ShapeError, UsageError
from . import dtypes
from .header import build_header, read_header

_FILE_MODE = 0o644  # safetensors 0.8.0 writes 0600 (issue #782); we want shareable files


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds ``path`` (or will: its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def free_space_for(path: str | os.PathLike, need: int) -> None:
    """``DiskSpaceError`` unless the filesystem that holds ``path`` (or will) has ``need`` bytes free."""
    free = free_bytes(path)
    if need > free:
        raise DiskSpaceError(f"output needs {need:,} bytes but only {free:,} are free", file=str(path))


def is_fresh_output(dst: str | os.PathLike, resume: bool) -> bool:
    """True for a run that will create its output from nothing: not ``resume``, and ``dst``
    missing or an empty folder.  Commands check free space before creating such a DST; a DST
    holding files is left to the run manifest (refused, or resumed), so that it is reported
    as what it is whatever the free space, and a resumed run's writer checks what is left."""
    dst = Path(dst)
    return not resume and not (dst.is_dir() and any(dst.iterdir()))


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, safetensors dtype string and shape of a tensor to be written."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise UsageError(f"tensor name must be a non-empty string, got {self.name!r}")
        dt = dtypes.lookup(self.dtype)
        shape = self.shape
        if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
            # (a plain tuple of non-negative ints, as every spec of a plan is, needs no rebuilding)
            shape = tuple(shape)
            if not all(type(d) is int or isinstance(d, np.integer) for d in shape) or any(int(d) < 0 for d in shape):
                raise ShapeError(f"shape must hold non-negative ints, got {shape!r}", tensor=self.name)
            shape = tuple(int(d) for d in shape)
            object.__setattr__(self, "shape", shape)
        if dt.nbytes(shape) is None:
            raise ShapeError(f"{dt.name} shape {list(shape)} does not end on a byte boundary", tensor=self.name)

    @property
    def nbytes(self) -> int:
        n = dtypes.lookup(self.dtype).nbytes(self.shape)
        assert n is not None  # checked in __post_init__
        return n


@dataclass
class _Shard:
    name: str
    tmp: Path
    final: Path
    prefix: bytes
    data_start: int
    file_size: int
    tensors: list[str]
    pending: set[str]
    fd: int | None = None
    inflight: int = 0
    done: bool = False
    hasher: Any = None      # PrefixHasher while open, with hash_shards
    cursor: int = 0         # tensors[:cursor] are complete (for the hashed prefix)


def _as_bytes_view(data: Any, *, tensor: str) -> memoryview:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise UsageError("array is not C-contiguous; pass np.ascontiguousarray(a)", tensor=tensor)
        if data.dtype.byteorder == ">" or (data.dtype.byteorder == "=" and np.little_endian is False):
            raise UsageError(f"array dtype {data.dtype} is big-endian; safetensors stores little-endian", tensor=tensor)
        return memoryview(data.reshape(-1).view(np.uint8))
    try:
        mv = memoryview(data)
    except TypeError:
        raise UsageError(f"tensor data must be bytes, memoryview or numpy array, got {type(data).__name__}",
                         tensor=tensor) from None
    if not mv.c_contiguous:
        raise UsageError("buffer is not C-contiguous", tensor=tensor)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` at ``offset`` of ``fd`` (pwrite may write less than asked)."""
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems cannot fsync a directory
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, sort_keys: bool = False) -> None:
    """``obj`` as UTF-8 JSON (plus a newline) under ``path``, atomically."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``data`` under ``path``: a hidden temporary beside it, fsync, mode 0644,
    rename; a reader sees the old file or the whole new one, never a part."""
    atomic_write_chunks(path, (data,))


def atomic_write_chunks(path: str | os.PathLike, chunks: Iterable[bytes | str]) -> None:
    """``atomic_write_bytes`` of the concatenated ``chunks`` (str as UTF-8), written as they
    come, so a large file never has to sit in memory whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with open(fd, "wb", closefd=False, buffering=1 << 20) as f:
            for c in chunks:
                f.write(c.encode("utf-8") if isinstance(c, str) else c)
        os.fsync(fd)
        os.fchmod(fd, _FILE_MODE)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# The same atomic-file rules serve the GGUF writer (k3ckpt/gguf/writer.py).
FILE_MODE = _FILE_MODE
as_bytes_view = _as_bytes_view
fsync_dir = _fsync_dir


class ShardedWriter:
    """Write tensors into shards laid out up front from ``specs``.

    ``write(name, data)`` takes a whole tensor; ``write_chunk(name, offset,
    data)`` a byte range of one (any order; overlapping rewrites of a tensor
    that is not yet complete are allowed).  A shard is finalized as soon as all
    its tensors are complete; ``close()`` checks that everything was written,
    writes the index and returns the final paths.  ``place(name)`` /
    ``mark_written(name)`` let another process write a whole tensor into the
    shard's temporary file itself (no copy of its bytes through this one).
    Use as a context manager: an exception inside ``with`` aborts.  Writes from
    several threads are safe.

    ``overwrite=False`` refuses (``OutputExistsError``) when a final shard or
    index name already exists.

    Resuming: ``done_shards`` names shards already final from an earlier run
    with the same specs (the layout is deterministic, so the names match); their
    headers are checked against the plan, their tensors are not written again
    (``needs(name)`` is False) and an existing index is replaced at close.
    ``on_shard_final(path)`` runs after each shard is renamed to its final name
    (e.g. to record it in a ``RunManifest``).  With ``hash_shards`` each shard's
    sha256 is computed while it is written (``PrefixHasher``) and finished on
    its own thread after the rename, so writing goes on; ``on_shard_final``
    then runs once ``sha256[name]`` is ready, from a later write, at
    ``close()`` or at ``abort()``.
    """

    def __init__(
        self,
        dst_dir: str | os.PathLike,
        specs: Sequence[TensorSpec],
        *,
        max_shard_bytes: int = 5_000_000_000,
        name_template: str = "model-{index:05d}-of-{count:05d}.safetensors",
        metadata: dict[str, str] | None = None,
        index_name: str = "model.safetensors.index.json",
        write_index: bool | None = None,
        overwrite: bool = False,
        check_free_space: bool = True,
        done_shards: Collection[str] = (),
        on_shard_final: Callable[[Path], None] | None = None,
        hash_shards: bool = False,
    ):
        from .reader import check_shard_name

        if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
            raise UsageError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
        self.dst_dir = Path(dst_dir)
        self.specs: dict[str, TensorSpec] = {}
        for s in specs:
            if not isinstance(s, TensorSpec):
                raise UsageError(f"specs must be TensorSpec, got {type(s).__name__}")
            if s.name in self.specs:
                raise UsageError("tensor named twice in specs", tensor=s.name)
            self.specs[s.name] = s

        # Greedy layout in the given order: start a new shard when this tensor
        # would pass the limit, unless the shard is still empty.
        groups: list[list[TensorSpec]] = [[]]
        size = 0
        for s in self.specs.values():
            if groups[-1] and size + s.nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(s)
            size += s.nbytes
        count = len(groups)
        try:
            names = [name_template.format(index=i + 1, count=count) for i in range(count)]
        except (KeyError, IndexError, ValueError) as e:
            raise UsageError(f"name_template {name_template!r} does not format: {e}") from None
        if len(set(names)) != count:
            raise UsageError(f"name_template {name_template!r} gives the same name to several of {count} shards")
        for n in names + [index_name]:
            check_shard_name(n, source="ShardedWriter")
        self.write_index = count > 1 if write_index is None else bool(write_index)
        self.index_path = self.dst_dir / index_name
        if index_name in names and self.write_index:
            raise UsageError(f"index name {index_name!r} collides with a shard name")

        self._shards: dict[str, _Shard] = {}
        self.shard_of: dict[str, str] = {}
        self._offset: dict[str, int] = {}   # absolute file offset of each tensor's first byte
        self._ranges: dict[str, list[list[int]]] = {}  # merged [start, end) written, per tensor
        for name, group in zip(names, groups):
            prefix, offs = build_header([(s.name, s.dtype, s.shape, s.nbytes) for s in group], metadata)
            data_start = len(prefix)
            sh = _Shard(
                name=name,
                tmp=self.dst_dir / f".{name}.partial",
                final=self.dst_dir / name,
                prefix=prefix,
                data_start=data_start,
                file_size=data_start + (offs[-1][1] if offs else 0),
                tensors=[s.name for s in group],
                pending={s.name for s in group if s.nbytes > 0},
            )
            self._shards[name] = sh
            for s, (b, _e) in zip(group, offs):
                self.shard_of[s.name] = name
                self._offset[s.name] = data_start + b
                self._ranges[s.name] = []
        self.shards: list[str] = names
        self._lock = threading.Lock()
        self._closed = False
        self._aborted = False
        self._on_shard_final = on_shard_final
        self._hash_shards = bool(hash_shards)
        self._hashing: list[_Shard] = []     # final, hash still running (in finalize order)
        self.sha256: dict[str, str] = {}
        self._resume_done(done_shards)

        if not overwrite:
            finals = [sh.final for sh in self._shards.values() if not sh.done]
            if self.write_index and not done_shards:
                finals.append(self.index_path)
            existing = [str(p) for p in finals if os.path.lexists(p)]
            if existing:
                raise OutputExistsError(f"{len(existing)} output file(s) already exist, e.g. {existing[0]}; "
                                        "pass overwrite=True to replace them", file=str(self.dst_dir))
        self.dst_dir.mkdir(parents=True, exist_ok=True)
        if check_free_space:
            free_space_for(self.dst_dir, sum(sh.file_size for sh in self._shards.values() if not sh.done))

    def _resume_done(self, done_shards: Collection[str]) -> None:
        for name in done_shards:
            sh = self._shards.get(name)
            if sh is None:
                raise ResumeMismatchError(f"earlier run wrote shard {name!r}, which this layout does not have "
                                          f"(shards: {self.shards[0]} ... {self.shards[-1]})", file=str(self.dst_dir))
            wrong = self._unlike_layout(sh)
            if wrong is not None:
                raise ResumeMismatchError(f"earlier run's shard {wrong}", file=str(sh.final))
            self._mark_done(sh)

    @staticmethod
    def _unlike_layout(sh: _Shard) -> str | None:
        """How the file under ``sh``'s final name differs from the layout (None: same size and header)."""
        try:
            size = sh.final.stat().st_size
            with open(sh.final, "rb") as f:
                prefix = f.read(len(sh.prefix))
        except FileNotFoundError:
            return "is missing"
        if size != sh.file_size or prefix != sh.prefix:
            return f"does not match this layout (size {size:,}, expected {sh.file_size:,}, or a different header)"
        return None

    def _mark_done(self, sh: _Shard) -> None:
        sh.done = True
        sh.pending.clear()
        for t in sh.tensors:
            self._ranges[t] = [[0, self.specs[t].nbytes]] if self.specs[t].nbytes else []

    # -- whole shards written by another process -------------------------------

    def unwritten(self) -> list[str]:
        """Shards not final yet, in layout order."""
        return [n for n in self.shards if not self._shards[n].done]

    def shard_layout(self, name: str) -> tuple[bytes, tuple[str, ...]]:
        """Shard ``name``'s header bytes and its tensors in file order: the file is the header, then
        each tensor's bytes, back to back (what another process writes for ``adopt``)."""
        sh = self._shard(name)
        return sh.prefix, tuple(sh.tensors)

    def adopt(self, name: str, sha256: str) -> None:
        """Shard ``name`` was written whole under its final name by another process (atomically, as
        ``shard_layout`` says): checked as a resumed shard is (size and header), then final here
        with that ``sha256``; ``on_shard_final`` runs as for a shard written here."""
        sh = self._shard(name)
        with self._lock:
            self._check_open()
            if sh.done or sh.fd is not None:
                raise UsageError(f"shard {name!r} is already final or being written here", file=str(self.dst_dir))
            wrong = self._unlike_layout(sh)
            if wrong is not None:
                raise ShapeError(f"shard written by another process {wrong}", file=str(sh.final))
            self._mark_done(sh)
            self.sha256[name] = sha256
        if self._on_shard_final is not None:
            self._on_shard_final(sh.final)

    def _shard(self, name: str) -> _Shard:
        try:
            return self._shards[name]
        except (KeyError, TypeError):
            raise UsageError(f"no shard {name!r} in this layout", file=str(self.dst_dir)) from None

    def needs(self, name: str) -> bool:
        """Whether tensor ``name`` still has to be written (False once complete or resumed)."""
        self._spec(name)
        return not self._shards[self.shard_of[name]].done and not self._complete(name)

    # -- bookkeeping ---------------------------------------------------------

    @property
    def total_size(self) -> int:
        """Sum of tensor data bytes (the index's ``total_size``)."""
        return sum(s.nbytes for s in self.specs.values())

    def _spec(self, name: str) -> TensorSpec:
        try:
            return self.specs[name]
        except (KeyError, TypeError):
            raise UsageError("not in this writer's specs", tensor=str(name)) from None

    def _open_shard(self, sh: _Shard) -> int:
        if sh.fd is None:
            sh.tmp.unlink(missing_ok=True)  # a leftover from a crashed run is ours to replace
            fd = os.open(sh.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                self._pwrite_all(fd, memoryview(sh.prefix), 0)
            except BaseException:
                os.close(fd)
                sh.tmp.unlink(missing_ok=True)
                raise
            sh.fd = fd
            if self._hash_shards:
                from ._prefix_hash import PrefixHasher

                sh.hasher = PrefixHasher(sh.tmp, sh.file_size)
                self._advance_hash(sh)
        return sh.fd

    _pwrite_all = staticmethod(pwrite_all)   # a class attribute, so tests can make it fail

    def _complete(self, name: str) -> bool:
        r = self._ranges[name]
        return len(r) == 1 and r[0][0] == 0 and r[0][1] == self.specs[name].nbytes

    def _record(self, name: str, start: int, end: int) -> None:
        """Merge [start, end) into the tensor's sorted, disjoint range list."""
        r = self._ranges[name]
        i = bisect.bisect_left(r, [start, start])
        if i > 0 and r[i - 1][1] >= start:
            i -= 1
        j = i
        while j < len(r) and r[j][0] <= end:
            start = min(start, r[j][0])
            end = max(end, r[j][1])
            j += 1
        r[i:j] = [[start, end]]

    # -- writing -------------------------------------------------------------

    def write(self, name: str, data: Any) -> None:
        """Write a whole tensor (exactly its byte size)."""
        spec = self._spec(name)
        view = _as_bytes_view(data, tensor=name)
        if view.nbytes != spec.nbytes:
            raise ShapeError(f"{spec.dtype} {list(spec.shape)} needs {spec.nbytes:,} bytes, got {view.nbytes:,}",
                             tensor=name)
        self.write_chunk(name, 0, view)

    def write_chunk(self, name: str, offset: int, data: Any) -> None:
        """Write ``data`` at byte ``offset`` inside tensor ``name``."""
        view = _as_bytes_view(data, tensor=name)
        begun = self._begin(name, offset, view.nbytes)
        if begun is None:
            return
        fd, at = begun
        try:
            self._pwrite_all(fd, view, at)
        except BaseException:
            self._end(name, offset, view.nbytes, written=False)
            raise
        self._end(name, offset, view.nbytes, written=True)

    def place(self, name: str) -> tuple[str, int]:
        """Where tensor ``name``'s bytes go, for a writer in another process: (file path, offset
        of its first byte).  That writer opens the path (it exists now, under a temporary name)
        and writes exactly the tensor's bytes there; then call ``mark_written(name)``.  Until
        then the shard cannot turn final."""
        spec = self._spec(name)
        begun = self._begin(name, 0, spec.nbytes)
        if begun is None:
            raise UsageError("a tensor of 0 bytes has nothing to place", tensor=name)
        return str(self._shards[self.shard_of[name]].tmp), begun[1]

    def mark_written(self, name: str, *, written: bool = True) -> None:
        """Tensor ``name``, given out by ``place``, now holds all its bytes (``written=False``:
        the other writer failed, nothing is recorded)."""
        self._end(name, 0, self._spec(name).nbytes, written=written)

    def _begin(self, name: str, offset: int, nbytes: int) -> tuple[int, int] | None:
        """Check a write of ``nbytes`` at ``offset`` in ``name`` and count it in flight; return
        (shard fd, file offset), or None when there is nothing to write."""
        spec = self._spec(name)
        if not isinstance(offset, (int, np.integer)) or offset < 0:
            raise UsageError(f"offset must be a non-negative int, got {offset!r}", tensor=name)
        offset = int(offset)
        if offset + nbytes > spec.nbytes:
            raise ShapeError(f"write of {nbytes:,} bytes at {offset:,} passes the tensor's end "
                             f"({spec.nbytes:,} bytes)", tensor=name)
        sh = self._shards[self.shard_of[name]]
        with self._lock:
            self._check_open()
            if self._complete(name) or (spec.nbytes == 0):
                if nbytes == 0:
                    return None
                raise UsageError("tensor already fully written", tensor=name)
            if nbytes == 0:
                return None
            fd = self._open_shard(sh)
            sh.inflight += 1
        return fd, self._offset[name] + offset

    def _end(self, name: str, offset: int, nbytes: int, *, written: bool) -> None:
        """A write counted by ``_begin`` is over: record it, and finalize the shard when it is complete."""
        sh = self._shards[self.shard_of[name]]
        with self._lock:
            sh.inflight -= 1
            if not written or self._aborted:
                return
            self._record(name, int(offset), int(offset) + nbytes)
            if self._complete(name):
                sh.pending.discard(name)
            if sh.hasher is not None:
                self._advance_hash(sh)
            if not sh.pending and sh.inflight == 0 and not sh.done:
                self._finalize(sh)
            elif self._hashing:
                self._report_hashed(wait=False)

    def _advance_hash(self, sh: _Shard) -> None:
        """Tell the shard's hasher how far its bytes are written without a gap (lock held)."""
        while sh.cursor < len(sh.tensors) and (self.specs[sh.tensors[sh.cursor]].nbytes == 0
                                               or self._complete(sh.tensors[sh.cursor])):
            sh.cursor += 1
        if sh.cursor == len(sh.tensors):
            upto = sh.file_size
        else:
            t = sh.tensors[sh.cursor]
            r = self._ranges[t]
            upto = self._offset[t] + (r[0][1] if r and r[0][0] == 0 else 0)
        sh.hasher.advance(upto)

    def _check_open(self) -> None:
        if self._aborted:
            raise UsageError("writer was aborted")
        if self._closed:
            raise UsageError("writer is closed")

    def _finalize(self, sh: _Shard) -> None:
        """Flush, fsync, chmod and rename one complete shard (lock held)."""
        fd = self._open_shard(sh)  # shards of only empty tensors are opened here
        try:
            size = os.fstat(fd).st_size
            assert size == sh.file_size, (sh.name, size, sh.file_size)
            os.fsync(fd)
            os.fchmod(fd, _FILE_MODE)
        finally:
            os.close(fd)
            sh.fd = None
        os.replace(sh.tmp, sh.final)
        _fsync_dir(self.dst_dir)
        sh.done = True
        # Re-read what landed under the final name: the header must parse with
        # our strict rules and describe exactly this file.
        h = read_header(sh.final)
        assert h.file_size == sh.file_size and set(h.tensors) == set(sh.tensors), sh.name
        if sh.hasher is not None:
            # Its hash may lag the writes: it finishes on its own thread while later shards are
            # written, and on_shard_final runs once it is ready (_report_hashed).
            sh.hasher.finish()
            self._hashing.append(sh)
            self._report_hashed(wait=False)
        elif self._on_shard_final is not None:
            self._on_shard_final(sh.final)

    def _report_hashed(self, *, wait: bool) -> None:
        """Record the digests that are ready (all of them with ``wait``) and run on_shard_final
        for their shards, in the order the shards turned final (lock held)."""
        while self._hashing and (wait or self._hashing[0].hasher.ready()):
            sh = self._hashing.pop(0)
            self.sha256[sh.name] = sh.hasher.hexdigest()
            sh.hasher = None
            if self._on_shard_final is not None:
                self._on_shard_final(sh.final)

    def missing(self) -> dict[str, int]:
        """Tensors not yet complete, with the number of bytes still unwritten."""
        with self._lock:
            out = {}
            for name, spec in self.specs.items():
                have = sum(e - s for s, e in self._ranges[name])
                if have != spec.nbytes:
                    out[name] = spec.nbytes - have
            return out

    def close(self) -> list[Path]:
        """Check every byte was written, finalize remaining shards, write the
        index; returns the final paths (shards, then the index if written).
        An incomplete writer is aborted and ``ShapeError`` names what is missing."""
        if self._closed:
            raise UsageError("writer is already closed")
        self._check_open()
        missing = self.missing()
        if missing:
            self.abort()
            first = next(iter(missing))
            raise ShapeError(f"{len(missing)} tensor(s) incomplete at close, e.g. {first!r} lacks "
                             f"{missing[first]:,} bytes", file=str(self.dst_dir), tensor=first)
        try:
            with self._lock:
                for sh in self._shards.values():
                    if not sh.done:
                        self._finalize(sh)
                self._report_hashed(wait=True)
            if self.write_index:
                index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(self.shard_of)}
                atomic_write_bytes(self.index_path,
                                    (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return [self._shards[n].final for n in self.shards] + ([self.index_path] if self.write_index else [])

    def abort(self) -> None:
        """Remove temporary files; final names are never touched.  Shards already final whose
        hash was still running are waited for and reported (best effort), so a resumed run
        keeps them."""
        with self._lock:
            self._aborted = True
            while self._hashing:    # each pass takes at least one shard off the list
                try:
                    self._report_hashed(wait=True)
                except Exception:   # noqa: BLE001  (the caller's own error is the one to see)
                    pass
            for sh in self._shards.values():
                if sh.fd is not None:
                    os.close(sh.fd)
                    sh.fd = None
                if sh.hasher is not None:
                    sh.hasher.close()
                    sh.hasher = None
                if not sh.done:
                    sh.tmp.unlink(missing_ok=True)
            self.index_path.with_name(f".{self.index_path.name}.partial").unlink(missing_ok=True)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        if not self._closed and not self._aborted:
            self.close()


def save_file(
    path: str | os.PathLike,
    tensors: dict[str, np.ndarray | tuple[str, tuple[int, ...], bytes]],
    metadata: dict[str, str] | None = None,
    *,
    overwrite: bool = True,
) -> Path:
    """Write one safetensors file atomically, tensors in the given order.

    Values are numpy arrays (dtype mapped by ``dtypes.from_numpy``; ml_dtypes
    bfloat16/float8 included) or ``(dtype, shape, raw_bytes)`` for dtypes numpy
    cannot hold (F4, F6, ...).  Like ``safetensors.numpy.save_file`` an existing
    file is replaced unless ``overwrite=False``.
    """
    path = Path(path)
    specs: list[TensorSpec] = []
    payload: list[Any] = []
    for name, value in tensors.items():
        if isinstance(value, np.ndarray):
            arr = value if value.flags.c_contiguous else value.copy(order="C")  # ascontiguousarray makes 0-d 1-d
            if arr.dtype.byteorder == ">":
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            specs.append(TensorSpec(name, dtypes.from_numpy(arr.dtype), tuple(arr.shape)))
            payload.append(arr)
        elif isinstance(value, tuple) and len(value) == 3:
            dt, shape, raw = value
            specs.append(TensorSpec(name, dt, tuple(shape)))
            payload.append(raw)
        else:
            raise UsageError(f"tensor value must be an ndarray or (dtype, shape, bytes), got {type(value).__name__}",
                             tensor=name)
    template = path.name.replace("{", "{{").replace("}", "}}")
    with ShardedWriter(path.parent, specs, max_shard_bytes=1 << 62, name_template=template,
                       metadata=metadata, write_index=False, overwrite=overwrite) as w:
        for spec, data in zip(specs, payload):
            w.write(spec.name, data)
    return path
