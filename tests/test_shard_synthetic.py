"""Synthetic loads and traces: deterministic, valid, shaped like K3's public skew."""

from __future__ import annotations

import numpy as np
import pytest

from k3ckpt.errors import UsageError
from k3ckpt.placement import synthetic as syn
from k3ckpt.placement.loads import check_trace, loads_from_trace
from k3ckpt.placement.spec import MoEGeometry


def test_deterministic_and_windows_differ():
    a = syn.make_popularity(6, 64, 4, 3)
    b = syn.make_popularity(6, 64, 4, 3)
    assert np.array_equal(a.base, b.base) and np.array_equal(a.topic, b.topic)
    w0 = syn.window_loads(a, 5000, 3, 0)
    assert np.array_equal(w0, syn.window_loads(b, 5000, 3, 0))
    w1 = syn.window_loads(a, 5000, 3, 1)
    assert not np.array_equal(w0, w1)
    assert syn.window_loads(a, 5000, 3, 1, steps=3).shape == (3, 6, 64)
    assert not np.array_equal(w0, syn.window_loads(syn.make_popularity(6, 64, 4, 4), 5000, 4, 0))


def test_inclusion_probabilities():
    p = syn.inclusion_probs(np.log(np.array([[50.0, 1, 1, 1, 1, 1]])), 2)
    assert p.sum() == pytest.approx(2.0) and p[0, 0] == pytest.approx(1.0)  # the hot one saturates


def test_trace_valid_and_consistent():
    geo = MoEGeometry(5, 48, 4, 1, 0, tuple(range(5)))
    pop = syn.make_popularity(5, 48, 4, 7)
    tr = syn.sample_trace(pop, 3000, 7, 1)
    assert np.array_equal(tr, syn.sample_trace(pop, 3000, 7, 1))
    check_trace(tr, geo)  # ids in range and distinct per token and layer
    counts = loads_from_trace(tr, 48)
    probs = syn.window_probs(pop, 7, 1) * 3000
    assert np.corrcoef(counts.ravel(), probs.ravel())[0, 1] > 0.9
    # persistence: consecutive tokens share experts far more often than chance
    same = np.mean([len(set(tr[t, 0]) & set(tr[t + 1, 0])) for t in range(2999)])
    fresh = syn.sample_trace(pop, 3000, 7, 1, syn.SkewModel(persistence=0.0))
    base = np.mean([len(set(fresh[t, 0]) & set(fresh[t + 1, 0])) for t in range(2999)])
    assert same > base + 1.0


def test_k3_skew_matches_public_figures():
    pop = syn.make_popularity(92, 896, 16, 1)
    st = syn.skew_stats(syn.window_loads(pop, 131_072, 1, 0))
    # K3_FACTS: top 10 % hold 22-45 % of a layer, top 25 % 43-66 %, max/mean ~33x, 15 never routed
    assert 0.20 <= st["top10_share_min"] and st["top10_share_max"] <= 0.47
    assert 0.40 <= st["top25_share_min"] and st["top25_share_max"] <= 0.70
    assert 25 <= st["max_over_mean_max"] <= 50
    assert 5 <= st["never_routed"] <= 40


def test_tiers_rank_experts():
    tiers = np.zeros((2, 32), dtype=int)
    tiers[:, :8] = 2
    tiers[:, 8:12] = 1
    pop = syn.make_popularity(2, 32, 2, 0, syn.SkewModel(head_experts=1, head_boost=(0, 0), dead_fraction=0), tiers)
    b = pop.base
    assert (b[:, :8].min(axis=1) > b[:, 8:12].max(axis=1)).all()
    assert (b[:, 8:12].min(axis=1) > b[:, 12:].max(axis=1)).all()


def test_bad_arguments():
    with pytest.raises(UsageError):
        syn.SkewModel(sigma_range=(1.0, 0.5))
    with pytest.raises(UsageError):
        syn.SkewModel(persistence=1.0)
    with pytest.raises(UsageError):
        syn.make_popularity(2, 4, 5, 0)
    with pytest.raises(UsageError):
        syn.window_loads(syn.make_popularity(2, 4, 2, 0), 0, 0)
