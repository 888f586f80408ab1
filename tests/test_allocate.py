"""requant.allocate: the multiple-choice greedy behind --target-bpw (hull, order, budget, limits)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from k3ckpt.errors import UsageError
from k3ckpt.requant.allocate import Candidate, Item, Option, _hull, allocate, allocate_choices


def test_hull_keeps_the_convex_upgrades_only():
    opts = (Option("a", 100, 50.0), Option("b", 150, 45.0), Option("c", 200, 10.0),
            Option("d", 250, 12.0), Option("e", 400, 0.0))
    # b removes 0.1 per byte, c 0.4 from a: b is under the hull; d adds error; then e from c: 0.05
    assert [o.label for o in _hull(opts)] == ["a", "c", "e"]
    assert [o.label for o in _hull(reversed(opts))] == ["a", "c", "e"]
    assert [o.label for o in _hull([Option("x", 10, 1.0)])] == ["x"]


def _items(rng, n):
    out = []
    for i in range(n):
        params = int(rng.integers(50, 200))
        sizes = sorted(rng.choice(np.arange(1, 9), 4, replace=False) * params // 4)
        errs = sorted(rng.uniform(0, 100, 4), reverse=True)
        out.append(Item(f"w{i:02d}", params, tuple(Option(f"t{k}", int(b), float(e))
                                                    for k, (b, e) in enumerate(zip(sizes, errs)))))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_greedy_is_within_budget_maximal_and_close_to_the_optimum(seed):
    rng = np.random.default_rng(seed)
    items = _items(rng, 5)
    params = sum(i.params for i in items)
    low = sum(min(o.bytes for o in i.options) for i in items)
    high = sum(max(o.bytes for o in i.options) for i in items)
    target = 8 * (low + (high - low) * rng.uniform(0.2, 0.8)) / params
    chosen, bpw, sse = allocate_choices(items, target)
    budget = int(target * params / 8 + 1e-9)
    used = sum(o.bytes for o in chosen.values())
    assert bpw == 8 * used / params <= target + 1e-12 and used <= budget
    assert sse == pytest.approx(sum(o.sse for o in chosen.values()))
    # maximal: no item's next hull step fits in what is left
    for it in items:
        h = _hull(it.options)
        k = h.index(chosen[it.name])
        assert k + 1 == len(h) or h[k + 1].bytes - h[k].bytes > budget - used
    # against every assignment (4^5): no better solution fits a budget one largest step smaller
    best_tight = min((sum(o.sse for o in combo) for combo in itertools.product(*(i.options for i in items))
                      if sum(o.bytes for o in combo) <= budget - max(
                          max(o.bytes for o in i.options) - min(o.bytes for o in i.options) for i in items)),
                     default=np.inf)
    assert sse <= best_tight + 1e-9


def test_below_the_cheapest_options_is_one_usage_error():
    items = [Item("a", 100, (Option("x", 50, 1.0), Option("y", 80, 0.0)))]
    with pytest.raises(UsageError, match=r"--target-bpw 3.0 is below what the cheapest types needs? \(4.0000\)"):
        allocate_choices(items, 3.0)
    chosen, bpw, _ = allocate_choices(items, 4.0)
    assert chosen["a"].label == "x" and bpw == 4.0
    assert allocate_choices(items, 6.4)[0]["a"].label == "y"


def test_two_option_allocate_keeps_the_most_error_per_extra_byte():
    cands = [Candidate("a", 100, 53, 28, 10.0), Candidate("b", 100, 53, 28, 30.0),
             Candidate("c", 200, 106, 56, 40.0), Candidate("d", 100, 53, 28, 0.0)]
    # per extra byte: b 1.2, c 0.8, a 0.4, d 0; budget for 2.75 bpw of 500 weights: 171 bytes, 140 used at 2.25
    alloc = allocate(cands, 2.75)
    assert alloc.keep == frozenset({"b"}) and alloc.bpw == pytest.approx(8 * (28 + 53 + 56 + 28) / 500)
    assert allocate(cands, 4.2).keep == frozenset({"a", "b", "c"})       # 262 bytes: d's 25 more do not fit
    assert allocate(cands, 4.24).keep == frozenset({"a", "b", "c", "d"})  # 265: every one, d for no gain
