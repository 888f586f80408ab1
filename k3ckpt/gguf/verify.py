"""``k3ckpt verify OUT.gguf``: a GGUF output re-checked against its manifest.

Every planned split must be there with the size and sha256 the manifest
recorded when it became final; the ``gguf`` package's own ``GGUFReader`` (not
k3ckpt's writer or reader) must open each one and find exactly the planned
tensors in it, with their types and shapes, and the split keys llama.cpp
loads the set by.  With ``source``: the checkpoint must be the one the run
read (shard sizes, config, and for ``hf://`` the commit).  Problems are
collected, not raised (``shard.verify.VerifyReport``); a path that has no
k3ckpt GGUF manifest raises ``NotFoundError``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..io.manifest import sha256_file
from ..shard.verify import VerifyReport
from ..checkpoint.identity import source_identity
from .manifest import GGUFManifest, find_manifest


def _reader_problems(path: Path, want: list[list], no: int, count: int, total: int) -> tuple[list[str], int]:
    """What ``GGUFReader`` finds wrong in split ``no`` of ``count``; and the tensors it found."""
    import gguf

    name = path.name
    try:
        r = gguf.GGUFReader(path)
    except Exception as e:     # whatever the reader raises is the finding
        return [f"{name}: the gguf package's reader cannot open it: {type(e).__name__}: {e}"], 0
    out = []
    got = [[t.name, gguf.GGMLQuantizationType(int(t.tensor_type)).name, [int(d) for d in reversed(list(t.shape))]]
           for t in r.tensors]
    if got != want:
        names = {t[0] for t in got}
        lost = [t[0] for t in want if t[0] not in names]
        if lost:
            out.append(f"{name}: {len(lost)} planned tensor(s) not found, e.g. {lost[0]}")
        else:
            i = next(i for i in range(max(len(want), len(got))) if i >= min(len(want), len(got)) or want[i] != got[i])
            found, planned = (got[i] if i < len(got) else "nothing"), (want[i] if i < len(want) else "nothing")
            out.append(f"{name}: tensor {i} is {found}, the plan says {planned}")
    if count > 1:
        keys = tuple(r.fields[k].contents() if k in r.fields else None
                     for k in ("split.no", "split.count", "split.tensors.count"))
        if keys != (no, count, total):
            out.append(f"{name}: split keys (no, count, tensors) are {keys}, expected {(no, count, total)}")
    return out, len(got)


def verify_gguf(path: str | os.PathLike, *, source=None) -> VerifyReport:
    """Check the GGUF output ``path`` names (``OUT`` or any of its splits); see the module docstring.
    ``source``: the open ``Checkpoint`` the run read, to check it is still that one (``api.verify``
    opens a path or ``hf://`` URL)."""
    m = GGUFManifest.load(find_manifest(path))
    problems: list[str] = []
    files = nbytes = tensors = 0
    if m.state != "complete":
        problems.append(f"the run is not complete (state {m.state!r}): rerun k3ckpt gguf with --resume")
    splits = list(m.splits.items())
    total = sum(len(ts) for _, ts in splits)
    for no, (name, want) in enumerate(splits):
        p = m.folder / name
        rec = m.files.get(name)
        if not p.is_file():
            problems.append(f"{name}: missing")
            continue
        if rec is None:
            problems.append(f"{name}: not recorded as final in the manifest (an interrupted run: --resume)")
            continue
        size = p.stat().st_size
        if size != rec["size"]:
            problems.append(f"{name}: {size:,} bytes, the manifest says {rec['size']:,}")
            continue
        if sha256_file(p) != rec["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
        found, n = _reader_problems(p, want, no, len(splits), total)
        problems += found
        files += 1
        nbytes += size
        tensors += n
    checked = source is not None
    if checked:
        problems += _source_problems(m, source)
    return VerifyReport(str(path), files, nbytes, 0, tensors, checked, tuple(problems))


def _source_problems(m: GGUFManifest, source) -> list[str]:
    ident = source_identity(source)
    was = m.source
    if ident.get("commit") != was.get("commit") and (ident.get("commit") or was.get("commit")):
        return [f"the source is at commit {ident.get('commit')}, the run read {was.get('commit')}"]
    if ident.get("shards") != was.get("shards"):
        a, b = was.get("shards", {}), ident.get("shards", {})
        diff = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
        return [f"the source is not the checkpoint the run read: shard {diff[0]} differs"]
    if ident != was:
        return ["the source is not the checkpoint the run read: its config.json or tensor count differs"]
    return []
