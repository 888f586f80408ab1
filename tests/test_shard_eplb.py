"""Our EPLB re-implementation against hand-worked cases and PLACEMENT.md's FlashLB toy."""

from __future__ import annotations

import numpy as np
import pytest

from k3ckpt.errors import UsageError
from k3ckpt.placement.eplb import balanced_packing, rebalance_experts, rebalance_hierarchical, replicate_experts

TOY = np.array([[600, 560, 120, 120, 20, 10, 10, 10]], dtype=float)


def gpu_max(weight, phy2log, logcnt, gpus):
    rep = np.take_along_axis(weight / logcnt, phy2log, axis=1)
    return rep.reshape(weight.shape[0], gpus, -1).sum(axis=2).max(axis=1)


def test_flashlb_toy_reproduces_232():
    phy2log, log2phy, logcnt = rebalance_experts(TOY, 16, 1, 1, 8)
    assert logcnt.tolist() == [[5, 5, 1, 1, 1, 1, 1, 1]]
    assert gpu_max(TOY, phy2log, logcnt, 8).tolist() == [232.0]


def test_balanced_packing_cardinality_lpt():
    pack, rank = balanced_packing(np.array([[4.0, 3.0, 2.0, 1.0]]), 2)
    # 4 -> p0, 3 -> p1, 2 -> p1 (3 < 4), 1 -> p0: both packs weigh 5, two items each
    assert pack.tolist() == [[0, 1, 1, 0]]
    assert sorted(rank[0][pack[0] == 0].tolist()) == [0, 1]
    with pytest.raises(UsageError):
        balanced_packing(np.ones((1, 5)), 2)


def test_replicate_experts_minmax():
    phy2log, rank, logcnt = replicate_experts(np.array([[10.0, 1.0]]), 4)
    assert logcnt.tolist() == [[3, 1]]
    assert phy2log.tolist() == [[0, 1, 0, 0]]
    assert rank.tolist() == [[0, 0, 1, 2]]


def test_log2phy_inverts_phy2log():
    rng = np.random.default_rng(3)
    w = rng.lognormal(0, 1, (5, 12))
    phy2log, log2phy, logcnt = rebalance_experts(w, 16, 1, 1, 4)
    for l in range(5):
        for e in range(12):
            slots = log2phy[l, e][log2phy[l, e] >= 0]
            assert len(slots) == logcnt[l, e]
            assert (phy2log[l, slots] == e).all()
    assert (logcnt.sum(axis=1) == 16).all()


def test_hierarchical_keeps_groups_on_nodes():
    rng = np.random.default_rng(5)
    w = rng.lognormal(0, 1, (3, 16))
    # 4 groups of 4 experts, 2 nodes of 2 GPUs, 24 slots (6 per GPU)
    phy2log, rank, logcnt = rebalance_hierarchical(w, 24, 4, 2, 4)
    node_of_slot = np.arange(24) // 12
    for l in range(3):
        for g in range(4):
            experts = np.arange(g * 4, g * 4 + 4)
            nodes = {int(node_of_slot[s]) for s in range(24) if phy2log[l, s] in experts}
            assert len(nodes) == 1  # a whole group lives on one node, replicas included
    assert (logcnt.sum(axis=1) == 24).all()


def test_global_policy_when_groups_do_not_divide_nodes():
    w = np.random.default_rng(1).lognormal(0, 1, (2, 9))
    a = rebalance_experts(w, 12, 3, 2, 4)  # 3 groups % 2 nodes != 0 -> global
    b = rebalance_experts(w, 12, 1, 1, 4)
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)


def test_eplb_rejects_uneven_slots():
    with pytest.raises(UsageError):
        rebalance_experts(np.ones((1, 8)), 10, 1, 1, 4)
