"""``inspect``: header-only report, JSON form, scan statistics."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from k3ckpt import api
from k3ckpt.io import open_checkpoint

K3_ROUTED_EXPERT_BYTES = 1_446_456_066_048   # K3_FACTS: 82,432 experts x 17,547,264 B
K3_TOTAL_BYTES = 1_560_860_324_864           # the real index's total_size


def test_k3_tiny_report_adds_up(k3_tiny):
    r = api.inspect(k3_tiny)
    assert r.profile == "kimi_k3"
    assert r.num_layers == 4 and r.dense_layers == (0,) and r.moe_layers == (1, 2, 3)
    assert r.experts_per_layer == 8 and r.top_k == 2
    assert r.routed_experts == 3 * 8
    with open_checkpoint(k3_tiny) as ckpt:
        assert r.tensor_count == len(ckpt.tensors)
        assert r.total_bytes == sum(e.nbytes for e in ckpt.tensors.values())
        assert [s.name for s in r.shards] == ckpt.shards
        expert_bytes = sum(e.nbytes for n, e in ckpt.tensors.items() if ".experts." in n)
    assert r.routed_expert_bytes == expert_bytes
    for buckets in (r.by_role, r.by_storage):
        assert sum(b.bytes for b in buckets) == r.total_bytes
        assert sum(b.tensors for b in buckets) == r.tensor_count
        assert sum(b.params for b in buckets) == r.params_total
    mx = {b.key: b for b in r.by_storage}["mxfp4-pack-quantized"]
    assert mx.bits_per_weight == pytest.approx(4.25)   # 4-bit codes + one byte per 32
    routed = {b.key: b for b in r.by_role}["routed_expert"]
    assert routed.params == r.routed_expert_params
    # active = everything but vision and the unrouted share of the experts
    vision = {b.key: b for b in r.by_role}["vision"].params
    expect = r.params_total - vision - r.routed_expert_params * (1 - r.top_k / r.experts_per_layer)
    assert r.params_active == pytest.approx(expect, abs=1)
    assert [layer.mlp for layer in r.layers] == ["dense", "moe", "moe", "moe"]
    assert r.unrecognised == () and r.warnings == ()


def test_json_is_stable_and_complete(k3_tiny):
    out = api.inspect(k3_tiny).to_json()
    text = json.dumps(out)
    back = json.loads(text)
    assert back["schema_version"] == 1
    for key in ("profile", "num_layers", "moe_layers", "params_total", "params_active", "by_role",
                "by_storage", "shards", "layers", "routed_expert_bytes", "unrecognised", "scan"):
        assert key in back
    assert all({"key", "tensors", "params", "bytes", "bits_per_weight"} <= set(b) for b in back["by_role"])


def test_scan_counts_codes_scales_and_amax(k3_tiny):
    r = api.inspect(k3_tiny, scan=True)
    roles = {s.role: s for s in r.scan.roles}
    routed = roles["routed_expert"]
    assert routed.elements == r.routed_expert_params
    assert int(routed.code_hist.sum()) == r.routed_expert_params
    assert int(routed.scale_hist.sum()) == r.routed_expert_params // 32
    assert routed.nan_scales == 0
    # Check amax and the zero fraction independently through the format's decoder.
    from k3ckpt.formats import get_format

    fmt = get_format("mxfp4-pack-quantized")
    amax, zeros, total = 0.0, 0, 0
    with open_checkpoint(k3_tiny) as ckpt:
        for name in ckpt.tensors:
            if name.endswith(".weight_packed"):
                x = fmt.decode({"packed": ckpt.read_raw(name),
                                "scale": ckpt.read_raw(name.replace("_packed", "_scale"))})
                amax = max(amax, float(np.abs(x).max()))
                zeros += int(np.count_nonzero(x == 0))
                total += x.size
    assert routed.amax == amax
    assert routed.zero_code_fraction == pytest.approx(zeros / total)
    assert r.scan.bytes_read == r.total_bytes
    assert json.loads(json.dumps(r.to_json()))["scan"]["roles"]


def test_scan_reports_nan_scales(tmp_path):
    from k3ckpt.io import save_file

    packed = np.full((4, 16), 0x21, np.uint8)
    scale = np.full((4, 1), 0x7F, np.uint8)
    scale[2, 0] = 0xFF
    save_file(tmp_path / "m.safetensors", {
        "model.layers.0.mlp.experts.0.w1.weight_packed": packed,
        "model.layers.0.mlp.experts.0.w1.weight_scale": scale,
        "model.layers.0.input_layernorm.weight": np.array([1.0, np.nan, np.inf], np.float32),
    })
    r = api.inspect(tmp_path / "m.safetensors", scan=True)
    roles = {s.role: s for s in r.scan.roles}
    assert roles["routed_expert"].nan_scales == 1
    assert roles["routed_expert"].amax == 1.0        # code 2 (1.0) x 2^0; the NaN block is skipped
    assert roles["norm"].nan == 1 and roles["norm"].inf == 1


def test_virtual_k3_full_scale_from_headers(virtual_k3):
    t0 = time.perf_counter()
    r = api.inspect(virtual_k3)
    seconds = time.perf_counter() - t0
    assert r.profile == "kimi_k3"
    assert r.tensor_count == 497_220 and len(r.shards) == 96
    assert r.total_bytes == K3_TOTAL_BYTES
    assert r.routed_expert_bytes == K3_ROUTED_EXPERT_BYTES
    assert r.routed_experts == 92 * 896
    assert r.num_layers == 93 and len(r.moe_layers) == 92
    assert r.attention_layers == {"kda": 69, "mla": 24}
    assert r.unrecognised == ()
    assert 2.7e12 < r.params_total < 2.9e12        # "2.8T parameters"
    print(f"inspect of the virtual K3: {seconds:.2f} s")
    assert math.isfinite(seconds)
