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


# -- the text output and the options (issue 17, items 4, 5, 7) ---------------------------------

def _run(capsys, *args):
    from k3ckpt.cli.main import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_text_report_reads_right(capsys, k3_tiny):
    rc, out, _ = _run(capsys, "inspect", k3_tiny, "--scan", "-q")
    assert rc == 0
    lines = out.splitlines()
    # layer 0 is a dense layer, not "0 dense layers"
    assert "dense MLP: layer 0; MoE: layers 1-3" in out and "dense MLP: 0" not in out
    # every label fits its 14-character column
    head = lines[: lines.index("")]
    assert all(ln[13] == " " and ln[14] != " " for ln in head), head
    assert any(ln.startswith("expert bytes  2.51 MB (2,506,752 B) in routed experts") for ln in head)
    # the role table counts tensors (codes and scales apart), the scan counts weights
    role = next(ln for ln in lines if ln.startswith("by role"))
    scan = next(ln for ln in lines if ln.startswith("scan by role"))
    assert role.split()[2] == "tensors" and scan.split()[3] == "weights"
    routed_role = next(ln for ln in lines if ln.startswith("routed_expert ") and "4.250" in ln)
    routed_scan = [ln for ln in lines if ln.startswith("routed_expert ")][-1]
    assert routed_role.split()[1] == "144" and routed_scan.split()[1] == "72"


def test_layer_lists_say_none_one_or_many():
    from k3ckpt.cli.inspect import _layers

    assert _layers(()) == "none" and _layers((0,)) == "layer 0" and _layers((1, 2, 3, 5)) == "layers 1-3, 5"


def test_model_name_is_in_the_report(k3_tiny, gpt_oss_tiny):
    r = api.inspect(k3_tiny)
    assert r.model_name == "Kimi K3" and r.to_json()["model_name"] == "Kimi K3"
    assert api.inspect(gpt_oss_tiny).model_name == "gpt-oss"


def test_list_tensors_flag_and_its_old_spelling(capsys, k3_tiny):
    rc, out, err = _run(capsys, "inspect", k3_tiny, "--list-tensors")
    assert rc == 0 and err == "" and "language_model.model.embed_tokens.weight" in out
    rc, old, err = _run(capsys, "inspect", k3_tiny, "--tensors")
    assert rc == 0 and old == out and err == "k3ckpt: warning: inspect --tensors is now --list-tensors\n"
    rc, helptext, _ = _run(capsys, "inspect", "--help")
    assert "--list-tensors" in helptext and "--tensors " not in helptext


@pytest.mark.parametrize("name", ["inspect", "formats"])
def test_every_option_has_help_and_examples(capsys, name):
    import importlib

    import click

    cmd = importlib.import_module(f"k3ckpt.cli.{name}").command
    options = [p for p in cmd.params if isinstance(p, click.Option) and not p.hidden]
    assert options and all(p.help for p in options), [p.name for p in options if not p.help]
    rc, out, _ = _run(capsys, name, "--help")
    assert rc == 0 and "Examples:" in out and f"k3ckpt {name}" in out.split("Examples:")[1]
