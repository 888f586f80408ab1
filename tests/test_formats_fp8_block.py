"""Block FP8 (DeepSeek-V3 / Kimi K2): golden vectors, kernel == reference, ml_dtypes oracle."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from k3ckpt.errors import ShapeError, UnsupportedError, UsageError
from k3ckpt.formats.base import get_format
from k3ckpt.formats.fp8_block import TILE, BlockFP8, decode_fp8_block, decode_fp8_block_ref, scale_shape

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fp8_block_vectors.json").read_text())
FMT = get_format("fp8-block")


def _value(v) -> np.float32:
    return np.float32(float(v))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    nan = np.isnan(b32)
    return bool((np.isnan(a32) == nan).all() and np.array_equal(a32[~nan].view(np.uint32), b32[~nan].view(np.uint32)))


def _oracle(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Independent: ml_dtypes' E4M3 and an explicit per-element tile lookup."""
    n, k = w.shape[-2:]
    vals = w.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    rows = np.arange(n) // TILE
    cols = np.arange(k) // TILE
    return vals * s[..., rows[:, None], cols[None, :]]


@pytest.mark.parametrize("reference", [False, True])
def test_golden_vectors(reference):
    shape = tuple(GOLDEN["shape"])
    w = np.zeros(shape, np.uint8)
    for e in GOLDEN["entries"]:
        w[e["row"], e["col"]] = int(e["byte"], 16)
    s = np.array(GOLDEN["scale_inv"], np.float32)
    parts = {"weight": w, "scale_inv": s}
    dec = FMT.reference_decode if reference else FMT.decode
    f32 = dec(parts)
    bf16 = dec(parts, out="bfloat16")
    assert f32.dtype == np.float32 and bf16.dtype == np.dtype(ml_dtypes.bfloat16)
    touched = np.zeros(shape, bool)
    for e in GOLDEN["entries"]:
        r, c = e["row"], e["col"]
        touched[r, c] = True
        for got, want in ((f32[r, c], _value(e["f32"])), (np.float32(bf16[r, c]), _value(e["bf16"]))):
            if np.isnan(want):
                assert np.isnan(got), e
            else:
                assert got.view(np.uint32) == want.view(np.uint32), (e, got, want)
    assert (f32[~touched] == 0).all() and not np.signbit(f32[~touched]).any()


def test_all_256_bytes_match_ml_dtypes():
    w = np.arange(256, dtype=np.uint8).reshape(2, 128)
    s = np.ones((1, 1), np.float32)
    want = w.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    for dec in (decode_fp8_block, decode_fp8_block_ref):
        assert _same_bits(dec(w, s), want)
    assert np.isnan(decode_fp8_block(w, s)[0, 127]) and np.isnan(decode_fp8_block(w, s)[1, 127])


@pytest.mark.parametrize("shape", [(1, 1), (128, 128), (129, 1), (257, 300), (2, 3, 130, 129), (0, 5), (3, 0)])
def test_kernel_equals_reference_and_oracle(shape):
    rng = np.random.default_rng(sum(shape) + len(shape))
    w = rng.integers(0, 256, shape, dtype=np.uint8)
    s = np.exp2(rng.uniform(-20, 4, scale_shape(shape))).astype(np.float32) * rng.choice([-1, 1], scale_shape(shape))
    s = s.astype(np.float32)
    a = decode_fp8_block(w, s)
    b = decode_fp8_block_ref(w, s)
    assert a.shape == b.shape == shape and a.dtype == np.float32
    assert _same_bits(a, b)
    assert _same_bits(a, _oracle(w, s))
    parts = {"weight": w, "scale_inv": s}
    for out in (np.float32, "bfloat16"):
        assert _same_bits(FMT.decode(parts, out=out), FMT.reference_decode(parts, out=out))
    # bfloat16 output = the float32 product rounded to nearest even (DeepSeek's weight_dequant)
    assert _same_bits(FMT.decode(parts, out="bfloat16"), a.astype(ml_dtypes.bfloat16))


def test_nan_and_inf_scales_propagate_to_their_tile_only():
    w = np.full((130, 130), 0x38, np.uint8)  # 1.0 everywhere
    s = np.array([[np.nan, 1.0], [np.inf, 2.0]], np.float32)
    a = decode_fp8_block(w, s)
    assert _same_bits(a, decode_fp8_block_ref(w, s))
    assert np.isnan(a[:128, :128]).all() and (a[:128, 128:] == 1).all()
    assert np.isinf(a[128:, :128]).all() and (a[128:, 128:] == 2).all()


def test_accepts_ml_dtypes_float8_and_fixture_quantizer_round_trips():
    from k3ckpt.fixtures.generate import fp8_block_quantize

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((200, 300)) * 0.02).astype(np.float32)
    q, s = fp8_block_quantize(x)
    assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and s.shape == (2, 3)
    y = FMT.decode({"weight": q, "scale_inv": s})
    assert _same_bits(y, decode_fp8_block(q.view(np.uint8), s))
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 except near the subnormal range
    big = np.abs(x) > 2.0**-6 * s.max()
    assert (np.abs(y - x)[big] <= np.abs(x)[big] * 2.0**-4 * 1.0001).all()


def test_table_row_and_names():
    info = FMT.info
    assert isinstance(FMT, BlockFP8) and info.id == "fp8-block" and not info.can_encode
    assert info.fields_text == "4 + 16384" and info.bits_per_weight == 8 * 16388 / 16384
    assert FMT.tensor_names("model.layers.3.mlp.experts.7.down_proj") == {
        "weight": "model.layers.3.mlp.experts.7.down_proj.weight",
        "scale_inv": "model.layers.3.mlp.experts.7.down_proj.weight_scale_inv",
    }
    assert FMT.match_name("a.b.weight_scale_inv") == ("a.b", "scale_inv")
    assert FMT.match_name("a.b.weight") == ("a.b", "weight")
    specs = FMT.part_specs((2048, 7168))
    assert specs["weight"].shape == (2048, 7168) and specs["scale_inv"].shape == (16, 56)
    assert FMT.part_specs((192, 256))["scale_inv"].shape == (2, 2)
    parts = FMT.sample_parts((3, 130, 129), np.random.default_rng(0))
    assert FMT.logical_shape(parts) == (3, 130, 129)
    assert FMT.logical_shape_from_shapes({"weight": (130, 129), "scale_inv": (2, 2)}) == (130, 129)


def test_contract_errors():
    w = np.zeros((130, 129), np.uint8)
    s = np.ones((2, 2), np.float32)
    with pytest.raises(ShapeError, match=r"\[2, 2\].*\[1, 2\]"):
        FMT.decode({"weight": w, "scale_inv": s[:1]}, name="x.w")
    with pytest.raises(UsageError, match="scale_inv"):
        FMT.decode({"weight": w}, name="x.w")
    with pytest.raises(ShapeError, match="2-D"):
        FMT.decode({"weight": w[0], "scale_inv": s[0]})
    with pytest.raises(ShapeError, match="F8_E4M3"):
        FMT.decode({"weight": w.astype(np.int16), "scale_inv": s}, name="x.w")
    with pytest.raises(ShapeError, match="F32"):
        FMT.decode({"weight": w, "scale_inv": s.astype(np.float64)}, name="x.w")
    with pytest.raises(UnsupportedError):
        FMT.encode(np.zeros((4, 4), np.float32))
    with pytest.raises(ShapeError):
        decode_fp8_block(w, s[:, :1])


def test_row_ranges_decode_like_the_whole():
    rng = np.random.default_rng(9)
    n, k = 300, 200
    parts = FMT.sample_parts((n, k), rng)
    whole = FMT.decode(parts)
    pieces = []
    for r0 in range(0, n, 256):
        r1 = min(n, r0 + 256)
        a, b = FMT.part_rows("weight", r0, r1, n)
        c, d = FMT.part_rows("scale_inv", r0, r1, n)
        pieces.append(FMT.decode({"weight": parts["weight"][a:b], "scale_inv": parts["scale_inv"][c:d]}))
    assert _same_bits(np.concatenate(pieces), whole)
    with pytest.raises(UsageError, match="aligned"):
        FMT.part_rows("weight", 64, 128, n)
    with pytest.raises(UsageError, match="aligned"):
        FMT.part_rows("scale_inv", 0, 100, n)


def test_bench_tool_runs(capsys):
    import runpy

    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "tools" / "bench_decoders.py"))
    assert bench["main"](["--size", "256x256", "--repeat", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["shape"] == [256, 256] and got["memcpy_out_gb_per_s"] > 0
    assert [r["format"] for r in got["decoders"]] == [
        "fp8-block", "int4-pack-quantized", "nvfp4", "mxfp4-pack-quantized"]
    assert all(r["mweights_per_s"] > 0 for r in got["decoders"])
