"""``dequant``: decoded values equal the format decoder, the rest byte-identical."""

from __future__ import annotations

import hashlib
import json

import ml_dtypes
import numpy as np
import pytest

from k3ckpt import api
from k3ckpt.errors import K3ckptError, OutputExistsError, UsageError
from k3ckpt.formats import get_format
from k3ckpt.io import open_checkpoint


def _sha(ckpt, name):
    h = hashlib.sha256()
    for chunk in ckpt.iter_chunks(name):
        h.update(chunk)
    return h.hexdigest()


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_k3_tiny_decodes_every_expert_and_copies_the_rest(k3_tiny, tmp_path, dtype):
    out = tmp_path / "out"
    result = api.dequant(k3_tiny, out, dtype=dtype)
    fmt = get_format("mxfp4-pack-quantized")
    vdt = {"bf16": ml_dtypes.bfloat16, "f32": np.float32}[dtype]
    with open_checkpoint(k3_tiny) as src, open_checkpoint(out) as dst:
        packed = [n for n in src.tensors if n.endswith(".weight_packed")]
        assert len(result.decoded) == len(packed) > 0
        for name in packed:
            base = name[: -len("_packed")]
            want = fmt.reference_decode({"packed": src.read_raw(name), "scale": src.read_raw(base + "_scale")})
            got = dst.read_raw(base)
            assert dst.entry(base).dtype == {"bf16": "BF16", "f32": "F32"}[dtype]
            # MXFP4 values are exact in bf16 and f32
            np.testing.assert_array_equal(got.view(vdt).astype(np.float32), want)
        plain = [n for n in src.tensors if not n.endswith((".weight_packed", ".weight_scale"))]
        assert result.copied == len(plain)
        for name in plain:
            assert dst.entry(name).dtype == src.entry(name).dtype
            assert _sha(dst, name) == _sha(src, name)
        assert set(dst.tensors) == set(plain) | {n[: -len("_packed")] for n in packed}
        cfg = dst.config
    assert "quantization_config" not in cfg.get("text_config", {}) and "quantization_config" not in cfg
    assert (out / "tokenizer_config.json").exists()


def test_subset_narrows_quantization_config(k3_tiny, tmp_path):
    result = api.dequant(k3_tiny, tmp_path / "out", tensors=r"layers\.1\..*experts\.0\.w1")
    assert result.decoded == ("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight",)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = cfg["text_config"]["quantization_config"]
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1" in qc["ignore"]
    with open_checkpoint(tmp_path / "out") as dst:
        assert "language_model.model.layers.1.block_sparse_moe.experts.1.w1.weight_packed" in dst.tensors


def test_gpt_oss_is_unfused_gate_even_up_odd(gpt_oss_tiny, tmp_path):
    out = tmp_path / "out"
    api.dequant(gpt_oss_tiny, out, dtype="f32")
    fmt = get_format("gpt-oss-mxfp4")
    with open_checkpoint(gpt_oss_tiny) as src, open_checkpoint(out) as dst:
        blocks = [n for n in src.tensors if n.endswith("gate_up_proj_blocks")]
        assert blocks
        for name in blocks:
            stem = name[: -len(".gate_up_proj_blocks")]
            fused = fmt.reference_decode({"blocks": src.read_raw(name),
                                          "scales": src.read_raw(stem + ".gate_up_proj_scales")})
            bias = src.read_raw(stem + ".gate_up_proj_bias")
            for e in range(fused.shape[0]):
                np.testing.assert_array_equal(dst.read_raw(f"{stem}.{e}.gate_proj.weight"), fused[e, 0::2])
                np.testing.assert_array_equal(dst.read_raw(f"{stem}.{e}.up_proj.weight"), fused[e, 1::2])
                np.testing.assert_array_equal(dst.read_raw(f"{stem}.{e}.gate_proj.bias"), bias[e, 0::2])
                np.testing.assert_array_equal(dst.read_raw(f"{stem}.{e}.up_proj.bias"), bias[e, 1::2])
        assert not any(n.endswith(("_blocks", "_scales")) for n in dst.tensors)
        assert "quantization_config" not in dst.config


def test_nan_scales_decode_to_nan_and_are_counted(tmp_path):
    from k3ckpt.io import save_file

    packed = np.full((2, 32), 0x22, np.uint8)
    scale = np.full((2, 2), 0x7F, np.uint8)
    scale[1, 1] = 0xFF
    save_file(tmp_path / "src" / "model.safetensors" if False else tmp_path / "model.safetensors", {
        "model.layers.0.mlp.experts.0.w1.weight_packed": packed,
        "model.layers.0.mlp.experts.0.w1.weight_scale": scale,
    })
    result = api.dequant(tmp_path / "model.safetensors", tmp_path / "out", dtype="f32")
    assert result.nan_blocks == {"model.layers.0.mlp.experts.0.w1.weight": 1}
    with open_checkpoint(tmp_path / "out") as dst:
        x = dst.read_raw("model.layers.0.mlp.experts.0.w1.weight")
    assert np.isnan(x[1, 32:]).all() and not np.isnan(x[0]).any() and not np.isnan(x[1, :32]).any()


def test_refuses_non_empty_destination_and_bad_options(k3_tiny, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        api.dequant(k3_tiny, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    with pytest.raises(UsageError):
        api.dequant(k3_tiny, tmp_path / "x", dtype="int8")
    with pytest.raises(UsageError):
        api.dequant(k3_tiny, tmp_path / "y", tensors="(")
    with pytest.raises(UsageError):
        api.dequant(k3_tiny, tmp_path / "z", tensors="no-such-weight")
    with pytest.raises(K3ckptError):
        api.dequant(tmp_path / "missing", tmp_path / "w")
