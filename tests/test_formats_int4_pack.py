"""compressed-tensors pack-quantized INT4: golden vectors, kernel == reference, an
independent bit-stream packer, encode rule and the weight_shape tensor."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from k3ckpt.errors import ShapeError, UsageError
from k3ckpt.formats.base import get_format
from k3ckpt.formats.int4_pack import decode_int4, decode_int4_ref, encode_int4, encode_int4_ref

GOLDEN = json.loads((Path(__file__).parent / "golden" / "int4_pack_vectors.json").read_text())
FMT = get_format("int4-pack-quantized")


def _words(hexes) -> np.ndarray:
    return np.array([int(h, 16) for h in hexes], np.uint32).view(np.int32)


def _bf16(bits_hex: str) -> np.float32:
    return np.array([int(bits_hex, 16) << 16], np.uint32).view(np.float32)[0]


def _pack_bitstream(q: np.ndarray) -> np.ndarray:
    """Independent packer written from compressed-tensors' description: element i of a
    row is put at bit 4*i of one long little-endian bit stream, as q + 8."""
    rows = []
    for row in q:
        stream = 0
        for i, v in enumerate(row):
            stream |= (int(v) + 8) << (4 * i)
        nwords = len(row) // 8
        rows.append([(stream >> (32 * w)) & 0xFFFFFFFF for w in range(nwords)])
    return np.array(rows, np.uint32).view(np.int32)


@pytest.mark.parametrize("dec", [decode_int4, decode_int4_ref])
def test_golden_decode(dec):
    first, second = GOLDEN["decode"]
    out = dec(_words(first["words"])[None], np.array([[int(first["scale"], 16)]], np.uint16))
    assert np.array_equal(out[0], np.array(first["q"], np.float32) * np.float32(first["scale_value"]))
    parts = {"packed": _words(second["words"])[None], "scale": np.array([[int(second["scale"], 16)]], np.uint16),
             "shape": np.array([1, 32], np.int64)}
    f32 = (FMT.reference_decode if dec is decode_int4_ref else FMT.decode)(parts)
    bf = (FMT.reference_decode if dec is decode_int4_ref else FMT.decode)(parts, out="bfloat16")
    assert list(f32[0, :2]) == second["f32_first"] and (f32[0, 2:8] == f32[0, 1]).all() and (f32[0, 8:] == 0).all()
    assert [float(v) for v in bf[0, :2]] == second["bf16_first"]


@pytest.mark.parametrize("enc", [encode_int4, encode_int4_ref])
def test_golden_encode(enc):
    for case in GOLDEN["encode"]:
        x = np.array([case["x"]], np.float32)
        packed, scale = enc(x)
        assert packed.dtype == np.int32 and scale.dtype == np.uint16
        assert int(scale[0, 0]) == int(case["scale"], 16), case["why"]
        assert np.array_equal(packed[0], _words(case["words"])), case["why"]
        q = np.array(case["nibbles"]) - 8
        assert np.array_equal(_pack_bitstream(q[None]), packed)
        assert np.array_equal(decode_int4(packed, scale)[0], q * _bf16(case["scale"]))


def test_independent_packer_and_decode_agree():
    rng = np.random.default_rng(1)
    q = rng.integers(-8, 8, (6, 96))
    scale_f = np.exp2(rng.uniform(-12, 2, (6, 3))).astype(np.float32)
    scale = (scale_f.view(np.uint32) >> 16).astype(np.uint16)  # truncate to bf16 bits
    packed = _pack_bitstream(q)
    want = q * np.repeat((scale.astype(np.uint32) << 16).view(np.float32), 32, axis=1)
    for dec in (decode_int4, decode_int4_ref):
        assert np.array_equal(dec(packed, scale), want.astype(np.float32))
    # and the scale may come as an ml_dtypes bfloat16 array
    assert np.array_equal(decode_int4(packed, scale.view(ml_dtypes.bfloat16)), want.astype(np.float32))


def test_decode_random_bytes_kernel_equals_reference():
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 2**32, (4, 3, 40), dtype=np.uint64).astype(np.uint32).view(np.int32)
    scale = rng.integers(0, 2**16, (4, 3, 10), dtype=np.uint16)  # NaN / Inf / subnormal bf16 included
    a, b = decode_int4(packed, scale), decode_int4_ref(packed, scale)
    nan = np.isnan(b)
    assert a.shape == (4, 3, 320)
    assert (np.isnan(a) == nan).all() and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))
    # bfloat16: the numba kernel's own rounding == ml_dtypes' rounding of the float32 result
    dst = np.empty((4, 3, 320), ml_dtypes.bfloat16)
    c = decode_int4(packed, scale, out="bfloat16", dst=dst)
    d = decode_int4_ref(packed, scale, out="bfloat16")
    assert c is dst and (np.isnan(c.astype(np.float32)) == nan).all()
    assert np.array_equal(c.view(np.uint16)[~nan], d.view(np.uint16)[~nan])
    assert np.array_equal(d.view(np.uint16)[~nan], a.astype(ml_dtypes.bfloat16).view(np.uint16)[~nan])
    with pytest.raises(ShapeError, match="destination"):
        decode_int4(packed, scale, dst=np.empty((4, 3, 320), np.float64))


def _inputs(kind: str, rng) -> np.ndarray:
    shape = (8, 128)
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    if kind == "gaussian":
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)
    if kind == "bf16":
        return (rng.standard_normal(shape) * 0.02).astype(ml_dtypes.bfloat16).astype(np.float32)
    if kind == "heavy":
        return (rng.standard_t(2, shape) * 10.0 ** rng.uniform(-30, 30, (8, 1))).astype(np.float32)
    # ties: values exactly on half-integers of a power-of-two scale
    x = (rng.integers(-15, 16, shape) * 0.5).astype(np.float32) * np.float32(2.0**-5)
    x[:, ::32] = np.float32(7.5 * 2.0**-5)
    return x


@pytest.mark.parametrize("kind", ["zeros", "gaussian", "bf16", "heavy", "ties"])
def test_encode_kernel_equals_reference(kind):
    x = _inputs(kind, np.random.default_rng(len(kind)))
    a = encode_int4(x)
    b = encode_int4_ref(x)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    pa = FMT.encode(x)
    pb = FMT.reference_encode(x)
    assert all(np.array_equal(pa[r], pb[r]) for r in pa) and list(pa["shape"]) == [8, 128]


@pytest.mark.parametrize("kind", ["gaussian", "bf16", "heavy"])
def test_encode_rule(kind):
    x = _inputs(kind, np.random.default_rng(7))
    packed, scale = encode_int4(x)
    sc = (scale.astype(np.uint32) << 16).view(np.float32)
    amax = np.abs(x.reshape(8, -1, 32)).max(axis=2)
    # scale = bf16(amax / 7.5): within bf16's half ulp of the exact quotient
    assert (np.abs(sc - amax / 7.5) <= np.abs(amax / 7.5) * 2.0**-8 * 1.0001).all()
    y = decode_int4(packed, scale)
    # error <= half a step plus the bf16 rounding of the quotient (at most 8 * 2^-8 steps)
    err = np.abs(y - x).reshape(8, -1, 32).max(axis=2)
    assert (err <= sc * (0.5 + 8 * 2.0**-8) * 1.0001).all()
    q = np.rint(y.reshape(8, -1, 32) / sc[:, :, None])
    assert q.min() >= -8 and q.max() <= 7


def test_weight_shape_part():
    x = (np.random.default_rng(3).standard_normal((2, 5, 64)) * 0.1).astype(np.float32)
    parts = FMT.encode(x)
    assert parts["packed"].shape == (2, 5, 8) and parts["scale"].shape == (2, 5, 2)
    assert parts["shape"].dtype == np.int64 and list(parts["shape"]) == [10, 64]
    ref = FMT.decode(parts)
    i32 = {**parts, "shape": parts["shape"].astype(np.int32)}  # K2.5 may store I32
    assert np.array_equal(FMT.decode(i32), ref)
    with pytest.raises(ShapeError, match=r"weight_shape says \[10, 32\]"):
        FMT.decode({**parts, "shape": np.array([10, 32], np.int64)}, name="w")
    with pytest.raises(ShapeError, match=r"weight_shape says \[9, 64\]"):
        FMT.decode({**parts, "shape": np.array([9, 64], np.int64)}, name="w")
    # a row range decodes with the whole weight's weight_shape (readers work in row chunks)
    flat = {r: (a.reshape(10, -1) if r != "shape" else a) for r, a in parts.items()}
    chunk = FMT.decode({**flat, "packed": flat["packed"][3:7], "scale": flat["scale"][3:7]})
    assert np.array_equal(chunk, ref.reshape(10, 64)[3:7])
    with pytest.raises(UsageError, match="shape"):
        FMT.decode({r: a for r, a in parts.items() if r != "shape"}, name="w")
    with pytest.raises(ShapeError, match="I32"):
        FMT.decode({**parts, "packed": parts["packed"].astype(np.int64)}, name="w")
    names = FMT.tensor_names("model.layers.1.mlp.experts.0.up_proj")
    assert names == {"packed": "model.layers.1.mlp.experts.0.up_proj.weight_packed",
                     "scale": "model.layers.1.mlp.experts.0.up_proj.weight_scale",
                     "shape": "model.layers.1.mlp.experts.0.up_proj.weight_shape"}
    assert FMT.info.fields_text == "2 + 16" and FMT.info.bits_per_weight == 4.5 and FMT.info.tensor_bytes == 16


def test_refuses_non_finite_and_bad_k():
    x = np.ones((2, 64), np.float32)
    x[1, 5] = np.inf
    for enc in (encode_int4, encode_int4_ref):
        with pytest.raises(UsageError, match=r"\[1, 5\]"):
            enc(x, name="w")
    with pytest.raises(ShapeError, match="multiple of 32"):
        FMT.encode(np.ones((2, 48), np.float32))
    with pytest.raises(ShapeError):
        decode_int4(np.zeros((2, 6), np.int32), np.zeros((2, 1), np.uint16))
