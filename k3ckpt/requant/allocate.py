"""``--target-bpw``: which weights stay MXFP4 so the average meets a bit budget.

Every candidate weight is measured once in the 2.25-bpw format (its squared
error against the MXFP4 source, ``sse``, and its bytes); keeping it in MXFP4
costs ``in_bytes - out_bytes`` more bytes and removes that error (the MXFP4
source is the reference).  Starting from everything at 2.25 bpw, weights are
moved back to MXFP4 in order of error removed per extra byte (largest first;
ties by name) while the budget ``target_bpw x params / 8`` allows; a weight
that does not fit is skipped and smaller ones are still tried.  This greedy
fill is the classic fractional-knapsack order: with many small weights (K3:
161,280 expert projections) it meets the target within one weight's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..errors import UsageError


@dataclass(frozen=True)
class Candidate:
    name: str
    params: int
    in_bytes: int       # MXFP4 bytes (kept)
    out_bytes: int      # 2.25-format bytes (requantized)
    sse: float          # squared error of the 2.25 format against the MXFP4 values


@dataclass(frozen=True)
class Allocation:
    keep: frozenset[str]        # names left in MXFP4
    target_bpw: float
    bpw: float                  # achieved average bits per weight over all candidates
    sse: float                  # total squared error left

    def to_dict(self) -> dict:
        return {"keep": sorted(self.keep), "target_bpw": self.target_bpw, "bpw": self.bpw, "sse": self.sse}


def allocate(candidates: Iterable[Candidate], target_bpw: float) -> Allocation:
    """Names to keep in MXFP4 so that the average bits per weight is at most ``target_bpw``
    (and as close to it as the weights' sizes allow), removing the most error per byte."""
    cands = sorted(candidates, key=lambda c: c.name)
    params = sum(c.params for c in cands)
    low = sum(c.out_bytes for c in cands)
    high = sum(c.in_bytes for c in cands)
    if not params:
        return Allocation(frozenset(), float(target_bpw), 0.0, 0.0)
    lo_bpw, hi_bpw = 8 * low / params, 8 * high / params
    if not (lo_bpw - 1e-9 <= target_bpw):
        raise UsageError(f"--target-bpw {target_bpw} is below what the 2.25 format needs ({lo_bpw:.4f})")
    budget = int(target_bpw * params / 8 + 1e-9) - low
    order = sorted((c for c in cands if c.in_bytes > c.out_bytes),
                   key=lambda c: (-(c.sse / (c.in_bytes - c.out_bytes)), c.name))
    keep = []
    for c in order:
        extra = c.in_bytes - c.out_bytes
        if extra <= budget:
            keep.append(c.name)
            budget -= extra
    kept = frozenset(keep)
    used = sum(c.in_bytes if c.name in kept else c.out_bytes for c in cands)
    sse = sum(0.0 if c.name in kept else c.sse for c in cands)
    assert 8 * used / params <= max(target_bpw, hi_bpw) + 1e-9
    return Allocation(kept, float(target_bpw), 8 * used / params, sse)
