"""make_plan: mode choice, memory limits, JSON round trip and validation on load."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k3ckpt.errors import UsageError
from k3ckpt.placement.devices import parse_devices
from k3ckpt.placement.spec import MoEGeometry, Plan, placement_slot_limit
from k3ckpt.placement.planner import make_plan

GiB = 2**30
SMALL = MoEGeometry(4, 16, 4, 1 * GiB, 20 * 10**9, (1, 2, 3, 4), "toy", 1000)


def loads_for(geo, seed=0):
    return np.random.default_rng(seed).lognormal(0, 1, (geo.moe_layers, geo.experts))


def trace_for(geo, tokens, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([
        np.stack([rng.choice(geo.experts, geo.top_k, replace=False) for _ in range(geo.moe_layers)])
        for _ in range(tokens)
    ])


def test_geometries():
    k3, k2 = MoEGeometry.k3(), MoEGeometry.k2()
    assert (k3.moe_layers, k3.experts, k3.top_k, k3.expert_bytes) == (92, 896, 16, 17_547_264)
    assert k3.expert_bytes * k3.moe_layers * k3.experts == 1_446_456_066_048  # K3_FACTS: all routed experts
    assert k3.layer_ids == tuple(range(1, 93)) and k3.dense_bytes == 113_509_540_864
    # 16 copies x 92 layers x 10,864 B = 15.99 MB per token (PLACEMENT.md section 9)
    assert k3.a2a_bytes_per_copy * 16 * 92 == 15_991_808
    assert (k2.moe_layers, k2.experts, k2.top_k) == (60, 384, 8)
    assert MoEGeometry.k3(bytes_per_expert=9_289_728).expert_bytes == 9_289_728
    for bad in (dict(top_k=0), dict(layer_ids=(1, 1, 2, 3)), dict(experts=2, top_k=4), dict(dense_bytes=-1)):
        with pytest.raises(UsageError):
            MoEGeometry(**{**SMALL.__dict__, **bad})


def test_placement_mode_and_memory():
    ds = parse_devices("8xH100", reserved_kv="20GB")
    # (80 - 20 - 20) GB / (4 layers x 1 GiB) = 9 slots per GPU
    assert placement_slot_limit(SMALL, ds) == 9
    plan = make_plan(SMALL, ds, loads_for(SMALL))
    assert plan.mode == "placement"
    rep = plan.placement_report
    assert rep.total_slots == 16 + 2 and rep.max_gpu_memory_bytes <= ds.device.hbm_bytes
    assert rep.colocated_replicas == 0 and 0 < rep.balancedness <= 1 and rep.gap_to_lower_bound >= 0
    plan = make_plan(SMALL, ds, loads_for(SMALL), slots_per_gpu=9)
    assert plan.placement_report.total_slots == 72
    with pytest.raises(UsageError, match="room for 9 slots"):
        make_plan(SMALL, ds, loads_for(SMALL), slots_per_gpu=10)
    with pytest.raises(UsageError, match="not both"):
        make_plan(SMALL, ds, loads_for(SMALL), slots_per_gpu=2, redundant=4)
    with pytest.raises(UsageError):
        make_plan(SMALL, ds, loads_for(SMALL)[:3])


def test_planning_trace_polishes_placement():
    from k3ckpt.placement.assign import gpu_loads, lower_bound, plan_placement
    from k3ckpt.placement.planner import robust_options

    ds = parse_devices("8xH100", reserved_kv="20GB")
    w = loads_for(SMALL, 3) * 1000
    tr = trace_for(SMALL, 96, seed=4)
    assert robust_options(w, None, 4, 8) == {}
    assert robust_options(w, tr[:63], 4, 8) == {}  # fewer than two 32-token blocks
    opts = robust_options(w, tr, 4, 8, step_tokens=256)
    assert opts["factors"].shape == (4, 16, 8) and opts["step_share"] == pytest.approx(256 / (w.sum(1).mean() / 4))
    plan = make_plan(SMALL, ds, w, trace=tr, slots_per_gpu=3, step_tokens=256)
    direct = plan_placement(w, np.full(8, 3), **opts)
    assert np.array_equal(plan.placement.phy2log, direct.phy2log)
    # the polish keeps the planning maximum within 0.2 % of the bound (or the plain plan's)
    plain = make_plan(SMALL, ds, w, slots_per_gpu=3).placement
    top = gpu_loads(plan.placement, w).max(axis=1)
    assert (top <= np.maximum(gpu_loads(plain, w).max(axis=1), lower_bound(w, 8, 24) * 1.002) + 1e-9).all()
    with pytest.raises(UsageError, match="step_tokens"):
        make_plan(SMALL, ds, w, trace=tr, step_tokens=0)


def test_best_policy_is_the_fastest_not_the_most_hbm_hits():
    """Two layers of 16 real-size K3 experts on one RTX 5090 with 0.5 GB of HBM left:
    recent-freq has the most HBM hits, static moves the fewest bytes (it never admits
    a miss) and is the fastest; the plan recommends and stores the fastest."""
    geo = MoEGeometry(2, 16, 2, 17_547_264, 27_700_000, (1, 2), "k3-shapes")
    ds = parse_devices("1xRTX-5090", nvme="1x7", host_dram="1GB", reserved_kv="31.5GB")
    from k3ckpt import api

    plan = api.plan(geo, ds, mode="cache")   # synthetic K3-like loads and held-out trace
    rep = plan.cache_report
    online = [p for p in rep.policies if p.policy in ("lru", "lfu", "static", "hot-recent", "recent-freq")]
    most_hits = max(online, key=lambda p: p.hbm_hit)
    fastest = max(online, key=lambda p: p.tokens_per_s)
    assert most_hits.policy != fastest.policy   # the case this test is about
    assert rep.best_policy == fastest.policy == plan.cache.policy
    assert rep.tokens_per_s == pytest.approx(fastest.tokens_per_s) and rep.binding in ("nvme", "pcie")
    assert Plan.from_json(plan.to_json()).cache.policy == fastest.policy


def test_binding_ceiling_names_the_limit():
    from k3ckpt.placement.planner import best_policy, binding_ceiling
    from k3ckpt.placement.spec import CachePolicyReport

    a = CachePolicyReport("lru", 0.9, 0.0, 0.1, 1e9, 2e9, 5.24, 11.35, 5.24)
    b = CachePolicyReport("static", 0.5, 0.2, 0.3, 1e9, 2e9, 6.0, 8.0, 6.0)
    assert best_policy([a, b]) is b
    assert binding_ceiling(a) == (5.24, "nvme")
    assert binding_ceiling(b) == (6.0, "nvme") and binding_ceiling(b, 0.1) == (6.0, "nvme")
    tps, name = binding_ceiling(a, 2.22)   # the dense stream: one pass every 2.22 s
    assert name == "dense-stream" and tps == pytest.approx(1 / 2.22)
    free = CachePolicyReport("lru", 1.0, 0.0, 0.0, 0.0, 0.0, None, None, None)
    assert binding_ceiling(free) == (None, "") and best_policy([a, free]) is free


def test_cache_mode_when_experts_do_not_fit():
    ds = parse_devices("2xRTX-5090", nvme="2x14@4TB", host_dram="64GB")
    # 32 GB - 10 GB dense share: 20 experts of 1 GiB per GPU < 16 experts x 2 layers
    plan = make_plan(SMALL, ds, loads_for(SMALL), heldout_trace=trace_for(SMALL, 40))
    assert plan.mode == "cache"
    rep = plan.cache_report
    assert rep.simulated and rep.best_policy in ("lru", "lfu", "static", "hot-recent", "recent-freq")
    names = [p.policy for p in rep.policies]
    assert names == ["lru", "lfu", "static", "hot-recent", "recent-freq", "belady", "belady-bypass"]
    bel = rep.policy("belady-bypass").hbm_hit
    assert all(p.hbm_hit <= bel + 1e-12 for p in rep.policies)
    for p in rep.policies:
        assert p.nvme_bytes_per_token == pytest.approx(p.nvme_rate * 16 * SMALL.expert_bytes)
    assert plan.cache.hbm_slots.tolist() == [20, 20]
    assert plan.cache.layer_bounds.tolist() == [0, 2, 4]
    # without a trace: the static estimate only
    plan = make_plan(SMALL, ds, loads_for(SMALL))
    assert [p.policy for p in plan.cache_report.policies] == ["static"]
    with pytest.raises(UsageError, match="no NVMe"):
        make_plan(SMALL, parse_devices("2xRTX-5090"), loads_for(SMALL))
    with pytest.raises(UsageError, match="do not fit"):
        make_plan(SMALL, ds, loads_for(SMALL), mode="placement")


@pytest.mark.parametrize("spec,kw", [("8xH100", {}), ("2xRTX-5090", dict(nvme="1x7", host_dram="32GB"))])
def test_json_round_trip_and_determinism(spec, kw):
    ds = parse_devices(spec, **kw)
    tr = trace_for(SMALL, 20)
    a = make_plan(SMALL, ds, loads_for(SMALL), heldout_trace=tr)
    b = make_plan(SMALL, ds, loads_for(SMALL), heldout_trace=tr)
    text = a.to_json()
    assert text == b.to_json()
    assert Plan.from_json(text).to_json() == text


def test_from_json_validates():
    ds = parse_devices("8xH100")
    d = json.loads(make_plan(SMALL, ds, loads_for(SMALL)).to_json())

    def bad(mutate, match):
        x = json.loads(json.dumps(d))
        mutate(x)
        with pytest.raises(UsageError, match=match):
            Plan.from_json(json.dumps(x))

    bad(lambda x: x["placement"]["slot2gpu"].__setitem__(-1, 8), "rank 8")
    bad(lambda x: x["placement"].__setitem__("phy2log", x["placement"]["phy2log"][:3]), "layers")
    bad(lambda x: x["placement"]["log2phy"][0][0].__setitem__(0, 99), "inverse")
    bad(lambda x: x.__setitem__("version", 2), "version")
    bad(lambda x: x.__setitem__("extra", 1), "unknown keys")
    bad(lambda x: x["devices"].__setitem__("nodes", 2), "ranks")
    bad(lambda x: x.pop("kind"), "not a k3ckpt plan")
    with pytest.raises(UsageError, match="not valid JSON"):
        Plan.from_json("{")
