"""The placement planner: correctness of the arrays, bounds, the FlashLB toy, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from k3ckpt.errors import UsageError
from k3ckpt.placement.eplb import rebalance_experts
from k3ckpt.placement.packing import PackState, items_of, pack_rounds, swap_search
from k3ckpt.placement.assign import (
    Placement,
    balancedness,
    even_slots,
    family_counts,
    gpu_loads,
    lower_bound,
    minmax_counts,
    plan_placement,
    slots_to_slot2gpu,
)

TOY = np.array([[600, 560, 120, 120, 20, 10, 10, 10]], dtype=float)


def check_arrays(pl: Placement, spg: np.ndarray):
    L, S = pl.phy2log.shape
    assert S == spg.sum()
    assert np.array_equal(pl.slots_per_gpu(), spg)
    assert (np.diff(pl.slot2gpu) >= 0).all()
    assert (pl.logcnt.sum(axis=1) == S).all() and (pl.logcnt >= 1).all()
    for l in range(L):
        for e in range(pl.experts):
            slots = pl.log2phy[l, e]
            slots = slots[slots >= 0]
            assert len(slots) == pl.logcnt[l, e]
            assert (pl.phy2log[l, slots] == e).all()
            assert len(set(pl.slot2gpu[slots].tolist())) == len(slots)  # never two on one GPU
    assert pl.colocated_replicas() == 0


def test_flashlb_toy_beats_eplb():
    pl = plan_placement(TOY, even_slots(8, 16))
    top = gpu_loads(pl, TOY).max()
    phy2log, _, logcnt = rebalance_experts(TOY, 16, 1, 1, 8)
    eplb = (np.take_along_axis(TOY / logcnt, phy2log, axis=1)).reshape(8, 2).sum(axis=1).max()
    assert eplb == 232
    assert top <= eplb
    assert top == pytest.approx(590 / 3)  # PLACEMENT.md: 196.7 reachable (counts 5,3,2,2,1,1,1,1)
    assert top >= lower_bound(TOY, 8, 16)[0] - 1e-9
    check_arrays(pl, even_slots(8, 16))


@pytest.mark.parametrize("G,S", [(4, 14), (5, 12), (3, 30), (7, 7 * 3)])
def test_arrays_consistent_uneven_slots(G, S):
    w = np.random.default_rng(G * S).lognormal(0, 1.2, (3, 10))
    w[1, 3] = 0.0
    spg = even_slots(G, S)
    pl = plan_placement(w, spg)
    check_arrays(pl, spg)
    gl = gpu_loads(pl, w)
    assert np.allclose(gl.sum(axis=1), w.sum(axis=1))
    assert (gl.max(axis=1) >= lower_bound(w, G, S) - 1e-9).all()


def test_close_to_lower_bound_with_room():
    w = np.random.default_rng(0).lognormal(0, 1, (6, 64))
    G, S = 8, 80
    pl = plan_placement(w, even_slots(G, S))
    gap = gpu_loads(pl, w).max(axis=1).sum() / lower_bound(w, G, S).sum() - 1
    phy2log, _, logcnt = rebalance_experts(w, S, 1, 1, G)
    eplb = np.take_along_axis(w / logcnt, phy2log, axis=1).reshape(6, G, -1).sum(axis=2).max(axis=1).sum()
    assert gap < 0.01
    assert gpu_loads(pl, w).max(axis=1).sum() <= eplb + 1e-9


def test_deterministic():
    w = np.random.default_rng(9).lognormal(0, 1, (4, 40))
    a = plan_placement(w, even_slots(6, 50))
    b = plan_placement(w.copy(), even_slots(6, 50))
    assert np.array_equal(a.phy2log, b.phy2log)


def test_counts():
    w = np.array([[10.0, 1.0, 0.0, 5.0]])
    for beta in (1.0, 0.5, 0.0):
        c = family_counts(w, 9, 4, beta)
        assert c.sum() == 9 and c.min() >= 1 and c.max() <= 4
    assert minmax_counts(w, 7, 4).tolist() == [[3, 1, 1, 2]]  # max w/c = 10/3
    with pytest.raises(UsageError):
        minmax_counts(w, 3, 4)
    with pytest.raises(UsageError):
        minmax_counts(w, 17, 4)


def test_swap_search_never_raises_the_maximum():
    rng = np.random.default_rng(2)
    w = rng.lognormal(0, 1, (5, 30))
    cap = even_slots(6, 36)
    counts = minmax_counts(w, 36, 6)
    i2e, size = items_of(w, counts)
    state = PackState(i2e, size, pack_rounds(i2e, size, cap), cap)
    before = state.max_load().copy()
    swap_search(state, 50)
    assert (state.max_load() <= before + 1e-9).all()
    assert np.allclose(state.gl.sum(axis=1), w.sum(axis=1))


def test_metrics_by_hand():
    # 2 GPUs x 2 slots; expert 0 twice (load 8 -> 4 + 4), experts 1, 2 once
    pl = Placement(np.array([[0, 1, 0, 2]]), slots_to_slot2gpu(np.array([2, 2])), 2, 3)
    w = np.array([[8.0, 3.0, 1.0]])
    assert gpu_loads(pl, w).tolist() == [[7.0, 5.0]]
    assert balancedness(np.array([[7.0, 5.0]])) == pytest.approx(6 / 7)
    assert pl.logcnt.tolist() == [[2, 1, 1]]
    assert pl.log2phy.tolist() == [[[0, 2], [1, -1], [3, -1]]]


def test_placement_validation():
    s2g = slots_to_slot2gpu(np.array([2, 2]))
    with pytest.raises(UsageError):
        Placement(np.array([[0, 1, 0, 1]]), s2g, 2, 3)  # expert 2 has no slot
    with pytest.raises(UsageError):
        Placement(np.array([[0, 1, 2, 1]]), np.array([0, 0, 1, 2]), 2, 3)  # rank 2 of 2
    with pytest.raises(UsageError):
        Placement(np.array([[0, 1, 2, 1]]), np.array([1, 1, 0, 0]), 2, 3)  # not contiguous
    with pytest.raises(UsageError):
        Placement(np.array([[0, 1, 5, 1]]), s2g, 2, 3)
    with pytest.raises(UsageError):
        plan_placement(np.array([[1.0, -1.0]]), even_slots(2, 2))
    with pytest.raises(UsageError):
        plan_placement(np.ones((1, 4)), np.array([5, 0]))  # a GPU cannot hold 5 of 4 experts


# ---------------------------------------------------------------------------
# robust polish (planning trace -> shared load factors)


def robust_objective(pl: Placement, w, factors, kappa, drift, q):
    """``[L]`` max over GPUs of load + kappa * sd, computed from the plan arrays alone."""
    c = np.take_along_axis(pl.logcnt, pl.phy2log, axis=1)
    x = np.take_along_axis(w, pl.phy2log, axis=1) / c
    var = (drift * x) ** 2 + q * x / c
    y = np.take_along_axis(factors, pl.phy2log[:, :, None], axis=1) / c[:, :, None]
    G = pl.num_gpus
    onehot = (pl.slot2gpu[:, None] == np.arange(G)[None, :]).astype(float)  # [S, G]
    gl = x @ onehot
    gv = var @ onehot + (np.einsum("lsr,sg->lgr", y, onehot) ** 2).sum(axis=2)
    return (gl + kappa * np.sqrt(gv)).max(axis=1)


def test_robust_state_without_noise_is_the_plain_search():
    from k3ckpt.placement.packing import set_noise

    rng = np.random.default_rng(5)
    w = rng.lognormal(0, 1, (4, 30))
    cap = even_slots(6, 36)
    counts = minmax_counts(w, 36, 6)
    i2e, size = items_of(w, counts)
    first = pack_rounds(i2e, size, cap)
    a = PackState(i2e, size, first.copy(), cap)
    b = PackState(i2e, size, first.copy(), cap)
    set_noise(b, counts, (0.0, 0.0), 2.0, None)
    swap_search(a, 40)
    swap_search(b, 40)
    assert np.array_equal(a.item_gpu, b.item_gpu)


def test_robust_polish_lowers_the_objective_and_keeps_the_cap():
    rng = np.random.default_rng(11)
    L, E, G, S, R = 3, 48, 8, 56, 3
    w = rng.lognormal(0, 1, (L, E)) * 1000
    factors = rng.normal(0, 1, (L, E, R)) * w[:, :, None] * 0.05
    plain = plan_placement(w, even_slots(G, S))
    share = 0.05
    pol = plan_placement(w, even_slots(G, S), factors=factors, step_share=share, robust_slack=2e-3)
    check_arrays(pol, even_slots(G, S))
    assert np.array_equal(pol.logcnt, plain.logcnt)  # the polish only moves replicas between GPUs
    r_plain = robust_objective(plain, w, factors, 2.0, 0.1, 1 / share)
    r_pol = robust_objective(pol, w, factors, 2.0, 0.1, 1 / share)
    assert (r_pol <= r_plain * (1 + 1e-9)).all() and (r_pol < r_plain * (1 - 1e-3)).any()
    top_plain = gpu_loads(plain, w).max(axis=1)
    lb = lower_bound(w, G, S)
    assert (gpu_loads(pol, w).max(axis=1) <= np.maximum(top_plain, lb * 1.002) * (1 + 1e-12)).all()
    with pytest.raises(UsageError, match="factors"):
        plan_placement(w, even_slots(G, S), factors=factors[:, :10])


def test_load_factors_find_planted_co_activation():
    from k3ckpt.placement.topology import load_factors

    # 2 layers, 8 experts, top-2; blocks of 4 tokens alternate between experts {0, 1}
    # and {2, 3} (layer 0); layer 1 always routes to {4, 5}: no variation
    T, B = 64, 4
    tr = np.zeros((T, 2, 2), dtype=np.int64)
    odd = (np.arange(T) // B) % 2 == 1
    tr[:, 0, :] = np.where(odd[:, None], [2, 3], [0, 1])
    tr[:, 1, :] = [4, 5]
    loads = np.zeros((2, 8))
    loads[0, :4] = T / 2
    loads[1, 4:6] = T
    F = load_factors(tr, loads, step_tokens=16, block_tokens=B, rank=2)
    assert F.shape == (2, 8, 2)
    v = F[0, :, 0]
    # one factor: experts 0, 1 against 2, 3, the rest untouched
    assert v[0] == pytest.approx(v[1]) and v[2] == pytest.approx(v[3]) and v[0] == pytest.approx(-v[2])
    assert np.allclose(v[4:], 0) and np.allclose(F[0, :, 1], 0, atol=1e-6) and np.allclose(F[1], 0, atol=1e-6)
    # a block's count of expert 0 is 4 or 0 (sd 2, sample sd 2 * sqrt(16/15)); a step
    # of 16 tokens = 4 blocks: sd x sqrt(4); planning units: x (64 planning tokens / 16)
    sd_step = 2 * np.sqrt(16 / 15) * 2
    assert abs(v[0]) == pytest.approx(sd_step * 64 / 16)
    with pytest.raises(UsageError, match="2 blocks"):
        load_factors(tr[:4], loads, step_tokens=16, block_tokens=B)
