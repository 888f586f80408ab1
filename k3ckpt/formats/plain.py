"""Plain element-wise dtypes: ``bf16``, ``f16``, ``f32`` and ``fp8-e4m3``.

Each decodes to float32 exactly (all four are subsets of float32).  Parts hold
the dtype table's storage dtype (``uint16`` bits for BF16, ``float16`` for F16,
``float32``, ``uint8`` bytes for F8_E4M3); ml_dtypes ``bfloat16`` and
``float8_e4m3fn`` arrays are accepted and viewed.  F8_E4M3 means torch ``float8_e4m3fn``: no Inf, NaN is
``0x7F``/``0xFF``, max 448.  It is decode-only here: converting to FP8 is not
invertible and a checkpoint's FP8 bytes should be kept, not re-made.

Encoding rounds float32 to nearest even.  A finite input that overflows the
target (|x| beyond 65504 for f16, beyond bfloat16's max for bf16) raises
``UsageError`` instead of becoming Inf; NaN and Inf inputs are stored as such.
"""

from __future__ import annotations

import functools
import types

import numpy as np

from ..errors import UsageError
from .base import Format, FormatInfo, Part
from . import ids

__all__ = [
    "PlainFormat",
    "decode_bf16",
    "decode_bf16_ref",
    "decode_f16",
    "decode_f16_ref",
    "decode_fp8_e4m3",
    "decode_fp8_e4m3_ref",
    "to_bfloat16",
    "to_bfloat16_ref",
    "FP8_E4M3_F32",
]


# --------------------------------------------------------------------------- kernels
def _bf16_kernel(src, out):
    # bfloat16 is the high half of a float32
    ob = out.view(np.uint32)
    for i in range(src.shape[0]):
        ob[i] = np.uint32(src[i]) << np.uint32(16)


def _f16_kernel(src, out):
    # IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
    ob = out.view(np.uint32)
    for i in range(src.shape[0]):
        h = np.uint32(src[i])
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        e = (h >> np.uint32(10)) & np.uint32(0x1F)
        m = h & np.uint32(0x3FF)
        if e == 0:
            # zero or subnormal: m * 2^-24, exact in float32; then the sign bit
            out[i] = np.float32(m) * np.float32(5.9604644775390625e-08)
            ob[i] |= sign
        elif e == 31:
            ob[i] = sign | np.uint32(0x7F800000) | (m << np.uint32(13))
        else:
            ob[i] = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))


def _lut_kernel(src, lut, out):
    for i in range(src.shape[0]):
        out[i] = lut[src[i]]


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(bf16=njit(_bf16_kernel), f16=njit(_f16_kernel), lut=njit(_lut_kernel))


def _fp8_e4m3_table() -> np.ndarray:
    # From the definition: sign, 4-bit exponent (bias 7), 3-bit mantissa;
    # exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN; no Inf.
    vals = np.empty(256, np.float32)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
        if b & 0x7F == 0x7F:
            v = float("nan")
        elif e == 0:
            v = m / 8 * 2.0**-6
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        vals[b] = -v if s else v
    vals.flags.writeable = False
    return vals


FP8_E4M3_F32 = _fp8_e4m3_table()
"""F8_E4M3 (fn) byte -> float32 value."""


# ------------------------------------------------------------------ element codecs
def _flat(a, dtype) -> np.ndarray:
    return np.ascontiguousarray(a).view(dtype).reshape(-1)


def decode_bf16(bits: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16, any shape) -> float32 (numba)."""
    bits = np.asarray(bits)
    out = np.empty(bits.shape, np.float32)
    _kernels().bf16(_flat(bits, np.uint16), out.reshape(-1))
    return out


def decode_bf16_ref(bits: np.ndarray) -> np.ndarray:
    """BF16 bits -> float32: ``(u16 as u32) << 16`` viewed as float32."""
    bits = np.asarray(bits).view(np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def decode_f16(bits: np.ndarray) -> np.ndarray:
    """F16 bits (uint16, any shape) -> float32 (numba, from the bit fields)."""
    bits = np.asarray(bits)
    out = np.empty(bits.shape, np.float32)
    _kernels().f16(_flat(bits, np.uint16), out.reshape(-1))
    return out


def decode_f16_ref(bits: np.ndarray) -> np.ndarray:
    """F16 bits -> float32 through numpy's float16 conversion."""
    return np.asarray(bits).view(np.float16).astype(np.float32)


def decode_fp8_e4m3(bits: np.ndarray) -> np.ndarray:
    """F8_E4M3 (fn) bytes (uint8, any shape) -> float32 (numba, 256-entry table)."""
    bits = np.asarray(bits)
    out = np.empty(bits.shape, np.float32)
    _kernels().lut(_flat(bits, np.uint8), FP8_E4M3_F32, out.reshape(-1))
    return out


def decode_fp8_e4m3_ref(bits: np.ndarray) -> np.ndarray:
    """F8_E4M3 (fn) bytes -> float32, vectorised from the bit fields."""
    b = np.asarray(bits).view(np.uint8).astype(np.int64)
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, np.ldexp(m / 8.0, -6), np.ldexp(1.0 + m / 8.0, e - 7))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(s == 1, -mag, mag).astype(np.float32)


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> ml_dtypes bfloat16, round to nearest even (NaN stays NaN)."""
    import ml_dtypes

    with np.errstate(invalid="ignore"):  # NaN converts to NaN; numpy warns needlessly
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def to_bfloat16_ref(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 by integer RNE on the bits: add 0x7FFF plus the kept
    LSB, drop the low half; NaN is kept quiet."""
    import ml_dtypes

    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    quiet = ((u >> 16) | 0x40).astype(np.uint16)
    return np.where(nan, quiet, rounded).view(ml_dtypes.bfloat16)


# --------------------------------------------------------------------------- formats
def _overflow_check(x: np.ndarray, y: np.ndarray, what: str, name: str | None) -> None:
    over = np.isfinite(x) & ~np.isfinite(y)
    if over.any():
        flat = int(np.argmax(over.reshape(-1)))
        raise UsageError(f"value {x.reshape(-1)[flat]} (flat index {flat}) overflows {what}", tensor=name)


class PlainFormat(Format):
    """Family base: one stored tensor ``weight`` with one element per value."""

    def _decode_rows(self, rows, k, *, reference, bf16):
        raise NotImplementedError

    def _encode_rows(self, x, *, reference, name, shape):
        raise NotImplementedError


def _plain_info(fid: str, dtype: str, nbytes: int, title: str, *, encode: bool, bf16_exact: bool,
                declared_as: tuple[str, ...] = ()) -> FormatInfo:
    # the float dtypes GGUF stores as they are (ggml F32 / F16 / BF16); plain's dtype strings are theirs
    return FormatInfo(
        id=fid,
        title=title,
        block=1,
        fields=((fid, nbytes),),
        parts=(Part("weight", "", dtype, (1,)),),
        can_encode=encode,
        can_decode=True,
        bf16_exact=bf16_exact,
        spec="docs/formats/README.md#plain-dtypes",
        declared_as=declared_as,
        ggml_type=dtype if dtype in ("F32", "F16", "BF16") else None,
    )


class BF16(PlainFormat):
    info = _plain_info(ids.BF16, "BF16", 2, "bfloat16", encode=True, bf16_exact=True)

    def _decode_rows(self, rows, k, *, reference, bf16):
        w = rows["weight"]
        if bf16:
            import ml_dtypes

            return w.view(ml_dtypes.bfloat16).copy()
        return decode_bf16_ref(w) if reference else decode_bf16(w)

    def _encode_rows(self, x, *, reference, name, shape):
        y = to_bfloat16_ref(x) if reference else to_bfloat16(x)
        _overflow_check(x, y, "bfloat16", name)
        return {"weight": y.view(np.uint16)}


class F16(PlainFormat):
    info = _plain_info(ids.F16, "F16", 2, "IEEE float16", encode=True, bf16_exact=False)

    def _decode_rows(self, rows, k, *, reference, bf16):
        w = rows["weight"]
        return decode_f16_ref(w) if reference else decode_f16(w)

    def _encode_rows(self, x, *, reference, name, shape):
        # The reference widens to float64 first: one rounding either way, by a
        # different numpy conversion routine.
        with np.errstate(over="ignore"):
            y = x.astype(np.float64).astype(np.float16) if reference else x.astype(np.float16)
        _overflow_check(x, y, "float16", name)
        return {"weight": y}


class F32(PlainFormat):
    info = _plain_info(ids.F32, "F32", 4, "IEEE float32", encode=True, bf16_exact=False)

    def _decode_rows(self, rows, k, *, reference, bf16):
        return rows["weight"].copy()

    def _encode_rows(self, x, *, reference, name, shape):
        return {"weight": x.copy()}


class FP8E4M3(PlainFormat):
    info = _plain_info(ids.FP8_E4M3, "F8_E4M3", 1, "float8 e4m3fn (decode only)", encode=False, bf16_exact=True,
                       declared_as=("compressed-tensors/float-quantized", "fp8"))   # per-tensor FP8

    def _decode_rows(self, rows, k, *, reference, bf16):
        w = rows["weight"]
        return decode_fp8_e4m3_ref(w) if reference else decode_fp8_e4m3(w)
