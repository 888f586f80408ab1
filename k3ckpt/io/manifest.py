"""The progress record of one output folder, so an interrupted job can resume.

``k3ckpt-manifest.json`` sits in the output folder from the first moment a job
writes there.  It names the job, the options and the source identity the job
ran with, and every output file that is final (name, size, sha256).  A rerun
with ``resume=True`` trusts only what the manifest lists and refuses to go on
with different options or another source, so a resumed run produces the same
bytes as an uninterrupted one.  The manifest itself is always replaced
atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .. import __version__
from ..errors import InvalidFileError, OutputExistsError, ResumeMismatchError, UsageError
from .writer import atomic_write_json

MANIFEST_NAME = "k3ckpt-manifest.json"
MANIFEST_VERSION = 1
_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileRecord:
    name: str       # relative to the output folder
    size: int
    sha256: str


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in bounded chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _canonical(obj: Any) -> Any:
    """JSON round trip, so tuples and lists (and int-valued keys) compare equal to what was stored."""
    return json.loads(json.dumps(obj, sort_keys=True))


class RunManifest:
    """Which job writes ``root``, with what, and which of its files are final."""

    def __init__(self, root: Path, data: dict[str, Any]):
        self.root = root
        self._data = data
        self.records: dict[str, FileRecord] = {
            name: FileRecord(name, int(r["size"]), str(r["sha256"])) for name, r in data["files"].items()
        }

    @property
    def path(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def state(self) -> str:
        return self._data["state"]

    @classmethod
    def begin(cls, dst: str | os.PathLike, *, job: str, options: Mapping[str, Any], source: Mapping[str, Any],
              resume: bool) -> RunManifest:
        """Start a job in ``dst`` (absent or empty), or with ``resume`` continue the one recorded there."""
        root = Path(dst)
        if root.exists() and not root.is_dir():
            raise OutputExistsError("exists and is not a folder", file=str(root))
        occupied = root.is_dir() and any(root.iterdir())
        options, source = _canonical(dict(options)), _canonical(dict(source))
        if not occupied:
            root.mkdir(parents=True, exist_ok=True)
            data = {"manifest_version": MANIFEST_VERSION, "tool": f"k3ckpt {__version__}", "job": job,
                    "options": options, "source": source, "state": "running", "files": {}, "extra": {}}
            m = cls(root, data)
            m._save()
            return m
        existing = cls.load(root) if (root / MANIFEST_NAME).is_file() else None
        if not resume:
            if existing is not None and existing._data.get("job") == job:
                hint = "it holds an earlier k3ckpt run: pass --resume to continue it, or choose an empty folder"
            else:
                hint = "it is not empty and not a k3ckpt output of this job; choose an empty folder"
            raise OutputExistsError(hint, file=str(root))
        if existing is None:
            raise ResumeMismatchError("cannot resume: the folder has no k3ckpt manifest", file=str(root))
        diffs = [(k, want) for k, want in (("job", job), ("options", options), ("source", source))
                 if existing._data.get(k) != want]
        if diffs:
            detail = "; ".join(_describe_diff(k, existing._data.get(k), want) for k, want in diffs)
            raise ResumeMismatchError(f"cannot resume with different settings: {detail}", file=str(root))
        for stray in root.glob(".*.partial"):  # temporaries of the interrupted run
            stray.unlink(missing_ok=True)
        existing._data["state"] = "running"
        existing._save()
        return existing

    @classmethod
    def load(cls, root: str | os.PathLike) -> RunManifest:
        root = Path(root)
        path = root / MANIFEST_NAME
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise InvalidFileError("no k3ckpt manifest here", file=str(root)) from None
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidFileError(f"manifest is not valid JSON: {e}", file=str(path)) from None
        if (not isinstance(data, dict) or data.get("manifest_version") != MANIFEST_VERSION
                or not isinstance(data.get("files"), dict) or not isinstance(data.get("extra"), dict)):
            raise InvalidFileError(f"not a version-{MANIFEST_VERSION} k3ckpt manifest", file=str(path))
        return cls(root, data)

    # -- files -------------------------------------------------------------------

    def done(self, name: str) -> bool:
        """Listed as final and present with the recorded size (the hash is checked by ``verify``)."""
        rec = self.records.get(name)
        if rec is None:
            return False
        try:
            return (self.root / name).stat().st_size == rec.size
        except FileNotFoundError:
            return False

    def record(self, name: str, *, sha256: str | None = None) -> FileRecord:
        """List the final file ``root/name`` with its sha256 (computed here unless the writer
        already hashed it while writing: ``ShardedWriter(hash_shards=True)``)."""
        path = self.root / name
        if not path.is_file():
            raise UsageError(f"cannot record {name!r}: no such output file", file=str(self.root))
        rec = FileRecord(name, path.stat().st_size, sha256 or sha256_file(path))
        self.records[name] = rec
        self._data["files"][name] = {"size": rec.size, "sha256": rec.sha256}
        self._save()
        return rec

    def verify(self, name: str) -> bool:
        rec = self.records.get(name)
        return rec is not None and self.done(name) and sha256_file(self.root / name) == rec.sha256

    # -- free-form data and state --------------------------------------------------

    def put(self, key: str, value: Any) -> None:
        self._data["extra"][key] = _canonical(value)
        self._save()

    def get(self, key: str, default: Any = None) -> Any:
        return self._data["extra"].get(key, default)

    @property
    def options(self) -> dict[str, Any]:
        return self._data["options"]

    @property
    def source(self) -> dict[str, Any]:
        return self._data["source"]

    def finish(self, **summary: Any) -> None:
        self._data["state"] = "complete"
        if summary:
            self._data["summary"] = _canonical(summary)
        self._save()

    def _save(self) -> None:
        atomic_write_json(self.path, self._data, indent=1, sort_keys=True)


def _describe_diff(key: str, old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        parts = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:3]]
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        return f"{key} " + ", ".join(parts) + more
    return f"{key}: {old!r} -> {new!r}"
