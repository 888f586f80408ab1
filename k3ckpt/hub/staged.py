"""An ``hf://`` checkpoint whose tensor bytes come from shards downloaded one at a time.

``open_staged(url, dst)`` opens the checkpoint remotely (index, config and
headers by range reads: ``open_hub_checkpoint``) and returns a
``StagedCheckpoint``: the same interface as a local ``Checkpoint``, so the
requant and shard pipelines need no hub knowledge.  Each read is served from
a verified local copy of its shard:

* the first read of a shard downloads it whole into the staging folder
  (``DST/.k3ckpt-staging`` by default) through ``ShardStager`` (range
  requests, sha256 verified before use, resumes a partial file);
* moving on to a later shard releases (deletes, unless ``keep_source``) the
  shards more than ``window - 1`` behind it.  The pipelines read in source
  order, so every shard is downloaded once; ``window = 2`` lets a read that
  straddles a shard boundary, or a worker pool reading a few weights ahead,
  keep the previous shard;
* ``max_disk`` bounds staged shards plus the output folder.  The output's
  share is ``preflight(bytes)``'s reserve (the plan's estimate plus headers) or what it holds
  on disk, whichever is larger; before a download that would pass the
  budget the oldest staged shards are released, and if that is not enough a
  ``DiskSpaceError`` is raised before any byte is fetched.  ``preflight``
  refuses a budget that cannot hold the largest shard plus the output.

A shard read again after it was released (out-of-order reads, or a budget of
exactly one shard) is downloaded again: correct, and counted in
``StageStats.refetches``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DiskSpaceError, UsageError
from ..io.reader import Checkpoint, LocalFile
from .url import HubUrl, parse_hub_url

STAGING_DIR = ".k3ckpt-staging"
OUTPUT_SLACK = 1 << 20   # manifest, index, config, report: small files besides the planned tensors
HEADER_BYTES_PER_TENSOR = 256   # output safetensors headers and index entries (K3 averages ~160)
BLOCK = 4096             # files take whole filesystem blocks: budget checks round sizes up to them


def _blocks(n: int) -> int:
    return -(-int(n) // BLOCK) * BLOCK


def allocated_bytes(path: str | os.PathLike, *, exclude: str | os.PathLike | None = None) -> int:
    """Disk blocks in use by the files under ``path`` (sparse holes not counted), skipping ``exclude``."""
    root = Path(path)
    skip = Path(exclude).resolve() if exclude is not None else None
    total = 0
    if not root.exists():
        return 0
    if root.is_file():
        return root.stat().st_blocks * 512
    for dirpath, dirnames, filenames in os.walk(root):
        if skip is not None:
            dirnames[:] = [d for d in dirnames if (Path(dirpath) / d).resolve() != skip]
        for fn in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, fn)).st_blocks * 512
            except FileNotFoundError:  # a temporary renamed while we walked
                pass
    return total


@dataclass(frozen=True)
class DiskPreflight:
    """The figures a ``--max-disk`` budget is checked against."""

    max_disk: int
    largest_shard: str
    largest_shard_bytes: int
    output_bytes: int          # the run's output estimate (plus slack)
    output_on_disk: int        # already in the output folder (a resumed run)
    staged_on_disk: int        # already staged (a resumed run's kept or partial shards)
    keep_source_bytes: int = 0  # --keep-source: every shard stays, so all of them count

    @property
    def need(self) -> int:
        return max(self.output_bytes, self.output_on_disk) + _blocks(max(self.largest_shard_bytes,
                                                                          self.keep_source_bytes))

    @property
    def ok(self) -> bool:
        return self.need <= self.max_disk

    def message(self) -> str:
        out = max(self.output_bytes, self.output_on_disk)
        if self.keep_source_bytes:
            return (f"--max-disk {self.max_disk:,} bytes cannot work with --keep-source: every source shard "
                    f"({self.keep_source_bytes:,} bytes) plus the output ({out:,} bytes) need {self.need:,} bytes")
        return (f"--max-disk {self.max_disk:,} bytes cannot work: the largest source shard "
                f"({self.largest_shard}, {self.largest_shard_bytes:,} bytes) plus the output "
                f"({out:,} bytes) need {self.need:,} bytes")


def budget_check(shard_sizes: dict[str, int], tensors: int, output_bytes: int, max_disk: int | None, *,
                 keep_source: bool = False, output_on_disk: int = 0, staged_on_disk: int = 0) -> DiskPreflight:
    """The ``--max-disk`` figures for a source with these shards and ``tensors`` tensors and an output
    of ``output_bytes`` tensor bytes (check ``.ok``; nothing is raised here)."""
    big = max(shard_sizes, key=shard_sizes.__getitem__)
    reserve = int(output_bytes) + OUTPUT_SLACK + HEADER_BYTES_PER_TENSOR * int(tensors)
    return DiskPreflight(max_disk or 0, big, shard_sizes[big], reserve, output_on_disk, staged_on_disk,
                         sum(shard_sizes.values()) if keep_source else 0)


@dataclass(frozen=True)
class StageStats:
    """What staging did so far."""

    downloads: int             # shards staged and verified (downloaded now, or found from an earlier run)
    refetches: int             # downloads of a shard that had been staged before
    bytes_downloaded: int      # shard bytes received (a resumed partial counts only its remainder)
    peak_disk: int             # bound on the disk held: staged bytes + the output's reserve (or size, if
    #                            larger), the largest over every staging (the budget is checked on it)
    staged: tuple[str, ...]    # shards staged now

    def to_dict(self) -> dict[str, Any]:
        return {"downloads": self.downloads, "refetches": self.refetches,
                "bytes_downloaded": self.bytes_downloaded, "peak_disk": self.peak_disk,
                "staged": list(self.staged)}


class ShardWindow:
    """Which shards are staged: fetch on first read, release behind, stay within ``max_disk``."""

    def __init__(self, stager, order: list[str], *, output_dir: str | os.PathLike, window: int = 2,
                 max_disk: int | None = None, tensors: int = 0):
        if not isinstance(window, int) or window < 1:
            raise UsageError(f"window must be an int >= 1, found {window!r}")
        self.stager = stager
        self.pos = {n: i for i, n in enumerate(order)}
        self.output_dir = Path(output_dir)
        self.window = window
        self.max_disk = max_disk
        self.reserve = 0
        self.tensors = tensors
        self._local: dict[str, LocalFile] = {}
        self._seen: dict[str, int] = {}
        self._front = -1
        self._peak = 0
        self._lock = threading.RLock()
        self.output_bytes = None   # optional () -> int: the output's bytes on disk, when it is not a folder

    # -- budget ------------------------------------------------------------------

    def output_on_disk(self) -> int:
        if self.output_bytes is not None:
            return self.output_bytes()
        return allocated_bytes(self.output_dir, exclude=self.stager.folder)

    def staged_on_disk(self) -> int:
        return allocated_bytes(self.stager.folder)

    def preflight(self, output_bytes: int) -> DiskPreflight:
        """Reserve ``output_bytes`` (tensor data) plus headers and small files for the output, and
        check the budget can work (``DiskSpaceError`` if not)."""
        sizes = {n: f.size for n, f in self.stager.files.shards.items()}
        pf = budget_check(sizes, self.tensors, output_bytes, self.max_disk, keep_source=self.stager.keep,
                          output_on_disk=self.output_on_disk(), staged_on_disk=self.staged_on_disk())
        self.reserve = pf.output_bytes
        if self.max_disk is not None and not pf.ok:
            raise DiskSpaceError(pf.message(), file=str(self.output_dir))
        return pf

    def _make_room(self, shard: str) -> None:
        if self.max_disk is None:
            return
        size = _blocks(self.stager.files.shards[shard].size)
        while True:
            out = max(self.reserve, self.output_on_disk())
            staged = self.staged_on_disk()
            have = sum(allocated_bytes(p) for p in self._files_of(shard))   # reused, not added
            need = out + staged - have + size
            if need <= self.max_disk:
                return
            if not self.stager.keep:  # an interrupted run's leftovers of other shards go first
                stale = [p for n in self.pos if n != shard and n not in self._local for p in self._files_of(n)]
                if stale:
                    for p in stale:
                        p.unlink(missing_ok=True)
                    continue
            others = sorted((n for n in self._local if n != shard), key=self.pos.__getitem__)
            if not others or self.stager.keep:
                raise DiskSpaceError(
                    f"staging {shard} ({size:,} bytes) would bring the disk use to {need:,} bytes (output "
                    f"{out:,}, staged {staged - have:,}), over --max-disk {self.max_disk:,}",
                    file=str(self.stager.folder))
            self._release(others[0])

    def _files_of(self, shard: str) -> list[Path]:
        """The staged file and/or partial download of ``shard`` present in the staging folder."""
        p = self.stager.folder / shard
        return [q for q in (p, p.with_name(f".{p.name}.partial")) if q.is_file()]

    # -- staging -----------------------------------------------------------------

    def local(self, shard: str) -> LocalFile:
        """The shard as a verified local file, staging it (and releasing old ones) if needed."""
        with self._lock:
            f = self._local.get(shard)
            if f is not None:
                return f
            self._make_room(shard)
            staged = self.stager.fetch(shard)
            f = LocalFile(staged.path, name=shard)
            self._local[shard] = f
            self._seen[shard] = self._seen.get(shard, 0) + 1
            p = self.pos[shard]
            if p > self._front:
                self._front = p
                for n in [n for n in self._local if self.pos[n] <= p - self.window]:
                    self._release(n)
            self._peak = max(self._peak, max(self.reserve, self.output_on_disk()) + self.staged_on_disk())
            return f

    def _release(self, shard: str) -> None:
        f = self._local.pop(shard, None)
        if f is not None:
            f.close()
            self.stager.release(shard)

    def release(self, shard: str) -> None:
        """Release ``shard`` now: the caller knows no later read needs it."""
        with self._lock:
            self._release(shard)

    def release_all(self) -> None:
        with self._lock:
            for n in list(self._local):
                self._release(n)

    def close_files(self) -> None:
        """Close descriptors but leave staged files in place (an interrupted run resumes from them)."""
        with self._lock:
            for f in self._local.values():
                f.close()

    def stats(self) -> StageStats:
        with self._lock:
            return StageStats(sum(self._seen.values()), sum(c - 1 for c in self._seen.values()),
                              self.stager.bytes_downloaded, self._peak,
                              tuple(sorted(self._local, key=self.pos.__getitem__)))


class _StagedSource:
    """A ``ByteSource`` whose bytes come from the staged local copy of one shard."""

    def __init__(self, window: ShardWindow, name: str, size: int):
        self._window = window
        self.name = name
        self.size = size

    def pread(self, offset: int, n: int) -> bytes:
        return self._window.local(self.name).pread(offset, n)

    def pread_into(self, offset: int, buf: memoryview) -> None:
        self._window.local(self.name).pread_into(offset, buf)

    def close(self) -> None:
        pass  # the window owns the descriptors

    def __repr__(self) -> str:
        return f"_StagedSource({self.name!r})"


class StagedCheckpoint(Checkpoint):
    """A remote checkpoint read from staged local shards (module docstring).

    ``hub`` is the ``HubSource`` (pinned commit); ``staging`` the ``ShardWindow``.
    ``close()`` leaves staged and partial shards for a resumed run; ``finish()``
    (after a successful run) releases them and removes the staging folder."""

    def __init__(self, remote: Checkpoint, window: ShardWindow):
        sources = {n: _StagedSource(window, n, remote.shard_size(n)) for n in remote.shards}
        super().__init__(root=None, config=remote.config, index_metadata=remote.index_metadata,
                         shards=list(remote.shards), headers=remote.headers, tensors=remote.tensors,
                         sources=sources, origin=remote.origin, hub=remote.hub)
        self.staging = window
        self._remote = remote

    def __repr__(self) -> str:
        return f"<StagedCheckpoint {self.hub.url}: {len(self.shards)} shards, {len(self.tensors)} tensors>"

    def close(self) -> None:
        self.staging.close_files()
        self._remote.close()

    def finish(self) -> None:
        """Release every staged shard (kept with ``keep_source``) and remove an empty staging folder."""
        self.staging.release_all()
        stager = self.staging.stager
        folder = stager.folder
        if not stager.keep:  # an interrupted run's leftovers of shards this run did not need again
            for n in self.shards:
                p = folder / n
                for q in (p, p.with_name(f".{p.name}.partial")):
                    q.unlink(missing_ok=True)
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def resume_commit(dst: str | os.PathLike) -> str | None:
    """The source commit an earlier run in ``dst`` recorded in its manifest (None if none)."""
    from ..io.manifest import MANIFEST_NAME, RunManifest

    if not (Path(dst) / MANIFEST_NAME).is_file():
        return None
    commit = RunManifest.load(dst).source.get("commit")
    return commit if isinstance(commit, str) else None


def open_staged(url: str | HubUrl, dst: str | os.PathLike, *, staging: str | os.PathLike | None = None,
                keep_source: bool = False, max_disk: int | None = None, resume: bool = False,
                endpoint: str | None = None, token: str | bool | None = None, client=None,
                window: int = 2) -> StagedCheckpoint:
    """Open ``url`` for a download-and-convert run writing ``dst``.

    ``staging``: where shards are downloaded (default ``dst/.k3ckpt-staging``);
    ``keep_source``: never delete them; ``max_disk``: bytes for staged shards
    plus output (call ``ckpt.staging.preflight(output_bytes)`` once the output
    size is known); ``resume``: pin the commit an earlier run in ``dst``
    recorded, so a branch that moved meanwhile is not mixed in."""
    from huggingface_hub import constants

    from ..completeness import require_complete
    from ..errors import RemoteError
    from .client import HubClient
    from .remote import open_hub_checkpoint
    from .stage import ShardStager

    ref = url if isinstance(url, HubUrl) else parse_hub_url(url)
    if resume:
        commit = resume_commit(dst)
        if commit is not None:
            ref = ref.pinned(commit)
    if max_disk is not None and (not isinstance(max_disk, int) or max_disk <= 0):
        raise UsageError(f"max_disk must be a positive number of bytes, found {max_disk!r}")
    if constants.is_offline_mode():
        raise RemoteError("HF_HUB_OFFLINE is set, so shards cannot be downloaded; unset it, or convert from "
                          "a local copy (e.g. the cached snapshot after `hf download`)", file=str(ref))
    client = client or HubClient(endpoint, token)
    # refused before anything is downloaded, as api.open_source refuses a local one
    remote = require_complete(open_hub_checkpoint(ref, client=client))
    try:
        folder = Path(staging) if staging is not None else Path(dst) / STAGING_DIR
        stager = ShardStager(remote.hub.files, client, folder, keep=keep_source)
        win = ShardWindow(stager, list(remote.shards), output_dir=dst, window=window, max_disk=max_disk,
                          tensors=len(remote.tensors))
        return StagedCheckpoint(remote, win)
    except BaseException:
        remote.close()
        raise
