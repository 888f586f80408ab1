"""MXFP4 pair-layout codecs: kernels vs numpy references vs ml_dtypes as an oracle.

ml_dtypes ``float4_e2m1fn`` (RNE, saturating) and ``float8_e8m0fnu`` are an
implementation independent of ours; golden blocks come from published vectors
(tests/golden/mxfp4_vectors.json).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from k3ckpt.errors import NaNScaleError, ShapeError, UsageError
from k3ckpt.formats import count_nan_scales, get_format
from k3ckpt.formats import mxfp4
from k3ckpt.formats.e2m1 import E2M1_VALUES, E8M0_F32, e8m0_to_float32

GOLDEN = json.loads((Path(__file__).parent / "golden" / "mxfp4_vectors.json").read_text())


# ----------------------------------------------------------------------------- oracles
def oracle_decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """ml_dtypes: float4_e2m1fn(code) * float8_e8m0fnu(byte) in float64, one cast to float32."""
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sc = scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return (vals * np.repeat(sc, 32, axis=-1)).astype(np.float32)


def oracle_encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP FLOOR via log2 and ml_dtypes' RNE/saturating float4 cast (x: [M, K] float32)."""
    b = x.astype(np.float64).reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127)
    e = np.clip(e, -127, 127).astype(np.int64)
    y = b / np.exp2(e)[..., None].astype(np.float64)
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(x.shape) & 0xF
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, (e + 127).astype(np.uint8)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


# ----------------------------------------------------------------------------- data
def gaussian(rng, m, k):
    return (rng.standard_normal((m, k)) * 0.02).astype(np.float32)


def student_t(rng, m, k):
    return (rng.standard_t(3, (m, k)) * 0.01).astype(np.float32)


def heavy_rows(rng, m, k):
    # heavy tails and per-row scales from 1e-42 (subnormal) to 1e30, clipped to stay finite
    x = rng.standard_t(2, (m, k)) * 10.0 ** rng.uniform(-42, 30, (m, 1))
    return np.clip(x, -3e38, 3e38).astype(np.float32)


def ties(rng, m, k):
    # exact decision points (and grid points) times a power of two per block, both signs
    pts = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2, 3, 4, 6, 7.0, 0.0])
    x = rng.choice(pts, (m, k)) * rng.choice([-1.0, 1.0], (m, k))
    x = x.reshape(m, k // 32, 32)
    x[:, :, 0] = 6.0  # pin amax so the FLOOR scale is the block's power of two
    x *= np.exp2(rng.integers(-126, 120, (m, k // 32, 1)))
    return x.reshape(m, k).astype(np.float32)


DATA = {"gaussian": gaussian, "student_t": student_t, "heavy_rows": heavy_rows, "ties": ties}


# ----------------------------------------------------------------------------- decode
def all_bytes_all_scales():
    """packed [256, 512]: row s has scale byte s everywhere and every packed byte twice."""
    packed = np.tile(np.arange(256, dtype=np.uint8), (256, 2))
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 32, axis=1)
    return packed, scale


def test_tables_match_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert same_bits(E2M1_VALUES, want)  # includes -0 at code 8
    assert np.signbit(E2M1_VALUES[8]) and E2M1_VALUES[8] == 0
    b = np.arange(256, dtype=np.uint8)
    want = b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert np.array_equal(E8M0_F32[:255], want[:255])
    assert same_bits(E8M0_F32[:255], want[:255])
    assert np.isnan(E8M0_F32[255]) and np.isnan(want[255])
    assert E8M0_F32[0] == np.float32(2.0**-127) and E8M0_F32[254] == np.float32(2.0**127)
    assert same_bits(e8m0_to_float32(b), E8M0_F32)


@pytest.mark.parametrize("impl", [mxfp4.decode_pair, mxfp4.decode_pair_ref], ids=["numba", "numpy"])
def test_decode_exhaustive_against_ml_dtypes(impl):
    packed, scale = all_bytes_all_scales()
    got = impl(packed, scale)
    want = oracle_decode(packed, scale)
    finite = scale[:, 0] != 0xFF
    assert same_bits(got[finite], want[finite])
    assert np.isnan(got[~finite]).all()  # 0xFF poisons every element, zero codes included
    # the subnormal corner: byte 0 scale is 2^-127, so code 1 gives 2^-128 exactly
    assert got[0, 34] == np.float32(2.0**-128) and got[0, 35] == np.float32(2.0**-128)  # byte 0x11
    # overflow only where the exact value exceeds float32 (bytes 0xFD, 0xFE with large codes)
    over = np.isinf(got[finite])
    rows = np.nonzero(over.any(axis=1))[0]
    assert set(rows.tolist()) == {0xFD, 0xFE}


@pytest.mark.parametrize("impl", [mxfp4.decode_pair, mxfp4.decode_pair_ref], ids=["numba", "numpy"])
def test_decode_bf16_is_exact(impl):
    packed, scale = all_bytes_all_scales()
    f32 = impl(packed, scale)
    b16 = impl(packed, scale, out="bfloat16")
    assert b16.dtype == ml_dtypes.bfloat16
    # exact: widening back gives the float32 values bit for bit (NaN rows excepted)
    finite = scale[:, 0] != 0xFF
    assert same_bits(b16[finite].astype(np.float32), f32[finite])
    assert np.isnan(b16[~finite].astype(np.float32)).all()


def test_decode_random_bytes_kernel_equals_reference():
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (5, 3, 64), dtype=np.uint8)
    scale = rng.integers(0, 256, (5, 3, 4), dtype=np.uint8)
    a = mxfp4.decode_pair(packed, scale)
    b = mxfp4.decode_pair_ref(packed, scale)
    assert a.shape == (5, 3, 128)
    nan = np.repeat(scale == 0xFF, 32, axis=-1)
    assert np.isnan(a[nan]).all() and np.isnan(b[nan]).all()
    assert same_bits(a[~nan], b[~nan])
    assert same_bits(a[~nan], oracle_decode(packed, scale)[~nan])


def test_decode_into_dst_and_bad_dst():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (4, 32), dtype=np.uint8)
    scale = rng.integers(100, 140, (4, 2), dtype=np.uint8)
    dst = np.full((4, 64), 7.0, np.float32)
    res = mxfp4.decode_pair(packed, scale, dst=dst)
    assert res is dst and same_bits(dst, mxfp4.decode_pair_ref(packed, scale))
    with pytest.raises(ShapeError):
        mxfp4.decode_pair(packed, scale, dst=np.empty((4, 63), np.float32))
    with pytest.raises(ShapeError):
        mxfp4.decode_pair(packed, scale, dst=np.empty((64, 4), np.float32).T)


def test_decode_shape_errors_name_the_tensor():
    p = np.zeros((2, 16), np.uint8)
    with pytest.raises(ShapeError, match="w1"):
        mxfp4.decode_pair(p, np.zeros((2, 2), np.uint8), name="w1")
    with pytest.raises(ShapeError, match="uint8"):
        mxfp4.decode_pair(p.astype(np.int8), np.zeros((2, 1), np.uint8))
    with pytest.raises(UsageError):
        mxfp4.decode_pair(p, np.zeros((2, 1), np.uint8), out=np.float16)


def test_count_nan_scales():
    s = np.array([[0, 0xFF, 0x7F], [0xFF, 0xFE, 0xFF]], np.uint8)
    assert count_nan_scales(s) == 3
    assert count_nan_scales(np.zeros(0, np.uint8)) == 0
    with pytest.raises(ShapeError):
        count_nan_scales(s.astype(np.int16))


# ----------------------------------------------------------------------------- encode
@pytest.mark.parametrize("kind", sorted(DATA))
def test_encode_kernel_equals_reference_and_oracle(kind):
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    x = DATA[kind](rng, 24, 256)
    p1, s1 = mxfp4.encode_pair(x)
    p2, s2 = mxfp4.encode_pair_ref(x)
    p3, s3 = oracle_encode(x)
    assert np.array_equal(s1, s2) and np.array_equal(p1, p2)
    assert np.array_equal(s1, s3) and np.array_equal(p1, p3)
    # re-encoding the decoded values with the same scales is the identity
    assert np.array_equal(mxfp4.encode_with_scales(mxfp4.decode_pair(p1, s1), s1), p1)


def test_encode_every_e2m1_magnitude_and_sign():
    # one block per scale exponent, holding every code value at that scale
    exps = np.arange(-127, 126)
    vals = E2M1_VALUES.astype(np.float64)
    x = np.zeros((len(exps), 32))
    x[:, :16] = vals * np.exp2(exps)[:, None]
    x[:, 16] = 6 * np.exp2(exps)  # pins the FLOOR scale for every row
    x = x.astype(np.float32)
    packed, scale = mxfp4.encode_pair(x)
    want_scale = np.clip(exps, -127, 127) + 127
    assert np.array_equal(scale[:, 0], want_scale.astype(np.uint8))
    codes = np.empty((len(exps), 32), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4
    assert np.array_equal(codes[:, :16], np.tile(np.arange(16, dtype=np.uint8), (len(exps), 1)))


def test_encode_saturates_and_keeps_sign_of_zero():
    x = np.zeros((1, 32), np.float32)
    # scale pinned to 2^0 by 4.0; 7.99 and 100x are out of range only after scaling
    x[0, :8] = [4.0, 7.99, -7.99, -0.0, -0.2, 0.2, -1e-30, 5.0000005]
    packed, scale = mxfp4.encode_pair(x)
    assert scale[0, 0] == 0x7F
    codes = np.empty(32, np.uint8)
    codes[0::2], codes[1::2] = packed[0] & 0xF, packed[0] >> 4
    assert codes[:8].tolist() == [6, 7, 15, 8, 8, 0, 8, 7]


def test_scale_rule_floor_clamp_and_zero():
    x = np.zeros((6, 32), np.float32)
    x[0, 0] = 1.0                   # floor(log2 1) - 2 = -2 -> byte 125
    x[1, 0] = np.nextafter(np.float32(1.0), np.float32(0))  # just below 1 -> 124
    x[2, 0] = np.float32(2.0**-126)  # smallest normal: -128 clamps to byte 0
    x[3, 0] = np.float32(1e-45)      # smallest subnormal: byte 0
    x[4, 0] = np.finfo(np.float32).max  # 127 - 2 -> byte 252
    # row 5 all zero -> byte 0
    _, scale = mxfp4.encode_pair(x)
    assert scale[:, 0].tolist() == [125, 124, 0, 0, 252, 0]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("impl", [mxfp4.encode_pair, mxfp4.encode_pair_ref], ids=["numba", "numpy"])
def test_encode_refuses_non_finite(impl, bad):
    x = np.ones((3, 64), np.float32)
    x[2, 37] = bad
    with pytest.raises(UsageError, match=r"\[2, 37\]") as err:
        impl(x, name="blk.7")
    assert "blk.7" in str(err.value)


@pytest.mark.parametrize("impl", [mxfp4.encode_with_scales, mxfp4.encode_with_scales_ref], ids=["numba", "numpy"])
def test_encode_with_scales_errors(impl):
    x = np.ones((2, 64), np.float32)
    s = np.full((2, 2), 0x7F, np.uint8)
    s[1, 1] = 0xFF
    with pytest.raises(NaNScaleError, match=r"\[1, 1\]"):
        impl(x, s)
    with pytest.raises(ShapeError):
        impl(x, s[:, :1])
    x[0, 3] = np.inf
    with pytest.raises(UsageError):
        impl(x, np.full((2, 2), 0x7F, np.uint8))


@pytest.mark.parametrize("impl", [mxfp4.encode_with_scales, mxfp4.encode_with_scales_ref], ids=["numba", "numpy"])
def test_encode_with_scales_exhaustive_round_trip(impl):
    # every packed byte under every scale byte whose decoded values are finite
    packed, scale = all_bytes_all_scales()
    dec = mxfp4.decode_pair(packed, scale)
    finite_rows = np.isfinite(dec).all(axis=1)
    assert finite_rows.sum() == 256 - 3  # 0xFD and 0xFE overflow for big codes; 0xFF is NaN
    got = impl(dec[finite_rows], scale[finite_rows])
    assert np.array_equal(got, packed[finite_rows])
    # under the two overflowing scale bytes, the codes whose values stay finite round-trip
    for s, top in ((0xFD, 5), (0xFE, 3)):
        ok = np.array([c for c in range(16) if c & 7 <= top], np.uint8)
        pk = (ok[:, None] | (ok[None, :] << 4)).reshape(1, -1)[:, : 16 * (len(ok) ** 2 // 16)]
        sc = np.full((1, pk.shape[1] // 16), s, np.uint8)
        dq = mxfp4.decode_pair(pk, sc)
        assert np.isfinite(dq).all() and np.abs(dq).max() == (3 * 2.0**126 if s == 0xFD else 1.5 * 2.0**127)
        assert np.array_equal(impl(dq, sc), pk)


def test_round_trip_random_bytes_real_expert_shape():
    # one K3 w1 tensor: packed [3072, 1792], scale [3072, 112], real-looking scales
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (3072, 1792), dtype=np.uint8)
    scale = rng.integers(0x70, 0x7B, (3072, 112), dtype=np.uint8)
    dec = mxfp4.decode_pair(packed, scale)
    assert np.array_equal(mxfp4.encode_with_scales(dec, scale), packed)
    rows = slice(0, 64)
    assert same_bits(dec[rows], mxfp4.decode_pair_ref(packed[rows], scale[rows]))


def test_floor_encode_reproduces_scales_where_representable():
    # a stored block whose largest code is +-4 or +-6 (FLOOR's range [4, 8)) is
    # exactly what FLOOR encoding of its decoded values produces again
    rng = np.random.default_rng(11)
    codes = rng.integers(0, 16, (64, 256), dtype=np.uint8)
    codes[32:] &= 0b1011  # second half: magnitudes below 4 only, so FLOOR picks smaller scales
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale = rng.integers(0, 0xFD, (64, 8), dtype=np.uint8)
    top = (codes & 7).reshape(64, 8, 32).max(axis=-1)
    dec = mxfp4.decode_pair(packed, scale)
    p2, s2 = mxfp4.encode_pair(dec)
    keep = top >= 6
    assert keep[:32].all() and not keep[32:].any()
    assert np.array_equal(s2[keep], scale[keep])
    assert np.array_equal(p2.reshape(64, 8, 16)[keep], packed.reshape(64, 8, 16)[keep])
    # elsewhere FLOOR picks a smaller scale (or byte 0), never a larger one, and
    # the values it gives are still exactly the stored ones when nothing underflows
    assert (s2[~keep] <= scale[~keep]).all() and (s2[~keep] < scale[~keep]).mean() > 0.9
    big = (scale >= 8) & ~keep
    dec2 = mxfp4.decode_pair(p2, s2).reshape(64, 8, 32)
    assert same_bits(dec2[big], dec.reshape(64, 8, 32)[big])


def test_encode_accepts_bf16_and_float64():
    rng = np.random.default_rng(5)
    x = gaussian(rng, 4, 64)
    xb = x.astype(ml_dtypes.bfloat16)
    a = mxfp4.encode_pair(xb)
    b = mxfp4.encode_pair(xb.astype(np.float32))
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    c = mxfp4.encode_pair(x.astype(np.float64))
    d = mxfp4.encode_pair(x)
    assert all(np.array_equal(u, v) for u, v in zip(c, d))
    with pytest.raises(ShapeError):
        mxfp4.encode_pair(np.ones((2, 32), np.int32))
    with pytest.raises(ShapeError):
        mxfp4.encode_pair(np.ones((2, 48), np.float32))


def test_empty_and_leading_dims():
    for shape in [(0, 64), (3, 0), (2, 3, 64)]:
        x = np.ones(shape, np.float32)
        p, s = mxfp4.encode_pair(x)
        assert p.shape == shape[:-1] + (shape[-1] // 2,) and s.shape == shape[:-1] + (shape[-1] // 32,)
        pr, sr = mxfp4.encode_pair_ref(x)
        assert np.array_equal(p, pr) and np.array_equal(s, sr)
        assert mxfp4.decode_pair(p, s).shape == shape
        assert mxfp4.decode_pair_ref(p, s).shape == shape


# ----------------------------------------------------------------------------- golden
@pytest.mark.parametrize("vec", GOLDEN["vectors"], ids=lambda v: v["name"])
def test_golden_pair_layout(vec):
    x = np.array(vec["input"] + [0.0] * vec["zeros_after"], np.float32)[None]
    want_p = bytes.fromhex(vec["layouts"]["mxfp4-pack-quantized"]["packed"])
    want_s = bytes.fromhex(vec["scale"])
    for enc in (mxfp4.encode_pair, mxfp4.encode_pair_ref, oracle_encode):
        p, s = enc(x)
        assert p.tobytes() == want_p and s.tobytes() == want_s, enc
    codes = np.array(vec["codes"], np.uint8)
    want_values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64) * 2.0 ** (want_s[0] - 127)
    p = np.frombuffer(want_p, np.uint8)[None]
    s = np.frombuffer(want_s, np.uint8)[None]
    assert same_bits(mxfp4.decode_pair(p, s)[0], want_values.astype(np.float32))


# ----------------------------------------------------------------------------- properties
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
blocks_strategy = st.integers(1, 4).flatmap(
    lambda nb: hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.just(32 * nb)), elements=finite_f32)
)


@settings(max_examples=60, deadline=None)
@given(blocks_strategy)
def test_property_encode_agrees_and_is_idempotent(x):
    p1, s1 = mxfp4.encode_pair(x)
    p2, s2 = mxfp4.encode_pair_ref(x)
    p3, s3 = oracle_encode(x)
    assert np.array_equal(p1, p2) and np.array_equal(s1, s2)
    assert np.array_equal(p1, p3) and np.array_equal(s1, s3)
    dq = mxfp4.decode_pair(p1, s1)
    assert np.isfinite(dq).all()
    # quantised once, stays put; the error per element is at most the grid spacing
    assert np.array_equal(mxfp4.encode_with_scales(dq, s1), p1)
    step = np.repeat(E8M0_F32[s1].astype(np.float64), 32, axis=-1)
    assert (np.abs(dq.astype(np.float64) - x) <= 2 * step + np.maximum(np.abs(x) - 6 * step, 0)).all()


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(np.uint8, st.tuples(st.integers(1, 3), st.sampled_from([16, 32, 64]))),
    st.data(),
)
def test_property_decode_agrees(packed, data):
    scale = data.draw(hnp.arrays(np.uint8, (packed.shape[0], packed.shape[1] // 16)))
    a = mxfp4.decode_pair(packed, scale)
    b = mxfp4.decode_pair_ref(packed, scale)
    c = oracle_decode(packed, scale)
    nan = np.isnan(c)
    assert (np.isnan(a) == nan).all() and (np.isnan(b) == nan).all()
    assert same_bits(a[~nan], b[~nan]) and same_bits(a[~nan], c[~nan])


def test_registry_format_uses_pair_kernels():
    fmt = get_format("mxfp4-pack-quantized")
    rng = np.random.default_rng(2)
    x = student_t(rng, 8, 96)
    parts = fmt.encode(x)
    p, s = mxfp4.encode_pair(x)
    assert np.array_equal(parts["packed"], p) and np.array_equal(parts["scale"], s)
    again = fmt.encode_with_scales(fmt.decode(parts), fmt.scales_of(parts))
    assert all(np.array_equal(again[k], parts[k]) for k in parts)
    assert np.array_equal(fmt.reference_encode_with_scales(fmt.decode(parts), s)["packed"], p)
