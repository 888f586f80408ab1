"""The run manifest of a GGUF output: what a resumed run and ``k3ckpt verify`` check against.

``PREFIX.k3ckpt-manifest.json`` sits beside the output (``PREFIX`` is ``OUT``
without ``.gguf``, the prefix of its splits too).  It is written, atomically,
before the first byte of any split, and again each time a split becomes
final.  It holds the job's options and the source's identity (a resumed run
with other ones is refused, naming the first difference), the planned split
names with the tensors each holds, and each final split's size and sha256.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import InvalidFileError, NotFoundError, OutputExistsError, ResumeMismatchError
from ..io.writer import atomic_write_json

JOB = "gguf"
VERSION = 1
SUFFIX = ".k3ckpt-manifest.json"
_SPLIT = re.compile(r"^(?P<prefix>.+)-\d{5}-of-\d{5}\.gguf$")

# Manifest option keys and the flags that set them (a refused resume names the flag).
OPTION_FLAGS = {"expert_type": "--expert-type", "outtype": "--outtype", "split_max_bytes": "--split-max-size",
                "tensor_type": "--tensor-type", "target_bpw": "--target-bpw",
                "target_types": "--target-types", "fallback_type": "--fallback-type"}


def prefix_of(out: str | os.PathLike) -> str:
    """``OUT`` without ``.gguf``: the splits' prefix (``writer.split_paths``)."""
    name = Path(out).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def manifest_path(out: str | os.PathLike) -> Path:
    return Path(out).with_name(prefix_of(out) + SUFFIX)


def find_manifest(path: str | os.PathLike) -> Path:
    """The manifest of ``path``: ``OUT`` itself or any of its splits (``-0000i-of-0000N.gguf``)."""
    path = Path(path)
    candidates = [manifest_path(path)]
    m = _SPLIT.match(path.name)
    if m:
        candidates.append(path.with_name(m.group("prefix") + SUFFIX))
    for c in candidates:
        if c.is_file():
            return c
    raise NotFoundError(f"no k3ckpt GGUF manifest ({candidates[-1].name}) beside it: not a k3ckpt gguf output",
                        file=str(path))


def _canonical(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True))


def _show(key: str, v: Any) -> str:
    if v is None or v == []:
        return "not given"
    if key == "tensor_type":
        return " ".join(v)
    return str(v)


class GGUFManifest:
    """The manifest of one GGUF output (module docstring)."""

    def __init__(self, path: Path, data: dict[str, Any]):
        self.path = path
        self.data = data

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return self.data["files"]

    @property
    def splits(self) -> dict[str, list[list]]:
        """Split name -> its planned tensors as ``[name, ggml type, shape]``, in file order."""
        return self.data["splits"]

    @property
    def state(self) -> str:
        return self.data["state"]

    @property
    def source(self) -> dict[str, Any]:
        return self.data.get("source", {})

    @property
    def source_commit(self) -> str | None:
        """The commit an ``hf://`` source was pinned to (None for a local source)."""
        c = self.source.get("commit")
        return c if isinstance(c, str) else None

    @classmethod
    def load(cls, path: str | os.PathLike) -> GGUFManifest:
        path = Path(path)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise NotFoundError("no k3ckpt GGUF manifest", file=str(path)) from None
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidFileError(f"manifest is not valid JSON: {e}", file=str(path)) from None
        if (not isinstance(data, dict) or data.get("job") != JOB or data.get("manifest_version") != VERSION
                or not isinstance(data.get("files"), dict) or not isinstance(data.get("splits"), dict)):
            raise InvalidFileError(f"not a version-{VERSION} k3ckpt gguf manifest", file=str(path))
        return cls(path, data)

    @classmethod
    def begin(cls, out: str | os.PathLike, *, options: dict, source: dict, splits: dict[str, list[list]],
              resume: bool) -> GGUFManifest:
        """Start the run writing ``out`` or, with ``resume``, continue the one recorded beside it.

        Without ``resume`` an earlier run's manifest or any planned split already there is refused
        (``OutputExistsError``); with it, other options or another source are
        (``ResumeMismatchError``, one line naming the difference)."""
        path = manifest_path(out)
        options, source, splits = _canonical(options), _canonical(source), _canonical(splits)
        existing = path.is_file()
        if not resume:
            if existing:
                raise OutputExistsError("exists: an earlier k3ckpt gguf run wrote here; pass --resume to continue "
                                        "it, or choose another OUT", file=str(path))
            for name in splits:
                if (path.parent / name).exists():
                    raise OutputExistsError("exists; choose another OUT or remove it", file=str(path.parent / name))
        if existing and resume:
            m = cls.load(path)
            m._check_same(options, source)
            m.data["splits"] = splits      # same options and source: the same plan (headers are checked too)
            m.data["state"] = "running"
            m._save()
            return m
        if resume:
            there = [n for n in splits if (path.parent / n).exists()]
            if there:
                raise ResumeMismatchError(f"cannot resume: {there[0]} exists but no k3ckpt manifest "
                                          f"({path.name}) says which run wrote it", file=str(path.parent / there[0]))
        path.parent.mkdir(parents=True, exist_ok=True)
        m = cls(path, {"manifest_version": VERSION, "tool": f"k3ckpt {__version__}", "job": JOB,
                       "output": Path(out).name, "options": options, "source": source, "splits": splits,
                       "state": "running", "files": {}})
        m._save()
        return m

    @classmethod
    def precheck(cls, out: str | os.PathLike, *, options: dict, source: dict, resume: bool) -> None:
        """``begin``'s refusals that need no plan, so a run that would be refused is refused before
        the (long, for K3) planning: an earlier run without ``resume``, other settings with it."""
        path = manifest_path(out)
        if not path.is_file():
            return
        if not resume:
            raise OutputExistsError("exists: an earlier k3ckpt gguf run wrote here; pass --resume to continue "
                                    "it, or choose another OUT", file=str(path))
        cls.load(path)._check_same(_canonical(options), _canonical(source))

    def _check_same(self, options: dict, source: dict) -> None:
        old = self.data.get("options", {})
        diffs = [f"{OPTION_FLAGS.get(k, k)} was {_show(k, old.get(k))}, now {_show(k, options.get(k))}"
                 for k in sorted(set(old) | set(options)) if old.get(k) != options.get(k)]
        if diffs:
            more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
            raise ResumeMismatchError(f"cannot resume: {diffs[0]}{more}; pass the same options as the first run, "
                                      "or another OUT", file=str(self.path))
        was = self.data.get("source", {})
        if was != source:
            a, b = was.get("shards", {}), source.get("shards", {})
            changed = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
            if was.get("commit") != source.get("commit"):
                what = f"commit {was.get('commit')} then, {source.get('commit')} now"
            elif changed:
                what = f"shard {changed[0]} differs" + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
            else:
                what = "its config.json or tensor count differs"
            raise ResumeMismatchError(f"cannot resume: SRC is not the checkpoint the first run read ({what}); "
                                      "pass the same SRC, or another OUT", file=str(self.path))

    def done_splits(self) -> list[str]:
        """Splits recorded as final and still there with their recorded size (``GGUFWriter``
        then checks their header bytes against the plan; ``verify`` their hashes)."""
        out = []
        for name, rec in self.files.items():
            try:
                if (self.folder / name).stat().st_size == rec["size"]:
                    out.append(name)
            except FileNotFoundError:
                pass
        return out

    def record(self, name: str, sha256: str) -> None:
        self.files[name] = {"size": (self.folder / name).stat().st_size, "sha256": sha256}
        self._save()

    def finish(self, **summary: Any) -> None:
        self.data["state"] = "complete"
        self.data["summary"] = _canonical(summary)
        self._save()

    def _save(self) -> None:
        atomic_write_json(self.path, self.data, indent=1, sort_keys=True)
