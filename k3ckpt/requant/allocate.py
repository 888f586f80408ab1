"""``--target-bpw``: which weights take which type so the average meets a bit budget.

Every candidate weight has options (a type, its bytes, its measured squared
error against the source; the source's own lossless type at error 0).  Each
starts at its cheapest option; an upgrade from one option to a larger one
costs the extra bytes and removes the error difference.  Upgrades are taken in
order of error removed per extra byte (largest first; ties by name) while the
budget ``target_bpw x params / 8`` allows; an upgrade that does not fit is
skipped (the weight stays where it is) and smaller ones are still tried.  A
weight's upgrades follow the lower convex hull of its (bytes, error) points, so
its steps come in decreasing order of error per byte and the greedy fill is
the classic one of the multiple-choice knapsack: with many small weights (K3:
161,280 expert projections, or 180 stacked GGUF expert tensors) it meets the
target within one weight's step.

``allocate`` is the two-option case ``requant --target-bpw`` uses: the 2.25-bpw
format, or the MXFP4 source kept as it is.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable

from ..errors import UsageError


@dataclass(frozen=True)
class Option:
    label: str          # the type (a format id or a ggml type name)
    bytes: int
    sse: float          # squared error against the source (0 for a lossless copy)


@dataclass(frozen=True)
class Item:
    name: str
    params: int
    options: tuple[Option, ...]


@dataclass(frozen=True)
class Candidate:
    name: str
    params: int
    in_bytes: int       # MXFP4 bytes (kept)
    out_bytes: int      # 2.25-format bytes (requantized)
    sse: float          # squared error of the 2.25 format against the MXFP4 values


@dataclass(frozen=True)
class Allocation:
    keep: frozenset[str]        # names left in MXFP4 (with ``types``: at their largest option)
    target_bpw: float
    bpw: float                  # achieved average bits per weight over all candidates
    sse: float                  # total squared error left
    types: tuple[tuple[str, str], ...] = ()    # (name, chosen label) per item, by name (multi-option runs)
    weighted: bool = False      # errors weighted by an importance matrix

    def by_type(self) -> dict[str, int]:
        """How many items took each label."""
        out: dict[str, int] = {}
        for _, label in self.types:
            out[label] = out.get(label, 0) + 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict:
        out = {"keep": sorted(self.keep), "target_bpw": self.target_bpw, "bpw": self.bpw, "sse": self.sse}
        if self.types:
            out["types"] = dict(self.types)
            out["by_type"] = self.by_type()
            out["weighted"] = self.weighted
        return out


def _hull(options: Iterable[Option]) -> list[Option]:
    """The cheapest option, then the upgrades worth taking: each next point is the one removing
    the most error per extra byte (the farthest of equals), never adding error."""
    opts = sorted(options, key=lambda o: (o.bytes, o.sse, o.label))
    hull = [opts[0]]
    while True:
        cur = hull[-1]
        best, best_slope = None, -1.0
        for o in opts:
            if o.bytes > cur.bytes and o.sse <= cur.sse:
                slope = (cur.sse - o.sse) / (o.bytes - cur.bytes)
                if slope >= best_slope:
                    best, best_slope = o, slope
        if best is None:
            return hull
        hull.append(best)


def allocate_choices(items: Iterable[Item], target_bpw: float, *, what: str = "the cheapest types"
                     ) -> tuple[dict[str, Option], float, float]:
    """Each item's option so that the average bits per weight is at most ``target_bpw`` (and as
    close to it as the steps allow), removing the most error per byte; returns (name -> option,
    achieved bpw, total error).  ``UsageError`` when even the cheapest options exceed it
    (``what`` names them in the message)."""
    items = sorted(items, key=lambda i: i.name)
    params = sum(i.params for i in items)
    hulls = {i.name: _hull(i.options) for i in items}
    at = {name: 0 for name in hulls}
    if not params:
        return {n: h[0] for n, h in hulls.items()}, 0.0, 0.0
    low = sum(h[0].bytes for h in hulls.values())
    if not (8 * low / params - 1e-9 <= target_bpw):
        raise UsageError(f"--target-bpw {target_bpw} is below what {what} needs ({8 * low / params:.4f})")
    budget = int(target_bpw * params / 8 + 1e-9) - low

    def step(name: str):
        h, k = hulls[name], at[name]
        if k + 1 >= len(h):
            return None
        extra = h[k + 1].bytes - h[k].bytes
        return (-((h[k].sse - h[k + 1].sse) / extra), name, extra)

    heap = [s for s in map(step, sorted(hulls)) if s is not None]
    heapq.heapify(heap)
    while heap:
        _, name, extra = heapq.heappop(heap)
        if extra > budget:
            continue                      # too big for what is left: the item stays where it is
        budget -= extra
        at[name] += 1
        nxt = step(name)
        if nxt is not None:
            heapq.heappush(heap, nxt)
    chosen = {n: hulls[n][k] for n, k in at.items()}
    used = sum(o.bytes for o in chosen.values())
    return chosen, 8 * used / params, sum(o.sse for o in chosen.values())


def allocate(candidates: Iterable[Candidate], target_bpw: float) -> Allocation:
    """Names to keep in MXFP4 so that the average bits per weight is at most ``target_bpw``
    (and as close to it as the weights' sizes allow), removing the most error per byte."""
    cands = list(candidates)
    items = [Item(c.name, c.params, (Option("out", c.out_bytes, c.sse),)
                  + ((Option("keep", c.in_bytes, 0.0),) if c.in_bytes > c.out_bytes else ())) for c in cands]
    chosen, bpw, sse = allocate_choices(items, target_bpw, what="the 2.25 format")
    kept = frozenset(n for n, o in chosen.items() if o.label == "keep")
    hi_bpw = 8 * sum(c.in_bytes for c in cands) / max(1, sum(c.params for c in cands))
    assert bpw <= max(target_bpw, hi_bpw) + 1e-9
    return Allocation(kept, float(target_bpw), bpw, sse)
