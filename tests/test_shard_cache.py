"""Cache simulators: hand traces with known answers, kernels against references, bounds."""

from __future__ import annotations

import numpy as np
import pytest

from k3ckpt.errors import UsageError
from k3ckpt.placement.cache import ONLINE, POLICIES, RankCache, simulate, simulate_rank, split_layers

# Silberschatz et al., Operating System Concepts: reference string, 3 frames:
# FIFO 15 faults, LRU 12 faults, OPT (Belady) 9 faults.
CLASSIC = np.array([7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1])
NONE = np.zeros(0, dtype=np.int64)


@pytest.mark.parametrize("reference", [True, False])
def test_classic_sequence(reference):
    def faults(policy):
        return int((~simulate(policy, CLASSIC, 3, NONE, 8, reference=reference)).sum())

    assert faults("belady") == 9
    assert faults("lru") == 12
    # bypass never hurts: at least as many hits as MIN
    assert faults("belady-bypass") <= 9


def test_lfu_by_hand():
    # capacity 2: a a b c -> c evicts b (count 1, older than... b is newer than a but a has count 2)
    keys = np.array([0, 0, 1, 2, 1, 0])
    hits = simulate("lfu", keys, 2, NONE, 3)
    # 0 miss, 0 hit, 1 miss, 2 miss evicts 1 (count 1 < 2), 1 miss evicts 2 (count 1, older), 0 hit
    assert hits.tolist() == [False, True, False, False, False, True]


def test_lru_by_hand():
    keys = np.array([0, 1, 0, 2, 1])
    assert simulate("lru", keys, 2, NONE, 3).tolist() == [False, False, True, False, False]


def test_static_and_warm_start():
    order = np.array([3, 1, 0])  # increasing heat: 0 hottest, then 1
    keys = np.array([0, 1, 2, 3, 0])
    assert simulate("static", keys, 2, order, 4).tolist() == [True, True, False, False, True]
    # warm LRU holds {1, 0}; after the hits 0 then 1, key 2 evicts 0 and key 3 evicts 1
    assert simulate("lru", keys, 2, order, 4).tolist() == [True, True, False, False, False]


def test_hot_recent_by_hand():
    keys = np.array([0, 3, 1, 3, 2])
    # window 1: at t=2 (key 1) residents {0 (t0), 3 (t1)}; 3 is recent, 0 is old -> 0 leaves
    hits = simulate("hot-recent", keys, 2, NONE, 4, window=1)
    assert hits.tolist() == [False, False, False, True, False]
    ref = simulate("hot-recent", keys, 2, NONE, 4, window=1, reference=True)
    assert np.array_equal(hits, ref)


def test_recent_freq_by_hand():
    # window 1, horizon 3, no prior; capacity 2
    keys = np.array([0, 1, 0, 2, 1, 3])
    # t0 0 miss; t1 1 miss; t2 0 hit (old: a new run, score 0 = 2 units); t3 2 evicts 1
    # (old residents {0: 2 units, 1: 1 unit}); t4 1 miss: 0 (t2) is old, 2 recent: 0 leaves;
    # t5 3: 2 and 1 old; counts in (1, 4]: 2 -> 1 unit, 1 -> 1 unit (t4); tie: lower key 1 leaves
    for reference in (False, True):
        hits = simulate("recent-freq", keys, 2, NONE, 4, window=1, horizon=3, reference=reference)
        assert hits.tolist() == [False, False, True, False, False, False]
        h2 = simulate("recent-freq", keys, 2, NONE, 4, window=1, horizon=3, rates=np.array([0, 0, 0, 0.0]),
                      reference=reference)
        assert np.array_equal(hits, h2)
    # window 0: every read starts a run.  keys 0 1 0 2 1: at t3 both residents are old,
    # 0 has two runs, 1 one: 1 leaves; a prior on key 1 makes 0 leave and t4 hit
    keys = np.array([0, 1, 0, 2, 1])
    for rates, want in ((None, [False, False, True, False, False]), ([0, 1.0, 0, 0], [False, False, True, False, True])):
        for reference in (False, True):
            hits = simulate("recent-freq", keys, 2, NONE, 4, window=0, horizon=10, rates=rates, reference=reference)
            assert hits.tolist() == want
    with pytest.raises(UsageError):
        simulate("recent-freq", keys, 2, NONE, 4, rates=np.array([0, -1.0, 0, 0]))


def test_kernels_match_references_and_bounds_hold():
    rng = np.random.default_rng(0)
    for trial in range(120):
        nk = int(rng.integers(1, 25))
        n = int(rng.integers(0, 150))
        cap = int(rng.integers(0, 10))
        keys = rng.choice(nk, size=n, p=rng.dirichlet(np.full(nk, 0.5)))
        order = rng.permutation(nk)[: int(rng.integers(0, nk + 1))]
        window = int(rng.integers(0, 8))
        opts = dict(window=window, horizon=int(rng.integers(0, 40)),
                    rates=rng.random(nk) * (rng.random() < 0.7) / 40)
        hits = {}
        for policy in POLICIES:
            a = simulate(policy, keys, cap, order, nk, **opts)
            b = simulate(policy, keys, cap, order, nk, **opts, reference=True)
            assert np.array_equal(a, b), (policy, trial)
            hits[policy] = int(a.sum())
        for policy in ("lru", "lfu", "hot-recent", "recent-freq"):
            assert hits[policy] <= hits["belady"], (policy, trial)
        for policy in POLICIES:
            assert hits[policy] <= hits["belady-bypass"], (policy, trial)


def test_simulate_rank_tiers_sum_to_one():
    rng = np.random.default_rng(1)
    L, E, k = 4, 12, 3
    trace = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(60)])
    loads = rng.lognormal(0, 1, (L, E))
    rc = RankCache(rank=0, node=0, layer_start=1, layer_stop=3, hbm_slots=6, host_slots=8)
    out = simulate_rank(trace, loads, rc)
    assert set(out) == set(POLICIES)
    for s in out.values():
        assert 0 <= s.hbm_hit <= 1 and 0 <= s.host_hit <= 1
        assert s.hbm_hit + s.host_hit + s.nvme_rate == pytest.approx(1.0)
        assert s.accesses == 60 * 2 * k
    assert all(out[p].hbm_hit <= out["belady-bypass"].hbm_hit + 1e-12 for p in ONLINE)


def test_split_layers_and_errors():
    assert split_layers(92, 2).tolist() == [0, 46, 92]
    assert split_layers(10, 4).tolist() == [0, 3, 6, 8, 10]
    with pytest.raises(UsageError):
        simulate("fifo", CLASSIC, 3, NONE, 8)
    with pytest.raises(UsageError):
        simulate("lru", CLASSIC, 3, NONE, 5)  # key 7 outside [0, 5)
