"""``k3ckpt verify --source`` for a ``requant`` or ``dequant`` output: what the source implies.

The job's plan is rebuilt from the source's headers and the options in the output's manifest
(``plan_requant`` / ``plan_dequant``, the same planners the run used), so every output tensor
has an expected name, dtype and shape.  Tensors the run copied must equal the source byte for
byte; the re-encoded (requant) or decoded (dequant) ones are checked for presence, dtype and
shape (their values are the job's own: ``requant``'s report measures them).  Building the
check (``plan_source_check``) reads headers only; it is O(N) in the tensor count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..io.reader import Checkpoint
from ..formats import ids

__all__ = ["SourceCheckPlan", "expected_outputs", "plan_source_check"]

_IDENTITY_KEYS = ("shards", "tensors", "config_sha256")


@dataclass(frozen=True)
class SourceCheckPlan:
    """What ``verify --source`` checks in one output, from headers alone."""

    job: str
    expected: int                  # output tensors the source and the options imply
    compare: tuple[str, ...]       # copied tensors, present as planned: compared byte for byte
    compare_bytes: int
    transformed: int               # re-encoded / decoded tensors found with their planned dtype and shape
    problems: tuple[str, ...]      # missing, unexpected or mis-shaped tensors; another source


def expected_outputs(src: Checkpoint, job: str, options: dict, root: Path | None = None):
    """(planned output specs, names copied from the source) of ``job`` run on ``src`` with ``options``
    (a manifest's).  ``root``: the output folder, for a ``--target-bpw`` requant's saved allocation."""
    if job == "dequant":
        from ..dequant import plan_dequant

        plan = plan_dequant(src, dtype=options.get("dtype", ids.BF16), pattern=options.get("tensors"))
        return plan.specs, plan.copies
    from ..requant.plan import plan_requant

    experts = options.get("projections") or options.get("experts")
    kw = {"format": options["format"], "experts": experts, "layout": options.get("layout"),
          "tensor_type": [tuple(t) for t in options.get("tensor_type") or ()]}
    plan = plan_requant(src, **kw)
    if options.get("target_bpw") is not None:
        from ..requant._stream import RESULTS_DIR

        saved = json.loads((Path(root) / RESULTS_DIR / "allocation.json").read_bytes())
        keep = set(saved["keep"])
        names = {w.name for unit, ws in plan.units().items() if unit in keep for w in ws}
        plan = plan_requant(src, keep=names, **kw)
    return plan.specs, plan.copies


def plan_source_check(out: Checkpoint, src: Checkpoint, job: str, options: dict, *,
                      source_identity: dict | None = None, root: Path | None = None) -> SourceCheckPlan:
    """Match the output's headers against the plan of ``job`` on ``src``; reads no tensor data."""
    problems: list[str] = []
    if source_identity is not None:
        from ..checkpoint.identity import source_identity as identity_of

        have = identity_of(src)
        differs = [k for k in _IDENTITY_KEYS if source_identity.get(k) != have.get(k)]
        if differs:   # its plan would not be this output's: nothing more to compare
            return SourceCheckPlan(job, 0, (), 0, 0, (
                f"the source is not the one this output was made from ({', '.join(differs)} differ)",))
    specs, copies = expected_outputs(src, job, options, root)
    planned = {s.name: s for s in specs}
    copied = set(copies)
    compare, compare_bytes, transformed = [], 0, 0
    for name, e in out.tensors.items():
        s = planned.get(name)
        if s is None:
            problems.append(f"tensor {name!r} is not an output the source implies")
        elif (e.dtype, tuple(e.shape)) != (s.dtype, tuple(s.shape)):
            problems.append(f"{name}: {e.dtype} {list(e.shape)}, planned {s.dtype} {list(s.shape)}")
        elif name in copied:
            compare.append(name)
            compare_bytes += e.nbytes
        else:
            transformed += 1
    missing = [n for n in planned if n not in out.tensors]
    if missing:
        problems.append(f"{len(missing):,} planned tensor(s) missing, e.g. {missing[0]!r}")
    return SourceCheckPlan(job, len(planned), tuple(compare), compare_bytes, transformed, tuple(problems))
