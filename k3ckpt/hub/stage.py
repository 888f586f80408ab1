"""Shards of an ``hf://`` checkpoint downloaded one at a time, verified, within a disk budget.

A conversion from the Hub stages a source shard (downloads it into a staging
folder), converts the tensors it holds, and releases it (deletes it unless
asked to keep it).  ``ShardStager`` does the staging part:

* bytes come by ``Range`` requests through ``HubClient.read_range``
  (huggingface_hub's HTTP stack, bounded retries, resumption after a dropped
  connection), 16 MiB at a time, into ``.<shard>.partial``;
* a run that was killed mid-download continues from the partial file's size
  on the next run, after re-hashing what is already there;
* the whole file must hash to the listing's LFS sha256 (or, for a file stored
  without LFS, to its git blob id) before it is renamed to its final name and
  used; a mismatch deletes the download and tries once more, then fails with a
  ``RemoteError``: a corrupt shard is never converted;
* ``max_bytes`` bounds the staged bytes (partial files included); a fetch that
  would pass it raises ``DiskSpaceError`` before downloading anything.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import DiskSpaceError, RemoteError
from ..io.reader import check_shard_name
from .client import HubClient
from .remote import HubCheckpointFiles, RemoteFile

CHUNK = 16 << 20


@dataclass(frozen=True)
class StagedShard:
    name: str
    path: Path
    size: int
    sha256: str


def _hashers(f: RemoteFile):
    """sha256 for LFS files; git's blob sha1 for files stored in git (no LFS sha256 listed)."""
    sha = hashlib.sha256()
    blob = hashlib.sha1(b"blob %d\x00" % f.size) if f.sha256 is None and f.blob_id else None
    return sha, blob


class ShardStager:
    """Download, verify and release the shards of one pinned hub checkpoint."""

    def __init__(self, files: HubCheckpointFiles, client: HubClient, folder: str | os.PathLike, *,
                 max_bytes: int | None = None, keep: bool = False,
                 progress: Callable[[str, int], None] | None = None):
        self.files = files
        self.client = client
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.keep = keep
        self.progress = progress          # called with (shard, bytes just received)
        self.staged: dict[str, StagedShard] = {}
        self.bytes_downloaded = 0   # the folder is made on the first download: an output folder
        # that holds it must still look empty to the run that starts there

    def _remote(self, shard: str) -> RemoteFile:
        try:
            return self.files.shards[shard]
        except KeyError:
            raise RemoteError(f"no shard {shard!r} in the checkpoint", file=str(self.files.url)) from None

    def _path(self, shard: str) -> Path:
        check_shard_name(shard, source=str(self.files.url))
        return self.folder / shard

    def on_disk(self) -> int:
        """Staged and partially downloaded bytes in the staging folder now."""
        total = 0
        if not self.folder.is_dir():
            return 0
        for p in self.folder.rglob("*"):
            if p.is_file():
                total += p.stat().st_size
        return total

    def fetch(self, shard: str) -> StagedShard:
        """The shard as a verified local file (downloaded now, or found from an earlier run)."""
        if shard in self.staged:
            return self.staged[shard]
        f = self._remote(shard)
        final = self._path(shard)
        partial = final.with_name(f".{final.name}.partial")
        have = final.stat().st_size if final.is_file() else partial.stat().st_size if partial.is_file() else 0
        if self.max_bytes is not None:
            need = self.on_disk() - have + f.size
            if need > self.max_bytes:
                raise DiskSpaceError(f"staging shard {shard!r} ({f.size:,} bytes) would hold {need:,} bytes, over "
                                     f"the {self.max_bytes:,}-byte budget", file=str(self.folder))
        if final.is_file():  # from an earlier run: trust nothing until it hashes right
            final.rename(partial)
        for attempt in (1, 2):
            digest = self._download(f, shard, partial)
            if digest is not None:
                break
            partial.unlink(missing_ok=True)
            if attempt == 2:
                raise RemoteError("downloaded bytes do not match the sha256 / git blob id the Hub lists for this "
                                  "file, twice; nothing was converted from it", file=self.files.label(f.path))
        os.replace(partial, final)
        staged = StagedShard(shard, final, f.size, digest)
        self.staged[shard] = staged
        return staged

    def _download(self, f: RemoteFile, shard: str, partial: Path) -> str | None:
        """Fill ``partial`` up to the file's size; its sha256 if it verifies, else None."""
        final_parent = partial.parent
        final_parent.mkdir(parents=True, exist_ok=True)
        sha, blob = _hashers(f)
        fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            pos = 0
            size_now = os.fstat(fd).st_size
            if size_now > f.size:
                os.ftruncate(fd, 0)
                size_now = 0
            while pos < size_now:  # re-hash what an earlier run left
                chunk = os.pread(fd, min(CHUNK, size_now - pos), pos)
                sha.update(chunk)
                if blob is not None:
                    blob.update(chunk)
                pos += len(chunk)
            buf = bytearray(CHUNK)
            url = self.client.file_url(self.files.requested.repo_id, f.path, self.files.commit)
            while pos < f.size:
                n = min(CHUNK, f.size - pos)
                view = memoryview(buf)[:n]
                self.client.read_range(url, pos, view, size=f.size, label=self.files.label(f.path),
                                       repo_id=self.files.requested.repo_id, commit=self.files.commit)
                os.pwrite(fd, view, pos)
                sha.update(view)
                if blob is not None:
                    blob.update(view)
                pos += n
                self.bytes_downloaded += n
                if self.progress is not None:
                    self.progress(shard, n)
            os.fsync(fd)
        finally:
            os.close(fd)
        ok = (sha.hexdigest() == f.sha256) if f.sha256 else (blob is None or blob.hexdigest() == f.blob_id)
        return sha.hexdigest() if ok else None

    def release(self, shard: str) -> None:
        """Done with a shard: delete it (unless ``keep``)."""
        staged = self.staged.pop(shard, None)
        if staged is not None and not self.keep:
            staged.path.unlink(missing_ok=True)
