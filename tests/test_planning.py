"""``k3ckpt.placement.inputs.plan`` and the geometry read from checkpoint headers
(``k3ckpt.placement.from_checkpoint``)."""

from __future__ import annotations

import dataclasses
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from k3ckpt import api
from k3ckpt.placement import inputs as planning
from k3ckpt.api import open_source
from k3ckpt.io.origin import Origin
from k3ckpt.errors import InvalidFileError, NotFoundError, UnsupportedError, UsageError
from k3ckpt.placement import from_checkpoint as gfc
from k3ckpt.placement.devices import parse_devices
from k3ckpt.placement.spec import MoEGeometry, Plan

GiB = 2**30
SMALL = MoEGeometry(4, 16, 4, 1 * GiB, 20 * 10**9, (1, 2, 3, 4), "toy", 1000)
EXPERT = re.compile(r"\.layers\.(\d+)\..*\.experts\.(\d+)\.")


def header_sums(ckpt):
    """Independent of the profiles: bytes per (layer, expert) by name, and vision bytes."""
    per, vision, total = {}, 0, 0
    for name, e in ckpt.tensors.items():
        total += e.nbytes
        m = EXPERT.search(name)
        if m:
            key = (int(m.group(1)), int(m.group(2)))
            per[key] = per.get(key, 0) + e.nbytes
        elif name.startswith(("vision_tower.", "mm_projector.")):
            vision += e.nbytes
    return per, vision, total


# ------------------------------------------------------------------ geometry
def test_geometry_of_tiny_k3(k3_tiny):
    with open_source(k3_tiny) as ck:
        rep = gfc.moe_geometry_report(ck)
        per, vision, total = header_sums(ck)
        cfg = ck.config["text_config"]
    g = rep.geometry
    assert g.moe_layers == 3 and g.layer_ids == (1, 2, 3)  # layer 0 is dense (first_k_dense_replace 1)
    assert g.experts == cfg["num_experts"] == 8 and g.top_k == cfg["num_experts_per_token"] == 2
    assert len(per) == 3 * 8 and len(set(per.values())) == 1
    assert g.expert_bytes == next(iter(per.values())) and rep.bytes_from == "headers"
    assert vision > 0 and rep.vision_bytes == vision
    assert g.dense_bytes == total - sum(per.values()) - vision
    h = cfg["routed_expert_hidden_size"]
    assert g.a2a_bytes_per_copy == h * 33 // 32 + 2 * h
    assert rep.expert_weights == (("w1.weight", (256, 256)), ("w2.weight", (256, 256)), ("w3.weight", (256, 256)))
    with open_source(k3_tiny) as ck:
        with_vision = gfc.moe_geometry(ck, include_vision=True, model_id="tiny")
    assert with_vision.dense_bytes == g.dense_bytes + vision and with_vision.model_id == "tiny"


def test_geometry_in_other_formats(k3_tiny):
    weights = 3 * 256 * 256
    with open_source(k3_tiny) as ck:
        w2 = gfc.moe_geometry_report(ck, format_id="moet-w2")
        mx2 = gfc.moe_geometry_report(ck, format_id="k3ckpt-mx2")
        bf16 = gfc.moe_geometry(ck, format_id="bf16")
        with pytest.raises(UsageError, match=r"unknown --format 'mxfp3'.*moet-w2"):
            gfc.moe_geometry(ck, format_id="mxfp3")
        # 2.25 bpw: one scale byte + eight code bytes per 32 weights
        assert w2.geometry.expert_bytes == weights // 32 * 9 and w2.bytes_from == "registry"
        # MX2 also stores per-tensor levels (4 x 2 B) and an exponent base (1 B) for each weight
        assert mx2.geometry.expert_bytes == weights // 32 * 9 + 3 * (8 + 1)
        assert bf16.expert_bytes == 2 * weights
        assert w2.geometry.dense_bytes == mx2.geometry.dense_bytes == bf16.dense_bytes
        assert any("moet-w2" in n and "registry" in n for n in w2.notes)

    # the registry is the one source of bytes: no 2.25-bpw rule beside it (MX2 differed from it)
    assert not hasattr(gfc, "TWO_BIT_FORMATS") and mx2.bytes_from == "registry"


def test_geometry_of_neighbours(kimi_k2_tiny, gpt_oss_tiny):
    with open_source(kimi_k2_tiny) as ck:
        rep = gfc.moe_geometry_report(ck)  # FP8 blocks on disk, planned as MXFP4
    assert rep.source_storage == "fp8-block" and rep.bytes_from == "registry"
    n = sum(a * b for _, (a, b) in rep.expert_weights)
    assert rep.geometry.expert_bytes == n // 32 * 17
    with open_source(gpt_oss_tiny) as ck:
        rep = gfc.moe_geometry_report(ck, format_id="gpt-oss-mxfp4")
        per_layer_bias = sum(e.nbytes for name, e in ck.tensors.items()
                             if ".layers.0." in name and name.endswith("_bias") and ".experts." in name)
        E = rep.geometry.experts
    # fused [E, ...] tensors: logical shapes per expert; biases kept as stored
    n = sum(a * b for _, (a, b) in rep.expert_weights)
    assert rep.geometry.expert_bytes == n // 32 * 17 + per_layer_bias // E


class _Entry(SimpleNamespace):
    pass


def _fake(config, shapes):
    tensors = {}
    for name, (dtype, shape) in shapes.items():
        size = {"U8": 1, "BF16": 2}[dtype] * int(np.prod(shape))
        tensors[name] = _Entry(dtype=dtype, shape=shape, nbytes=size)
    return SimpleNamespace(config=config, tensors=tensors, origin=Origin.local(None))


def _k3_like(experts=2, layers=2, odd=None):
    cfg = {"model_type": "kimi_k3", "text_config": {
        "model_type": "kimi_linear", "num_hidden_layers": layers, "hidden_size": 64, "num_experts": experts,
        "num_experts_per_token": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 0, "vocab_size": 8}}
    shapes = {"language_model.model.embed_tokens.weight": ("BF16", (8, 64))}
    for layer in range(layers):
        for e in range(experts):
            for w, shape in (("w1", (32, 64)), ("w2", (64, 32)), ("w3", (32, 64))):
                if odd == (layer, e) and w == "w2":
                    shape = (64, 64)
                base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}."
                shapes[base + "weight_packed"] = ("U8", (shape[0], shape[1] // 2))
                shapes[base + "weight_scale"] = ("U8", (shape[0], shape[1] // 32))
    return cfg, shapes


def test_geometry_refuses_odd_checkpoints():
    cfg, shapes = _k3_like()
    g = gfc.moe_geometry(_fake(cfg, shapes))
    assert (g.moe_layers, g.experts, g.top_k, g.dense_bytes) == (2, 2, 1, 8 * 64 * 2)
    assert g.expert_bytes == 3 * (32 * 32 + 32 * 2)
    with pytest.raises(UnsupportedError, match="experts differ"):
        gfc.moe_geometry(_fake(*_k3_like(odd=(1, 1))))
    # the model id: an hf:// source's repo id, else the config's name
    hub = Origin.hub("org/model", "0" * 40)
    assert gfc.moe_geometry(SimpleNamespace(**{**vars(_fake(cfg, shapes)), "origin": hub})).model_id == "org/model"
    assert gfc.moe_geometry(_fake({**cfg, "_name_or_path": "a/b"}, shapes)).model_id == "a/b"
    cfg, shapes = _k3_like()
    cfg["text_config"]["num_experts"] = 3
    with pytest.raises(InvalidFileError, match="layer 0 has 2 routed experts .* says 3"):
        gfc.moe_geometry(_fake(cfg, shapes))
    cfg, shapes = _k3_like()
    cfg["text_config"]["num_experts"] = 0
    with pytest.raises(UnsupportedError, match="no routed experts"):
        gfc.moe_geometry(_fake(cfg, shapes))


@pytest.mark.slow
def test_geometry_of_virtual_k3(virtual_k3):
    """K3_FACTS: 93 layers, layer 0 dense -> 92 MoE layers (1-92), 896 experts, top-16, one
    MXFP4 expert 17,547,264 B; the rest of the text model 113,509,540,864 B."""
    with open_source(virtual_k3) as ck:
        g = gfc.moe_geometry(ck)
        w2 = gfc.moe_geometry(ck, format_id="moet-w2")
    assert g == dataclasses.replace(MoEGeometry.k3(), model_id="")
    assert (g.moe_layers, g.experts, g.top_k, g.expert_bytes) == (92, 896, 16, 17_547_264)
    assert w2.expert_bytes == 9_289_728 and w2.dense_bytes == g.dense_bytes


# ---------------------------------------------------------------------- plan
def _loads(geo, seed=0):
    return np.random.default_rng(seed).lognormal(0, 1, (geo.moe_layers, geo.experts))


def _trace(geo, tokens, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(geo.experts, geo.top_k, replace=False) for _ in range(geo.moe_layers)])
                     for _ in range(tokens)]).astype(np.int32)


def _plan_notes(p):
    """A plan's notes less the two that name the shorthand's defaults (host DRAM, reserve)."""
    return tuple(n for n in p.notes if not n.startswith(("host DRAM:", "reserved HBM:")))


def test_shorthand_defaults_are_the_clis():
    """planning.plan with "8xH100" = `k3ckpt plan --devices 8xH100`: the preset's host
    DRAM (2 TB a DGX: 256 GB a GPU) and 10 % of HBM reserved, each noted."""
    p = api.plan(SMALL, "8xH100", loads=_loads(SMALL), redundant=0)
    d = p.devices
    assert d.host_dram_bytes == 8 * 256 * 10**9
    assert (d.reserved_kv_bytes, d.reserved_act_bytes) == (6_400_000_000, 1_600_000_000)
    assert [n.split(":")[0] for n in p.notes] == ["host DRAM", "reserved HBM"]
    q = api.plan(SMALL, parse_devices("8xH100"), loads=_loads(SMALL), redundant=0)   # a DeviceSet: as is
    assert q.devices.reserved_bytes == 0 and q.devices.host_dram_bytes == 0 and q.notes == ()


def test_plan_synthetic_is_deterministic():
    a = api.plan(SMALL, "8xH100", synthetic_tokens=5000, synthetic_trace_tokens=64)
    b = api.plan(SMALL, parse_devices("8xH100", host_dram="2048GB", reserved_kv="8%", reserved_act="2%"),
                      synthetic_tokens=5000, synthetic_trace_tokens=64)
    assert a.to_dict()["devices"] == b.to_dict()["devices"] and a.mode == "placement"
    assert a.to_json() == dataclasses.replace(b, notes=a.notes).to_json() and _plan_notes(a) == b.notes
    assert any(n.startswith("loads: synthetic") and "seed 1" in n for n in a.notes)
    assert a.placement_report.traffic_source == "trace"
    c = api.plan(SMALL, "8xH100", seed=2, synthetic_tokens=5000, synthetic_trace_tokens=64)
    assert c.to_json() != a.to_json()
    assert Plan.from_json(a.to_json()).notes == a.notes


def test_plan_inputs_and_notes(tmp_path):
    loads = _loads(SMALL)
    p = api.plan(SMALL, "8xH100", loads=loads, redundant=0)
    assert _plan_notes(p) == () and p.placement_report.traffic_source == "independent"
    assert p.placement_report.total_slots == 16
    # loads as a file, with one row per model layer (row 0 = dense layer 0): cut to layer_ids
    full = np.vstack([np.zeros((1, 16)), loads])
    np.save(tmp_path / "l.npy", full)
    q = api.plan(SMALL, "8xH100", loads=tmp_path / "l.npy", redundant=0)
    assert q.to_json() == p.to_json()
    # a trace alone: its counts are the loads, and it is also the held-out trace (noted)
    tr = _trace(SMALL, 30)
    r = api.plan(SMALL, "8xH100", trace=tr)
    assert any("selection counts" in n for n in r.notes) and any("in-sample" in n for n in r.notes)
    # with loads and a separate held-out trace: nothing to note
    s = api.plan(SMALL, "8xH100", loads=loads, heldout=tr)
    assert _plan_notes(s) == () and s.placement_report.traffic_source == "trace"


def test_plan_bad_input():
    with pytest.raises(UsageError, match=r"loads are \[4, 12\]; the model needs \[4, 16\]"):
        api.plan(SMALL, "8xH100", loads=np.ones((4, 12)))
    with pytest.raises(UsageError, match=r"loads are \[3, 16\].*\[5, 16\] \(one row per model layer\)"):
        api.plan(SMALL, "8xH100", loads=np.ones((3, 16)))
    bad = np.ones((4, 16))
    bad[2, 3] = np.nan
    with pytest.raises(UsageError, match="layer row 2, expert 3 is nan"):
        api.plan(SMALL, "8xH100", loads=bad)
    bad[2, 3] = -4
    with pytest.raises(UsageError, match="negative"):
        api.plan(SMALL, "8xH100", loads=bad)
    with pytest.raises(UsageError, match=r"trace is \[\*, 4, 3\], the model needs \[\*, 4, 4\]"):
        api.plan(SMALL, "8xH100", loads=np.ones((4, 16)), heldout=np.zeros((2, 4, 3), dtype=np.int32))
    with pytest.raises(UsageError, match="unknown device 'H900'"):
        api.plan(SMALL, "8xH900")
    with pytest.raises(UsageError, match="unknown format=.nope."):
        api.plan(SMALL, "8xH100", format="nope")
    with pytest.raises(UsageError, match="mode must be"):
        api.plan(SMALL, "8xH100", mode="fast")
    with pytest.raises(UsageError, match="dense must be"):
        api.plan(SMALL, "8xH100", dense="disk")
    with pytest.raises(NotFoundError, match="loads file not found"):
        api.plan(SMALL, "8xH100", loads="nowhere.npy")


def test_capacity_checks():
    k3 = MoEGeometry.k3()
    # 8 x H100 = 640 GB of HBM, no DRAM, no NVMe: K3 is 1.56 TB
    with pytest.raises(UsageError, match=r"cannot hold one copy of moonshotai/Kimi-K3 \(1.560 TB.*in any tier"):
        planning.check_capacity(k3, parse_devices("8xH100"))
    # NVMe of unstated capacity may hold it; stated capacity too small may not
    planning.check_capacity(k3, parse_devices("8xH100", nvme="1x7"))
    with pytest.raises(UsageError, match="host DRAM 0 B, NVMe 100.00 GB"):
        planning.check_capacity(k3, parse_devices("8xH100", nvme="1x7@100GB"))
    five = parse_devices("2xRTX-5090", nvme="2x14@4TB", host_dram="64GB")
    with pytest.raises(UsageError, match="--dense host"):
        planning.check_capacity(k3, five)
    with pytest.raises(UsageError, match=r"113.51 GB per node.*64.00 GB"):
        planning.check_capacity(k3, five, dense="host")
    planning.check_capacity(k3, dataclasses.replace(five, host_dram_bytes=512 * 10**9), dense="host")


def test_plan_dense_host():
    ds = parse_devices("2xRTX-5090", nvme="2x14@4TB", host_dram="64GB")
    geo = MoEGeometry(4, 64, 4, 1 * GiB, 20 * 10**9, (1, 2, 3, 4), "toy", 1000)
    with pytest.raises(UsageError, match="dense"):  # 10 GB of dense per GPU leaves 22 experts: fine; 40 GB not
        api.plan(dataclasses.replace(geo, dense_bytes=80 * 10**9), ds, loads=_loads(geo))
    on_gpu = api.plan(geo, ds, loads=_loads(geo))
    on_host = api.plan(geo, ds, loads=_loads(geo), dense="host")
    assert on_gpu.mode == on_host.mode == "cache"
    assert on_host.model.dense_bytes == 0 and on_host.devices.host_dram_bytes == 44 * 10**9
    # the GPUs gain the dense share (10 GB) in experts; the host tier loses 20 GB
    assert (on_host.cache.hbm_slots - on_gpu.cache.hbm_slots).tolist() == [9, 9]
    assert any("kept in host DRAM" in n and "20,000,000,000 B" in n for n in on_host.notes)
    assert json.loads(on_host.to_json())["notes"] == list(on_host.notes)


def test_plan_from_checkpoint_path_and_object(k3_tiny):
    a = api.plan(k3_tiny, "8xH100", synthetic_tokens=2000, synthetic_trace_tokens=32)
    with open_source(k3_tiny) as ck:
        b = api.plan(ck, "8xH100", synthetic_tokens=2000, synthetic_trace_tokens=32)
        # the headers name no model: the plan takes the model the profile detects
        geo = dataclasses.replace(gfc.moe_geometry(ck), model_id="Kimi K3")
    c = api.plan(geo, "8xH100", synthetic_tokens=2000, synthetic_trace_tokens=32)
    assert a.to_json() == b.to_json() == c.to_json()
    assert a.model == geo and a.format_id == "mxfp4-pack-quantized"
    w2 = api.plan(k3_tiny, "8xH100", format="moet-w2", synthetic_tokens=2000, synthetic_trace_tokens=32)
    assert w2.format_id == "moet-w2" and w2.model.expert_bytes == 3 * 256 * 256 // 32 * 9
    assert any("moet-w2" in n for n in w2.notes)
