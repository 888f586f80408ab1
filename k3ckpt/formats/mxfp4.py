"""MXFP4 in the compressed-tensors pair layout (``mxfp4-pack-quantized``, Kimi K3).

Stored per weight ``[..., K]``: ``weight_packed`` U8 ``[..., K/2]`` where byte i
holds element 2i in its low nibble and element 2i+1 in its high nibble, and
``weight_scale`` U8 ``[..., K/32]`` of E8M0 bytes (docs/formats/mxfp4.md).

Each operation exists twice with the same signature: a numba kernel (one
thread) and a plain-numpy reference (``*_ref``) written from the definition.
Tests hold them bit-identical.

Encoding follows OCP MX v1.0 sec 6.3 (torchao ``ScaleCalculationMode.FLOOR``):
scale byte = clamp(floor(log2 amax) - 2, -127, 127) + 127 (an all-zero block
gets 0), elements round to nearest even on the E2M1 grid and saturate at +-6,
and the sign survives rounding to zero (-0 is code 0x8).  NaN or Inf input is
refused with ``UsageError``: MXFP4 has no Inf, and a NaN would need scale 0xFF,
which erases the other 31 values of its block.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np

from ..errors import NaNScaleError, ShapeError, UsageError
from .base import Format, FormatInfo, Part, as_float32_input, output_dtype
from . import ids
from .e2m1 import (
    BLOCK,
    E8M0_BIAS,
    E8M0_F32,
    E8M0_NAN,
    NIBBLE_HI_F32,
    NIBBLE_LO_F32,
    count_nan_scales,
)

__all__ = [
    "PackQuantized",
    "MXFP4Format",
    "count_nan_scales",
    "decode_pair",
    "decode_pair_ref",
    "encode_pair",
    "encode_pair_ref",
    "encode_with_scales",
    "encode_with_scales_ref",
]

_REF_CHUNK_BLOCKS = 1 << 14  # the numpy reference works on this many blocks at a time


# --------------------------------------------------------------------------- kernels
# Plain Python bodies that numba compiles on first use (``_kernels``), so that
# importing this module does not import numba.  They take C-contiguous 2-D rows.


def _decode_pair_f32_kernel(packed, scale, lo, hi, sc, out):
    # packed [M, K/2] u8, scale [M, K/32] u8, out [M, K] f32.  Each value is one
    # exact float32 product: table value (<= 2 significant bits) times a power of two.
    m = packed.shape[0]
    nb = scale.shape[1]
    for r in range(m):
        prow = packed[r]
        srow = scale[r]
        orow = out[r]
        for g in range(nb):
            s = sc[srow[g]]
            p0 = g * 16
            o0 = g * 32
            for j in range(16):
                b = prow[p0 + j]
                orow[o0 + 2 * j] = lo[b] * s
                orow[o0 + 2 * j + 1] = hi[b] * s


def _decode_pair_bf16_kernel(packed, scale, lo, hi, sc, out):
    # As above into a float32 row buffer, then keep the high half of each word:
    # every MXFP4 value (and Inf/NaN) has zero low 16 bits, so this is exact.
    m = packed.shape[0]
    nb = scale.shape[1]
    k = out.shape[1]
    buf = np.empty(k, np.float32)
    bits = buf.view(np.uint32)
    for r in range(m):
        prow = packed[r]
        srow = scale[r]
        for g in range(nb):
            s = sc[srow[g]]
            p0 = g * 16
            o0 = g * 32
            for j in range(16):
                b = prow[p0 + j]
                buf[o0 + 2 * j] = lo[b] * s
                buf[o0 + 2 * j + 1] = hi[b] * s
        orow = out[r]
        for i in range(k):
            orow[i] = np.uint16(bits[i] >> np.uint32(16))


def _encode_pair_kernel(x, pow2, packed, scale):
    # x [M, K] f32 -> packed [M, K/2], scale [M, K/32].  Returns -1, or the flat
    # index of the first non-finite element (outputs are then incomplete).
    # Scale: floor(log2 amax) is the biased exponent field of amax minus 127, so
    # the byte is max(E - 2, 0); subnormal amax has E = 0 and clamps to byte 0.
    # Elements: RNE on the grid by comparing |x| with the decision points times
    # the scale (exact float32 products), no division or log per element.
    m, k = x.shape
    nb = k // 32
    xb = x.view(np.uint32)
    codes = np.empty(32, np.uint32)
    for r in range(m):
        xbr = xb[r]
        xr = x[r]
        pr = packed[r]
        sr = scale[r]
        for g in range(nb):
            o = g * 32
            amax = np.uint32(0)
            for j in range(32):
                a = xbr[o + j] & np.uint32(0x7FFFFFFF)
                amax = max(amax, a)
            if amax >= np.uint32(0x7F800000):
                for j in range(32):
                    if (xbr[o + j] & np.uint32(0x7FFFFFFF)) >= np.uint32(0x7F800000):
                        return r * k + o + j
            e = np.int32(amax >> np.uint32(23)) - 2
            if e < 0:
                e = 0
            sr[g] = np.uint8(e)
            t = pow2[e]
            t0 = np.float32(0.25) * t
            t1 = np.float32(0.75) * t
            t2 = np.float32(1.25) * t
            t3 = np.float32(1.75) * t
            t4 = np.float32(2.5) * t
            t5 = np.float32(3.5) * t
            t6 = np.float32(5.0) * t
            for j in range(32):
                a = abs(xr[o + j])
                q = (
                    np.uint32(a > t0) + np.uint32(a >= t1) + np.uint32(a > t2) + np.uint32(a >= t3)
                    + np.uint32(a > t4) + np.uint32(a >= t5) + np.uint32(a > t6)
                )
                codes[j] = q | ((xbr[o + j] >> np.uint32(28)) & np.uint32(8))
            p0 = g * 16
            for j in range(16):
                pr[p0 + j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << np.uint32(4)))
    return -1


def _encode_with_scales_kernel(x, scale, pow2, packed):
    # As _encode_pair_kernel with the scale bytes given (none may be 0xFF).  A
    # decision point above float32 range becomes Inf, which no finite |x| passes.
    m, k = x.shape
    nb = k // 32
    xb = x.view(np.uint32)
    codes = np.empty(32, np.uint32)
    for r in range(m):
        xbr = xb[r]
        xr = x[r]
        pr = packed[r]
        sr = scale[r]
        for g in range(nb):
            o = g * 32
            amax = np.uint32(0)
            for j in range(32):
                a = xbr[o + j] & np.uint32(0x7FFFFFFF)
                amax = max(amax, a)
            if amax >= np.uint32(0x7F800000):
                for j in range(32):
                    if (xbr[o + j] & np.uint32(0x7FFFFFFF)) >= np.uint32(0x7F800000):
                        return r * k + o + j
            t = pow2[sr[g]]
            t0 = np.float32(0.25) * t
            t1 = np.float32(0.75) * t
            t2 = np.float32(1.25) * t
            t3 = np.float32(1.75) * t
            t4 = np.float32(2.5) * t
            t5 = np.float32(3.5) * t
            t6 = np.float32(5.0) * t
            for j in range(32):
                a = abs(xr[o + j])
                q = (
                    np.uint32(a > t0) + np.uint32(a >= t1) + np.uint32(a > t2) + np.uint32(a >= t3)
                    + np.uint32(a > t4) + np.uint32(a >= t5) + np.uint32(a > t6)
                )
                codes[j] = q | ((xbr[o + j] >> np.uint32(28)) & np.uint32(8))
            p0 = g * 16
            for j in range(16):
                pr[p0 + j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << np.uint32(4)))
    return -1


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(
        decode_f32=njit(_decode_pair_f32_kernel),
        decode_bf16=njit(_decode_pair_bf16_kernel),
        encode=njit(_encode_pair_kernel),
        encode_with_scales=njit(_encode_with_scales_kernel),
    )


# ------------------------------------------------------------------ shape checking
def _u8(a, what: str, name: str | None) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.uint8:
        raise ShapeError(f"MXFP4 {what} must be uint8, found dtype {a.dtype}", tensor=name)
    if a.ndim < 1:
        raise ShapeError(f"MXFP4 {what} needs at least one dimension", tensor=name)
    return a


def _pair_rows(packed, scale, name):
    """Validated ``[M, K/2]``, ``[M, K/32]`` row views and the logical shape."""
    packed = _u8(packed, "packed codes", name)
    scale = _u8(scale, "scales", name)
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != 16 * scale.shape[-1]:
        raise ShapeError(
            f"MXFP4 packed codes [..., K/2] and scales [..., K/32] disagree: "
            f"packed {list(packed.shape)}, scale {list(scale.shape)}",
            tensor=name,
        )
    shape = packed.shape[:-1] + (2 * packed.shape[-1],)
    m = math.prod(shape[:-1])
    return (
        np.ascontiguousarray(packed).reshape(m, shape[-1] // 2),
        np.ascontiguousarray(scale).reshape(m, shape[-1] // BLOCK),
        shape,
    )


def _input_rows(x, name) -> tuple[np.ndarray, tuple[int, ...]]:
    x = as_float32_input(x, name=name)
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ShapeError(
            f"MXFP4 encodes blocks of {BLOCK} along the last axis; found shape {list(x.shape)}", tensor=name
        )
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), x.shape


def _given_scale_rows(scale, shape, name) -> np.ndarray:
    scale = _u8(scale, "scales", name)
    want = tuple(shape[:-1]) + (shape[-1] // BLOCK,)
    if scale.shape != want:
        raise ShapeError(
            f"MXFP4 scales for values {list(shape)} must have shape {list(want)}, found {list(scale.shape)}",
            tensor=name,
        )
    bad = count_nan_scales(scale)
    if bad:
        first = np.unravel_index(int(np.argmax(scale == E8M0_NAN)), scale.shape)
        raise NaNScaleError(
            f"{bad} scale byte(s) are 0xFF (NaN), first at {list(map(int, first))}; "
            "a NaN block cannot hold values",
            tensor=name,
        )
    return np.ascontiguousarray(scale).reshape(math.prod(want[:-1]), want[-1])


def _nonfinite_error(x2: np.ndarray, flat: int, shape, name) -> UsageError:
    value = x2.reshape(-1)[flat]
    where = list(map(int, np.unravel_index(flat, shape)))
    return UsageError(
        f"cannot encode non-finite value {value} at {where} as MXFP4 (no Inf; NaN would need "
        "scale 0xFF and erase its block)",
        tensor=name,
    )


def _decode_dst(dst, shape, dt: np.dtype, name) -> np.ndarray:
    if dst is None:
        return np.empty(shape, dt)
    if not isinstance(dst, np.ndarray) or dst.dtype != dt or dst.shape != tuple(shape) or not dst.flags.c_contiguous:
        raise ShapeError(
            f"decode destination must be a C-contiguous {dt} array of shape {list(shape)}, found "
            f"{getattr(dst, 'dtype', type(dst).__name__)} {list(getattr(dst, 'shape', ()))}",
            tensor=name,
        )
    return dst


# ------------------------------------------------------------------------ decode
def decode_pair(packed, scale, *, out=np.float32, dst: np.ndarray | None = None, name: str | None = None):
    """Decode pair-layout MXFP4 (numba, one thread).

    packed U8 ``[..., K/2]`` (low nibble = even column), scale U8 ``[..., K/32]``
    -> ``[..., K]`` float32 or bfloat16 (both exact; 0xFF scales give NaN
    blocks; scale bytes 0xFD/0xFE with large codes overflow to +-Inf).
    ``dst`` optionally receives the result (C-contiguous, right shape/dtype).
    """
    p2, s2, shape = _pair_rows(packed, scale, name)
    dt = output_dtype(out)
    res = _decode_dst(dst, shape, dt, name)
    k = shape[-1]
    kern = _kernels()
    if dt == np.float32:
        kern.decode_f32(p2, s2, NIBBLE_LO_F32, NIBBLE_HI_F32, E8M0_F32, res.reshape(p2.shape[0], k))
    else:
        kern.decode_bf16(p2, s2, NIBBLE_LO_F32, NIBBLE_HI_F32, E8M0_F32, res.view(np.uint16).reshape(p2.shape[0], k))
    return res


def e2m1_value_ref(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes -> float64 values from the bit definition (sign, 2-bit exponent
    with bias 1, 1-bit mantissa; exponent 0 is subnormal: 0 or 0.5)."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 8, -1.0, 1.0)
    exp = (codes >> 1) & 3
    man = codes & 1
    mag = np.where(exp == 0, 0.5 * man, np.ldexp(1.0 + 0.5 * man, exp - 1))
    return sign * mag


def decode_pair_ref(packed, scale, *, out=np.float32, dst: np.ndarray | None = None, name: str | None = None):
    """Numpy reference of ``decode_pair`` (float64 products, then one cast)."""
    p2, s2, shape = _pair_rows(packed, scale, name)
    dt = output_dtype(out)
    res = _decode_dst(dst, shape, dt, name)
    codes = np.empty((p2.shape[0], shape[-1]), np.uint8)
    codes[:, 0::2] = p2 & 0x0F
    codes[:, 1::2] = p2 >> 4
    values = e2m1_value_ref(codes)
    sc = np.ldexp(1.0, s2.astype(np.int64) - E8M0_BIAS)
    sc[s2 == E8M0_NAN] = np.nan
    with np.errstate(over="ignore", invalid="ignore"):
        v = values * np.repeat(sc, BLOCK, axis=1)
        res.reshape(codes.shape)[...] = v.astype(np.float32).astype(dt)
    return res


# ------------------------------------------------------------------------ encode
_POW2_F32 = E8M0_F32  # byte -> exact 2^(byte - 127); the encoders never index 0xFF


def encode_pair(x, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """OCP FLOOR encode (numba, one thread): float ``[..., K]`` -> (packed U8
    ``[..., K/2]``, scale U8 ``[..., K/32]``).  Non-finite input: ``UsageError``."""
    x2, shape = _input_rows(x, name)
    m, k = x2.shape
    packed = np.empty((m, k // 2), np.uint8)
    scale = np.empty((m, k // BLOCK), np.uint8)
    bad = _kernels().encode(x2, _POW2_F32, packed, scale)
    if bad >= 0:
        raise _nonfinite_error(x2, bad, shape, name)
    return packed.reshape(shape[:-1] + (k // 2,)), scale.reshape(shape[:-1] + (k // BLOCK,))


def encode_with_scales(x, scale, *, name: str | None = None) -> np.ndarray:
    """Encode with given scale bytes (numba): RNE codes of ``x / 2^(s-127)``,
    saturating at +-6.  Decoding then re-encoding with the stored scales gives
    back the stored bytes.  0xFF scales: ``NaNScaleError``."""
    x2, shape = _input_rows(x, name)
    s2 = _given_scale_rows(scale, shape, name)
    m, k = x2.shape
    packed = np.empty((m, k // 2), np.uint8)
    bad = _kernels().encode_with_scales(x2, s2, _POW2_F32, packed)
    if bad >= 0:
        raise _nonfinite_error(x2, bad, shape, name)
    return packed.reshape(shape[:-1] + (k // 2,))


_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1 magnitudes, codes 0..7


def _rne_codes_ref(blocks: np.ndarray, shared_exp: np.ndarray) -> np.ndarray:
    """float32 blocks [n, 32], shared exponents [n] -> E2M1 codes [n, 32] (uint8).

    Nearest grid point to |x| / 2^e (exact in float64); a tie goes to the even
    code (mantissa bit 0); beyond 6 the nearest point is 6, which saturates.
    """
    y = np.ldexp(np.abs(blocks.astype(np.float64)), -shared_exp[:, None])
    dist = np.abs(y[..., None] - _GRID)
    best = np.argmin(dist, axis=-1)  # first minimum = the lower neighbour on a tie
    nxt = np.minimum(best + 1, 7)
    d_best = np.take_along_axis(dist, best[..., None], -1)[..., 0]
    d_next = np.take_along_axis(dist, nxt[..., None], -1)[..., 0]
    best = np.where((d_next == d_best) & (best % 2 == 1) & (nxt != best), nxt, best)
    return (best | np.where(np.signbit(blocks), 8, 0)).astype(np.uint8)


def _pack_ref(codes: np.ndarray) -> np.ndarray:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def _check_finite_ref(x2, shape, name):
    finite = np.isfinite(x2)
    if not finite.all():
        raise _nonfinite_error(x2, int(np.argmin(finite.reshape(-1))), shape, name)


def encode_pair_ref(x, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Numpy reference of ``encode_pair`` (frexp for floor(log2), nearest-point search)."""
    x2, shape = _input_rows(x, name)
    _check_finite_ref(x2, shape, name)
    m, k = x2.shape
    blocks = x2.reshape(-1, BLOCK)
    codes = np.empty(blocks.shape, np.uint8)
    scale = np.empty(blocks.shape[0], np.uint8)
    for i in range(0, blocks.shape[0], _REF_CHUNK_BLOCKS):
        b = blocks[i : i + _REF_CHUNK_BLOCKS]
        amax = np.abs(b.astype(np.float64)).max(axis=1)
        _, e = np.frexp(amax)  # amax = f * 2^e with f in [0.5, 1): floor(log2 amax) = e - 1
        shared = np.clip(e - 1 - 2, -E8M0_BIAS, E8M0_BIAS)
        shared = np.where(amax == 0, -E8M0_BIAS, shared)  # all-zero block: byte 0
        scale[i : i + len(b)] = (shared + E8M0_BIAS).astype(np.uint8)
        codes[i : i + len(b)] = _rne_codes_ref(b, shared)
    packed = _pack_ref(codes.reshape(m, k))
    return packed.reshape(shape[:-1] + (k // 2,)), scale.reshape(shape[:-1] + (k // BLOCK,))


def encode_with_scales_ref(x, scale, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``encode_with_scales``."""
    x2, shape = _input_rows(x, name)
    s2 = _given_scale_rows(scale, shape, name)
    _check_finite_ref(x2, shape, name)
    m, k = x2.shape
    blocks = x2.reshape(-1, BLOCK)
    shared_all = s2.reshape(-1).astype(np.int64) - E8M0_BIAS
    codes = np.empty(blocks.shape, np.uint8)
    for i in range(0, blocks.shape[0], _REF_CHUNK_BLOCKS):
        codes[i : i + _REF_CHUNK_BLOCKS] = _rne_codes_ref(
            blocks[i : i + _REF_CHUNK_BLOCKS], shared_all[i : i + _REF_CHUNK_BLOCKS]
        )
    return _pack_ref(codes.reshape(m, k)).reshape(shape[:-1] + (k // 2,))


# ----------------------------------------------------------------------- formats
class MXFP4Format(Format):
    """Family base of the MXFP4 layouts: codes + E8M0 scales in some byte order.

    A layout maps its stored rows to and from the pair layout (``_to_pair`` /
    ``_from_pair``); the pair layout's are identities.
    """

    _codes_role = "packed"
    _scale_role = "scale"

    def _to_pair(self, rows: dict[str, np.ndarray], *, reference: bool) -> tuple[np.ndarray, np.ndarray]:
        return rows[self._codes_role], rows[self._scale_role]

    def _from_pair(self, packed, scale, *, reference: bool) -> dict[str, np.ndarray]:
        return {self._codes_role: packed, self._scale_role: scale}

    def _decode_rows(self, rows, k, *, reference, bf16):
        packed, scale = self._to_pair(rows, reference=reference)
        dec = decode_pair_ref if reference else decode_pair
        return dec(packed, scale, out="bfloat16" if bf16 else np.float32)

    def _encode_rows(self, x, *, reference, name, shape):
        # Encode in the logical shape so errors give logical coordinates.
        packed, scale = (encode_pair_ref if reference else encode_pair)(x.reshape(shape), name=name)
        m, k = x.shape
        return self._from_pair(packed.reshape(m, k // 2), scale.reshape(m, k // BLOCK), reference=reference)

    def encode_with_scales(self, x, scales, *, name: str | None = None) -> dict[str, np.ndarray]:
        """Encode ``x`` ``[..., K]`` with given E8M0 bytes ``scales`` ``[..., K/32]``."""
        return self._encode_given(x, scales, name, reference=False)

    def reference_encode_with_scales(self, x, scales, *, name: str | None = None) -> dict[str, np.ndarray]:
        return self._encode_given(x, scales, name, reference=True)

    def _encode_given(self, x, scales, name, *, reference: bool) -> dict[str, np.ndarray]:
        x = as_float32_input(x, name=name)
        shape = self.check_logical_shape(x.shape, name=name)
        packed = (encode_with_scales_ref if reference else encode_with_scales)(x, scales, name=name)
        m, k = math.prod(shape[:-1]), shape[-1]
        s2 = np.ascontiguousarray(scales).reshape(m, k // BLOCK)
        return self._shape_parts(self._from_pair(packed.reshape(m, k // 2), s2, reference=reference), shape)

    def scales_of(self, parts, *, name: str | None = None) -> np.ndarray:
        """The E8M0 scale bytes ``[..., K/32]`` held in ``parts``."""
        shape = self.logical_shape(parts, name=name)
        _, scale = self._to_pair(self._rows(parts, shape, name), reference=False)
        return scale.reshape(shape[:-1] + (shape[-1] // BLOCK,))


class PackQuantized(MXFP4Format):
    """compressed-tensors ``mxfp4-pack-quantized`` (Kimi K3 routed experts)."""

    info = FormatInfo(
        id=ids.MXFP4_PACK,
        title="MXFP4, compressed-tensors pair layout (Kimi K3)",
        block=BLOCK,
        fields=(("e8m0 scale", 1), ("e2m1 codes", 16)),
        parts=(
            Part("packed", ".weight_packed", "U8", (16,)),
            Part("scale", ".weight_scale", "U8", (1,)),
        ),
        can_encode=True,
        can_decode=True,
        bf16_exact=True,
        spec="docs/formats/mxfp4.md#pair-layout-mxfp4-pack-quantized",
        declared_as=("compressed-tensors/mxfp4-pack-quantized",),
    )
