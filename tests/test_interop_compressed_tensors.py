"""Interop with the ``compressed-tensors`` package (vLLM's quantized-checkpoint library).

Its model-free converters (``compressed_tensors.entrypoints.convert``) read a
checkpoint's own config.json and tensors, so they check our files as another
loader would see them: names, dtypes, shapes, ``quantization_config``, values.

* MXFP4 in K3's compressed-tensors layout (the K3 tiny fixture's experts are
  written by our encoder; so is ``k3ckpt requant --format mxfp4`` output from
  block-FP8 and ModelOpt NVFP4 sources): ``CompressedTensorsDequantizer`` gives
  exactly the values ``k3ckpt dequant`` writes (MXFP4 is exact in bf16 and f32).
* INT4 pack-quantized (Kimi K2-Thinking fixture) and NVFP4 (compressed-tensors
  naming): the same dequantizer, bit-exact in bf16 (its arithmetic on a bf16 model).
* Block FP8 (DeepSeek-V3 fixture, partial edge tiles): ``FP8BlockDequantizer``,
  bit-exact in f32 and bf16 (fp32 product, then the output dtype).
* NVFP4 in ModelOpt naming: ``ModelOptNvfp4Converter`` recognises our fixture's
  tensors and renames them to compressed-tensors NVFP4 bytes unchanged (its
  global scale is ``1 / weight_scale_2``, so decoded values agree to float32
  rounding, not bit for bit).

Skipped, with the reason shown, when torch or compressed-tensors cannot be
imported (``pip install torch==2.13.0 compressed-tensors``; the ``interop`` extra).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="interop tests need torch (pip install torch==2.13.0)")
pytest.importorskip("compressed_tensors", reason="interop tests need compressed-tensors (pip install compressed-tensors)")

from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (  # noqa: E402
    CompressedTensorsDequantizer,
)
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import (  # noqa: E402
    FP8BlockDequantizer,
)
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from k3ckpt import api  # noqa: E402
from k3ckpt.fixtures.sources import make_source_fixture  # noqa: E402
from k3ckpt.formats import get_format  # noqa: E402
from k3ckpt.io import open_checkpoint  # noqa: E402

_BITS = {"bf16": (torch.bfloat16, torch.int16, np.uint16), "f32": (torch.float32, torch.int32, np.uint32)}


def _load(path) -> dict:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _bits(t: torch.Tensor, dtype: str) -> np.ndarray:
    tdt, idt, ndt = _BITS[dtype]
    assert t.dtype == tdt, t.dtype
    return t.contiguous().view(idt).numpy().view(ndt)


def _ours(src, tmp_path, dtype: str) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    out = tmp_path / f"ours-{dtype}"
    result = api.dequant(src, out, dtype=dtype)
    assert result.nan_blocks == {}  # NaN scales are where the libraries differ (see the 0xFF test)
    with open_checkpoint(out) as dst:
        return {n: dst.read_raw(n) for n in result.decoded}, result.decoded


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop-sources")
    return {name: make_source_fixture(name, root / name, layers=2, experts=2)
            for name in ("kimi-k2-thinking-tiny", "nvfp4-tiny", "nvfp4-modelopt-tiny", "deepseek-v3-tiny")}


def _same_as_ct_dequantizer(src, tmp_path, dtype: str) -> int:
    theirs = CompressedTensorsDequantizer(src, dtype=_BITS[dtype][0]).process(_load(src))
    ours, decoded = _ours(src, tmp_path, dtype)
    assert decoded
    for name in decoded:
        np.testing.assert_array_equal(ours[name].view(_BITS[dtype][2]), _bits(theirs[name], dtype), err_msg=name)
    # everything compressed-tensors leaves alone, we leave alone too -- except a decoded
    # module's activation input_scale, which it passes through and we drop
    with open_checkpoint(tmp_path / f"ours-{dtype}") as dst:
        assert set(dst.tensors) == {n for n in theirs if not n.endswith(".input_scale")}
    return len(decoded)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_mxfp4_k3_layout_matches_compressed_tensors(k3_tiny, tmp_path, dtype):
    n = _same_as_ct_dequantizer(k3_tiny, tmp_path, dtype)
    with open_checkpoint(k3_tiny) as src:
        assert n == sum(1 for t in src.tensors if t.endswith(".weight_packed"))


def test_int4_pack_quantized_matches_compressed_tensors(sources, tmp_path):
    # compressed-tensors computes on the model's dtype: bf16 codes times bf16 scales
    assert _same_as_ct_dequantizer(sources["kimi-k2-thinking-tiny"], tmp_path, "bf16") == 2 * 3


def test_nvfp4_matches_compressed_tensors(sources, tmp_path):
    assert _same_as_ct_dequantizer(sources["nvfp4-tiny"], tmp_path, "bf16") == 2 * 3


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_block_fp8_matches_compressed_tensors(sources, tmp_path, dtype):
    src = sources["deepseek-v3-tiny"]
    theirs = FP8BlockDequantizer.from_pretrained(src, dtype=_BITS[dtype][0]).process(_load(src))
    ours, decoded = _ours(src, tmp_path, dtype)
    edge = [n for n in decoded if any(d % 128 for d in ours[n].shape)]
    assert edge, "the fixture should have partial edge tiles"
    for name in decoded:
        np.testing.assert_array_equal(ours[name].view(_BITS[dtype][2]), _bits(theirs[name], dtype), err_msg=name)


def test_modelopt_naming_is_what_compressed_tensors_converts(sources, tmp_path):
    src = sources["nvfp4-modelopt-tiny"]
    raw = _load(src)
    modules = sorted(n[: -len(".weight_scale_2")] for n in raw if n.endswith(".weight_scale_2"))
    assert modules
    conv = ModelOptNvfp4Converter(targets=["re:.*mlp\\.experts\\..*"])
    ct = conv.validate(dict(raw))   # raises on orphan or malformed qparams
    ours, _ = _ours(src, tmp_path, "f32")
    nv = get_format("nvfp4")
    for m in modules:
        assert torch.equal(ct[f"{m}.weight_packed"], raw[f"{m}.weight"])
        assert torch.equal(ct[f"{m}.weight_scale"].view(torch.uint8), raw[f"{m}.weight_scale"].view(torch.uint8))
        assert torch.equal(ct[f"{m}.weight_global_scale"], 1 / raw[f"{m}.weight_scale_2"])
        assert f"{m}.input_global_scale" in ct and f"{m}.weight" not in ct
        # decoded through compressed-tensors' convention (divide by 1/scale_2): equal to float32 rounding
        parts = {"packed": ct[f"{m}.weight_packed"].numpy(),
                 "scale": ct[f"{m}.weight_scale"].view(torch.uint8).numpy(),
                 "global_scale": ct[f"{m}.weight_global_scale"].reshape(1).numpy()}
        np.testing.assert_allclose(nv.decode(parts), ours[m + ".weight"], rtol=2.0**-21, atol=0)


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "nvfp4-modelopt-tiny"])
def test_requant_to_mxfp4_output_matches_compressed_tensors(sources, tmp_path, name):
    # `k3ckpt requant --format mxfp4` (compressed-tensors layout): the config it writes
    # is one compressed-tensors parses, and its dequantizer agrees with ours
    api.requant(sources[name], tmp_path / "mx", format="mxfp4", workers=1, progress=False)
    assert _same_as_ct_dequantizer(tmp_path / "mx", tmp_path, "f32") == 2 * 3


def test_mxfp4_nan_scale_is_where_the_libraries_differ(tmp_path):
    """E8M0 0xFF is NaN (OCP MX v1.0); compressed-tensors' ``2 ** (s - 127)`` in
    bf16 gives inf there (FORMATS 1.1).  Every other block agrees."""
    from k3ckpt.io import save_file

    x = np.random.default_rng(11).standard_normal((4, 64)).astype(np.float32)
    parts = get_format("mxfp4-pack-quantized").encode(x)
    parts["scale"][2, 1] = 0xFF
    base = "model.layers.0.mlp.experts.0.gate_proj"
    save_file(tmp_path / "src" / "model.safetensors", {f"{base}.weight_packed": parts["packed"],
                                                       f"{base}.weight_scale": parts["scale"]})
    qc = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "ignore": [],
          "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                        "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                    "strategy": "group", "symmetric": True,
                                                    "scale_dtype": "torch.uint8"}}}}
    import json

    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "mystery", "quantization_config": qc}))
    theirs = CompressedTensorsDequantizer(tmp_path / "src", dtype=torch.float32).process(
        _load(tmp_path / "src"))[f"{base}.weight"].numpy()
    result = api.dequant(tmp_path / "src", tmp_path / "out", dtype="f32")
    assert result.nan_blocks == {f"{base}.weight": 1}
    with open_checkpoint(tmp_path / "out") as dst:
        ours = dst.read_raw(f"{base}.weight")
    bad = np.zeros_like(ours, bool)
    bad[2, 32:] = True
    np.testing.assert_array_equal(ours[~bad], theirs[~bad])
    assert np.isnan(ours[bad]).all() and not np.isfinite(theirs[bad]).any()
