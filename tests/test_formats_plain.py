"""Plain dtypes: exhaustive decodes against ml_dtypes / numpy, bf16 rounding."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from k3ckpt.errors import UnsupportedError, UsageError
from k3ckpt.formats import get_format, plain


def u32(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


ALL_U16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
ALL_U8 = np.arange(256, dtype=np.uint16).astype(np.uint8)


@pytest.mark.parametrize("impl", [plain.decode_bf16, plain.decode_bf16_ref], ids=["numba", "numpy"])
def test_bf16_exhaustive(impl):
    got = impl(ALL_U16)
    want = ALL_U16.view(ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert np.array_equal(u32(got), ALL_U16.astype(np.uint32) << 16)  # payloads kept too
    assert np.array_equal(u32(got)[~nan], u32(want)[~nan])


@pytest.mark.parametrize("impl", [plain.decode_f16, plain.decode_f16_ref], ids=["numba", "numpy"])
def test_f16_exhaustive(impl):
    got = impl(ALL_U16)
    with np.errstate(invalid="ignore"):
        want = ALL_U16.view(np.float16).astype(np.float64).astype(np.float32)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert np.array_equal(u32(got)[~nan], u32(want)[~nan])  # subnormals, -0, +-inf


def test_f16_kernel_keeps_nan_payload_like_numpy():
    assert np.array_equal(u32(plain.decode_f16(ALL_U16)), u32(plain.decode_f16_ref(ALL_U16)))


@pytest.mark.parametrize("impl", [plain.decode_fp8_e4m3, plain.decode_fp8_e4m3_ref], ids=["numba", "numpy"])
def test_fp8_e4m3_exhaustive(impl):
    got = impl(ALL_U8)
    want = ALL_U8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    nan = np.isnan(want)
    assert nan.sum() == 2 and nan[0x7F] and nan[0xFF]  # fn: no Inf, two NaNs
    assert (np.isnan(got) == nan).all()
    assert np.array_equal(u32(got)[~nan], u32(want)[~nan])
    assert got[0x7E] == 448.0 and got[0x01] == 2.0**-9 and np.signbit(got[0x80])


def test_to_bfloat16_rounding():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    special = np.array(
        [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x80018000,
         0x7F800000, 0xFF800000, 0x7FC00001, 0xFF800001, 0x00000000, 0x80000000],
        np.uint32,
    ).view(np.float32)
    x = np.concatenate([x, special])
    a = plain.to_bfloat16(x)
    b = plain.to_bfloat16_ref(x)
    assert a.dtype == b.dtype == ml_dtypes.bfloat16
    nan = np.isnan(x)
    assert np.isnan(a[nan].astype(np.float32)).all() and np.isnan(b[nan].astype(np.float32)).all()
    assert np.array_equal(a.view(np.uint16)[~nan], b.view(np.uint16)[~nan])
    # ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 and goes to 1
    assert plain.to_bfloat16_ref(np.array([1 + 2.0**-8], np.float32)).view(np.uint16)[0] == 0x3F80
    assert plain.to_bfloat16_ref(np.array([1 + 3 * 2.0**-8], np.float32)).view(np.uint16)[0] == 0x3F82


@pytest.mark.parametrize("fid", ["bf16", "f16", "f32"])
def test_plain_encode_kernel_equals_reference(fid):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 33)) * 10.0 ** rng.uniform(-6, 4, (8, 1))).astype(np.float32)
    x[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    fmt = get_format(fid)
    a = fmt.encode(x)["weight"]
    b = fmt.reference_encode(x)["weight"]
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    dec = fmt.decode({"weight": a})
    assert np.isnan(dec[0, 0]) and dec[0, 1] == np.inf and dec[0, 2] == -np.inf and np.signbit(dec[0, 3])


@pytest.mark.parametrize("fid,big", [("f16", 70000.0), ("bf16", 3.4028235e38)])
def test_plain_encode_refuses_overflow(fid, big):
    x = np.ones((2, 4), np.float32)
    x[1, 2] = big
    fmt = get_format(fid)
    for enc in (fmt.encode, fmt.reference_encode):
        with pytest.raises(UsageError, match="overflows"):
            enc(x, name="norm.weight")


def test_fp8_is_decode_only():
    fmt = get_format("fp8-e4m3")
    with pytest.raises(UnsupportedError):
        fmt.encode(np.ones((1, 4), np.float32))
    b = np.array([[0x38, 0xB8, 0x7E, 0x00]], np.uint8)
    assert fmt.decode({"weight": b}).tolist() == [[1.0, -1.0, 448.0, 0.0]]
    # ml_dtypes value arrays are accepted and viewed, not converted
    v = b.view(ml_dtypes.float8_e4m3fn)
    assert fmt.decode({"weight": v}).tolist() == [[1.0, -1.0, 448.0, 0.0]]


def test_bf16_output_options():
    x = np.array([[1.0, 1 + 2.0**-8, 3.0, -2.5]], np.float32)
    f32 = get_format("f32")
    out = f32.decode(f32.encode(x), out="bfloat16")
    assert out.dtype == ml_dtypes.bfloat16
    assert out.view(np.uint16).tolist() == [[0x3F80, 0x3F80, 0x4040, 0xC020]]
    bf = get_format("bf16")
    parts = bf.encode(x)
    assert np.array_equal(bf.decode(parts, out="bfloat16").view(np.uint16), parts["weight"])
    assert bf.info.bf16_exact and not f32.info.bf16_exact
