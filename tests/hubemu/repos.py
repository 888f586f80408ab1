"""The emulator's repos: local folders served as model repos at fixed commits.

Each revision of a repo is a folder on disk, snapshotted (paths and sizes) when
it is added; bytes are read from the folder when served.  Hashes follow the
Hub: a regular file's oid is its git blob sha1; an LFS-like file (by suffix or
size) has a sha256 ``lfs.oid`` and the git sha1 of its LFS pointer as ``oid``.
sha256 of a file larger than ``REAL_SHA256_LIMIT`` (the sparse multi-GB
shards of a virtual K3) would mean reading terabytes of holes, so those get a
stand-in hash, flagged in ``FileEntry.sha256_is_real``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5")
LFS_MIN_BYTES = 10 << 20            # the Hub stores larger files in LFS whatever their name
REAL_SHA256_LIMIT = 256 << 20
_CHUNK = 8 << 20


def _file_hash(path: Path, h, prefix: bytes = b"") -> str:
    h.update(prefix)
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


@dataclass
class FileEntry:
    """One file of one revision."""

    path: str
    local: Path
    size: int
    lfs: bool
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _sha256: str | None = field(default=None, repr=False)
    _sha1: str | None = field(default=None, repr=False)

    @property
    def sha256_is_real(self) -> bool:
        return self.size <= REAL_SHA256_LIMIT

    @property
    def sha256(self) -> str:
        with self._lock:
            if self._sha256 is None:
                if self.sha256_is_real:
                    self._sha256 = _file_hash(self.local, hashlib.sha256())
                else:
                    self._sha256 = hashlib.sha256(f"stand-in:{self.path}:{self.size}".encode()).hexdigest()
            return self._sha256

    @property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()

    @property
    def oid(self) -> str:
        """Git blob sha1 of what git stores: the content, or the LFS pointer."""
        with self._lock:
            cached = self._sha1
        if cached is None:
            if self.lfs:
                p = self.pointer
                cached = hashlib.sha1(b"blob %d\0" % len(p) + p).hexdigest()
            else:
                cached = _file_hash(self.local, hashlib.sha1(), b"blob %d\0" % self.size)
            with self._lock:
                self._sha1 = cached
        return cached

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.oid

    def tree_entry(self) -> dict:
        e = {"type": "file", "path": self.path, "size": self.size, "oid": self.oid}
        if self.lfs:
            e["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": len(self.pointer)}
        return e

    def sibling(self, blobs: bool) -> dict:
        s: dict = {"rfilename": self.path}
        if blobs:
            s["size"] = self.size
            s["blobId"] = self.oid
            if self.lfs:
                s["lfs"] = {"sha256": self.sha256, "size": self.size, "pointerSize": len(self.pointer)}
        return s


@dataclass
class Revision:
    """A repo's tree at one commit."""

    commit: str
    root: Path
    files: dict[str, FileEntry]
    dirs: set[str]

    @classmethod
    def scan(cls, commit: str, root: Path) -> Revision:
        files: dict[str, FileEntry] = {}
        dirs: set[str] = set()
        root = Path(root)
        for dirpath, dirnames, filenames in os.walk(root):
            rel = Path(dirpath).relative_to(root).as_posix()
            rel = "" if rel == "." else rel
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".git"))
            for d in dirnames:
                dirs.add(f"{rel}/{d}" if rel else d)
            for fn in sorted(filenames):
                p = Path(dirpath) / fn
                if p.is_symlink() or not p.is_file():
                    continue  # a repo holds no links
                rp = f"{rel}/{fn}" if rel else fn
                size = p.stat().st_size
                files[rp] = FileEntry(rp, p, size, fn.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES)
        return cls(commit, root, files, dirs)

    def is_dir(self, path: str) -> bool:
        return path == "" or path in self.dirs

    def children(self, path: str, recursive: bool) -> list[dict]:
        """Tree entries under ``path`` (a folder): dirs and files, sorted by path."""
        prefix = path + "/" if path else ""
        out = []
        for d in sorted(self.dirs):
            rest = d[len(prefix):]
            if d.startswith(prefix) and (recursive or "/" not in rest):
                out.append({"type": "directory", "path": d, "oid": hashlib.sha1(f"tree:{d}".encode()).hexdigest()})
        for p, f in sorted(self.files.items()):
            rest = p[len(prefix):]
            if p.startswith(prefix) and (recursive or "/" not in rest):
                out.append(f.tree_entry())
        return out

    def entry(self, path: str) -> dict | None:
        if path in self.files:
            return self.files[path].tree_entry()
        if path in self.dirs:
            return {"type": "directory", "path": path, "oid": hashlib.sha1(f"tree:{path}".encode()).hexdigest()}
        return None


def fake_commit(repo_id: str, name: str) -> str:
    return hashlib.sha1(f"commit:{repo_id}:{name}".encode()).hexdigest()


@dataclass
class Repo:
    """A model repo: named refs (branches/tags) pointing at commits."""

    repo_id: str
    refs: dict[str, str] = field(default_factory=dict)          # name -> commit
    commits: dict[str, Revision] = field(default_factory=dict)  # commit -> tree
    default: str = "main"
    private: bool = False       # set by a push with private=True (model info reports it)

    def add_revision(self, name: str, folder: str | os.PathLike, commit: str | None = None) -> str:
        commit = commit or fake_commit(self.repo_id, name)
        self.commits[commit] = Revision.scan(commit, Path(folder))
        self.refs[name] = commit
        return commit

    def resolve(self, rev: str | None) -> Revision | None:
        rev = rev or self.default
        if rev in self.refs:
            return self.commits[self.refs[rev]]
        return self.commits.get(rev)

    def commit(self, rev: str | None = None) -> str:
        r = self.resolve(rev)
        assert r is not None, rev
        return r.commit
