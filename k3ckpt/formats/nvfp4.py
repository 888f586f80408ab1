"""NVFP4: E2M1 codes in blocks of 16 with an E4M3 block scale and an F32 per-tensor scale.

Two namings of the same bytes (FORMATS sec. 3, compressed-tensors ``modelopt_nvfp4.py``):

* ``nvfp4`` (compressed-tensors ``nvfp4-pack-quantized``): ``weight_packed`` U8
  ``[N, K/2]`` (low nibble = even column), ``weight_scale`` F8_E4M3 ``[N, K/16]``,
  ``weight_global_scale`` F32 ``[1]``; value = code * (f32(scale) / global), the
  effective block scale computed first (compressed-tensors ``_dequantize``:
  ``scale = scale / global_scale``; ``x_q * scale``), each step rounded to float32.
* ``nvfp4-modelopt`` (NVIDIA ModelOpt): ``weight`` U8, ``weight_scale`` F8_E4M3,
  ``weight_scale_2`` F32 ``[]`` in ModelOpt files (read as is; our encoder writes
  ``[1]``); value = code * (f32(scale) * scale_2).

Encoding (compressed-tensors convention, ``generate_gparam`` / ``calculate_qparams``
/ ``_quantize``): global = f32(448 * 6 / amax(tensor)); block scale =
E4M3(min(global * f32(amax(block) / 6), 448)) rounded to nearest even, a scale
that rounds to zero becoming 0.125 (compressed-tensors' FP8 eps); codes =
E2M1 round-half-even of clamp(x / (f32(scale) / global), -6, 6), sign kept
(-0 is code 8).  ModelOpt's encoder here uses scale_2 = f32(amax / 2688) and
block scale = E4M3(min(f32(amax(block) / 6) / scale_2, 448)) with the same
zero rule.  Our choices where compressed-tensors gives Inf/NaN: an all-zero
tensor gets global (and scale_2) 1.0; a global that overflows float32 is
clamped to its largest finite value.  See docs/formats/nvfp4.md.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np

from ..errors import ShapeError, UsageError
from .base import Format, FormatInfo, Part, PartSpec, as_float32_input, first_nonfinite
from .e2m1 import E2M1_VALUES, NIBBLE_HI_F32, NIBBLE_LO_F32
from .mxfp4 import e2m1_value_ref
from .plain import FP8_E4M3_F32, decode_fp8_e4m3_ref
from . import ids

__all__ = [
    "BLOCK",
    "NVFP4",
    "NVFP4ModelOpt",
    "decode_nvfp4",
    "decode_nvfp4_ref",
    "encode_nvfp4",
    "encode_nvfp4_ref",
    "global_scale_for",
]

BLOCK = 16
E4M3_MAX = np.float32(448.0)
E2M1_MAX = np.float32(6.0)
ZERO_SCALE_BYTE = 0x30  # E4M3 0.125: compressed-tensors' replacement for a zero block scale
_F32_MAX = np.float32(np.finfo(np.float32).max)


# --------------------------------------------------------------------------- kernels
def _decode_kernel(packed, scale, lo, hi, fp8, g, multiply, out):
    # packed [M, K/2] u8, scale [M, K/16] u8 (E4M3 bytes) -> out [M, K] f32
    m = packed.shape[0]
    nb = scale.shape[1]
    for r in range(m):
        for b in range(nb):
            s = fp8[scale[r, b]]
            eff = s * g if multiply else s / g
            for i in range(8):
                byte = packed[r, b * 8 + i]
                out[r, b * 16 + 2 * i] = lo[byte] * eff
                out[r, b * 16 + 2 * i + 1] = hi[byte] * eff


def _decode_bf16_kernel(packed, scale, vals, fp8, g, multiply, out):
    # As _decode_kernel into bf16 bits: a 16-entry table per block holds each code's
    # value times the block's float32 scale, rounded to bfloat16 (nearest even; NaN quiet).
    m = packed.shape[0]
    nb = scale.shape[1]
    fb = np.empty(1, np.float32)
    ub = fb.view(np.uint32)
    tab = np.empty(16, np.uint16)
    for r in range(m):
        for b in range(nb):
            s = fp8[scale[r, b]]
            eff = s * g if multiply else s / g
            for c in range(16):
                fb[0] = vals[c] * eff
                u = ub[0]
                if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                    tab[c] = np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
                else:
                    tab[c] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                                       >> np.uint32(16))
            for i in range(8):
                byte = packed[r, b * 8 + i]
                out[r, b * 16 + 2 * i] = tab[byte & 15]
                out[r, b * 16 + 2 * i + 1] = tab[byte >> 4]


def _encode_kernel(x, g, multiply, fp8, thresholds, inclusive, packed, scale):
    # x [M, K] f32 finite; g: global (divide) or scale_2 (multiply)
    m, k = x.shape
    nb = k // 16
    fb = np.empty(1, np.float32)
    ub = fb.view(np.uint32)
    for r in range(m):
        for b in range(nb):
            amax = np.float32(0.0)
            for j in range(16):
                a = abs(x[r, b * 16 + j])
                if a > amax:
                    amax = a
            t = amax / np.float32(6.0)
            pre = t / g if multiply else g * t
            if pre > np.float32(448.0):
                pre = np.float32(448.0)
            # E4M3 round to nearest even, from the float32 bits (0 <= pre <= 448)
            fb[0] = pre
            u = ub[0]
            e = np.int32(u >> np.uint32(23)) - 127
            if e < -6:  # below 2^-6: subnormal steps of 2^-9 (pre * 512 is exact)
                sb = np.uint8(np.rint(pre * np.float32(512.0)))
            else:
                top = (u >> np.uint32(20)) & np.uint32(7)
                rem = u & np.uint32(0xFFFFF)
                if rem > np.uint32(0x80000) or (rem == np.uint32(0x80000) and (top & np.uint32(1)) == np.uint32(1)):
                    top += np.uint32(1)
                    if top == np.uint32(8):
                        top = np.uint32(0)
                        e += 1
                sb = np.uint8(((e + 7) << 3) | np.int32(top))
            if sb == 0:
                sb = np.uint8(0x30)
            scale[r, b] = sb
            s = fp8[sb]
            eff = s * g if multiply else s / g
            for i in range(8):
                pair = np.uint8(0)
                for h in range(2):
                    y = x[r, b * 16 + 2 * i + h] / eff
                    neg = np.signbit(y)
                    a = abs(y)
                    code = 0
                    for t_i in range(7):
                        th = thresholds[t_i]
                        if a > th or (inclusive[t_i] and a == th):
                            code += 1
                    if neg:
                        code |= 8
                    pair |= np.uint8(code << (4 * h))
                packed[r, b * 8 + i] = pair


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(
        decode=njit(_decode_kernel), decode_bf16=njit(_decode_bf16_kernel), encode=njit(_encode_kernel),
        first_nonfinite=njit(first_nonfinite),
    )


_THRESHOLDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_INCLUSIVE = np.array([False, True, False, True, False, True, False])


# --------------------------------------------------------------------------- helpers
def _u8(a, what, name) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.uint8:
        return a
    import ml_dtypes

    if a.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return a.view(np.uint8)
    raise ShapeError(f"NVFP4 {what} must be uint8 bytes, found dtype {a.dtype}", tensor=name)


def _rows2(packed, scale, name):
    packed = _u8(packed, "packed codes", name)
    scale = _u8(scale, "E4M3 scales", name)
    if packed.ndim < 1 or packed.shape[-1] % 8:
        raise ShapeError(f"NVFP4 packed codes must be [..., K/2] with K a multiple of 16, found "
                         f"{list(packed.shape)}", tensor=name)
    k = packed.shape[-1] * 2
    want = packed.shape[:-1] + (k // BLOCK,)
    if scale.shape != want:
        raise ShapeError(f"NVFP4 block scales must have shape {list(want)}, found {list(scale.shape)}", tensor=name)
    m = math.prod(packed.shape[:-1])
    return (np.ascontiguousarray(packed).reshape(m, k // 2), np.ascontiguousarray(scale).reshape(m, k // BLOCK),
            packed.shape[:-1] + (k,))


def _scalar(g, what, name) -> np.float32:
    arr = np.asarray(g)
    if arr.size != 1 or arr.dtype != np.float32:
        raise ShapeError(f"NVFP4 {what} must be one float32 value, found {arr.dtype} {list(arr.shape)}", tensor=name)
    v = np.float32(arr.reshape(-1)[0])
    if not (np.isfinite(v) and v > 0):
        raise UsageError(f"NVFP4 {what} must be finite and positive, found {v}", tensor=name)
    return v


def global_scale_for(x, *, multiply: bool = False) -> np.float32:
    """The per-tensor scale the encoder picks for ``x``: compressed-tensors'
    global ``f32(2688 / amax)`` (``multiply=False``) or ModelOpt's scale_2
    ``f32(amax / 2688)`` (``multiply=True``); 1.0 for an all-zero tensor."""
    x = np.asarray(x, np.float32)
    amax = np.float32(np.abs(x).max()) if x.size else np.float32(0.0)
    if amax == 0 or not np.isfinite(amax):
        return np.float32(1.0)
    with np.errstate(over="ignore", under="ignore"):
        g = amax / np.float32(2688.0) if multiply else np.float32(2688.0) / amax
    if g == 0:
        return np.float32(1.0)
    return min(np.float32(g), _F32_MAX)


def _input_rows(x, name):
    x = as_float32_input(x, name=name)
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ShapeError(f"NVFP4 blocks of {BLOCK} need K a multiple of {BLOCK}, found shape {list(x.shape)}",
                         tensor=name)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), x.shape


def _nonfinite(x2, shape, name, first: int) -> None:
    if first >= 0:
        where = list(map(int, np.unravel_index(first, shape)))
        raise UsageError(f"cannot encode non-finite value {x2.reshape(-1)[first]} at {where} as NVFP4", tensor=name)


# --------------------------------------------------------------------------- codecs
def decode_nvfp4(packed, scale, global_scale, *, multiply: bool = False, out=np.float32,
                 dst: np.ndarray | None = None, name: str | None = None) -> np.ndarray:
    """packed U8 ``[..., K/2]``, E4M3 scales ``[..., K/16]``, per-tensor scale ->
    ``[..., K]`` float32 or bfloat16 (nearest even) (numba, one thread).
    ``multiply=False``: compressed-tensors (divide by the global scale); ``True``:
    ModelOpt (multiply by scale_2).  ``dst`` optionally receives the result."""
    from .base import output_dtype
    from .fp8_block import destination

    p2, s2, shape = _rows2(packed, scale, name)
    g = _scalar(global_scale, "global scale", name)
    dt = output_dtype(out)
    res = destination(dst, shape, dt, name)
    if dt == np.float32:
        _kernels().decode(p2, s2, NIBBLE_LO_F32, NIBBLE_HI_F32, FP8_E4M3_F32, g, bool(multiply),
                          res.reshape(p2.shape[0], shape[-1]))
    else:
        _kernels().decode_bf16(p2, s2, E2M1_VALUES, FP8_E4M3_F32, g, bool(multiply),
                               res.view(np.uint16).reshape(p2.shape[0], shape[-1]))
    return res


def decode_nvfp4_ref(packed, scale, global_scale, *, multiply: bool = False, out=np.float32,
                     name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_nvfp4`` (codes and E4M3 from their bit fields)."""
    from .base import output_dtype
    from .fp8_block import to_output

    p2, s2, shape = _rows2(packed, scale, name)
    g = _scalar(global_scale, "global scale", name)
    codes = np.empty((p2.shape[0], shape[-1]), np.uint8)
    codes[:, 0::2] = p2 & 0x0F
    codes[:, 1::2] = p2 >> 4
    s = decode_fp8_e4m3_ref(s2)
    with np.errstate(invalid="ignore", over="ignore"):
        eff = (s * g) if multiply else (s / g)       # float32 op, one rounding
        res = (e2m1_value_ref(codes) * np.repeat(eff.astype(np.float64), BLOCK, axis=1)).astype(np.float32)
    return to_output(res, output_dtype(out)).reshape(shape)


def encode_nvfp4(x, global_scale=None, *, multiply: bool = False,
                 name: str | None = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """float ``[..., K]`` -> (packed U8 ``[..., K/2]``, E4M3 scale bytes ``[..., K/16]``,
    per-tensor scale) (numba).  ``global_scale`` None: ``global_scale_for(x)``."""
    x2, shape = _input_rows(x, name)
    kern = _kernels()
    _nonfinite(x2, shape, name, int(kern.first_nonfinite(x2)))
    g = global_scale_for(x2, multiply=multiply) if global_scale is None else _scalar(global_scale, "global scale", name)
    m, k = x2.shape
    packed = np.empty((m, k // 2), np.uint8)
    scale = np.empty((m, k // BLOCK), np.uint8)
    kern.encode(x2, g, bool(multiply), FP8_E4M3_F32, _THRESHOLDS, _INCLUSIVE, packed, scale)
    return packed.reshape(shape[:-1] + (k // 2,)), scale.reshape(shape[:-1] + (k // BLOCK,)), g


def encode_nvfp4_ref(x, global_scale=None, *, multiply: bool = False,
                     name: str | None = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Numpy reference of ``encode_nvfp4``: ml_dtypes float8_e4m3fn for the scales and
    float4_e2m1fn (round half even, saturating, -0 kept) for the codes."""
    import ml_dtypes

    x2, shape = _input_rows(x, name)
    finite = np.isfinite(x2)
    _nonfinite(x2, shape, name, -1 if finite.all() else int(np.argmin(finite.reshape(-1))))
    g = global_scale_for(x2, multiply=multiply) if global_scale is None else _scalar(global_scale, "global scale", name)
    m, k = x2.shape
    blocks = x2.reshape(m, k // BLOCK, BLOCK)
    t = (np.abs(blocks).max(axis=2) / E2M1_MAX).astype(np.float32)
    with np.errstate(over="ignore"):
        pre = (t / g) if multiply else (g * t)
    pre = np.minimum(pre.astype(np.float32), E4M3_MAX)
    sb = pre.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).copy()
    sb[sb == 0] = ZERO_SCALE_BYTE
    s = FP8_E4M3_F32[sb]
    eff = ((s * g) if multiply else (s / g)).astype(np.float32)
    y = (blocks / eff[:, :, None]).astype(np.float32)
    codes = np.clip(y, -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(m, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed.reshape(shape[:-1] + (k // 2,)), sb.reshape(shape[:-1] + (k // BLOCK,)), g


# --------------------------------------------------------------------------- formats
class NVFP4Format(Format):
    """Family base: packed E2M1 + E4M3 block scales + one F32 per-tensor scale."""

    _multiply = False          # ModelOpt multiplies by its per-tensor scale, compressed-tensors divides
    _global_role = "global_scale"
    reencode_fixed_point = False
    """decode -> encode need not give the same bytes: the encoder derives a new
    per-tensor scale from the decoded amax (``encode_with_global`` keeps it)."""

    def _global_part(self) -> PartSpec:
        return self._part(self._global_role)

    def _decode_rows(self, rows, k, *, reference, bf16):
        dec = decode_nvfp4_ref if reference else decode_nvfp4
        g = rows[self._global_role].reshape(-1)
        return dec(rows["packed"], rows["scale"], g, multiply=self._multiply, out="bfloat16" if bf16 else np.float32)

    def _encode_rows(self, x, *, reference, name, shape, global_scale=None):
        enc = encode_nvfp4_ref if reference else encode_nvfp4
        packed, scale, g = enc(x.reshape(shape), global_scale, multiply=self._multiply, name=name)
        m = x.shape[0]
        spec = self._global_part()
        return {"packed": packed.reshape(m, -1), "scale": scale.reshape(m, -1),
                self._global_role: np.full(spec.shape, g, np.float32)}

    def encode_with_global(self, x, global_scale, *, name: str | None = None,
                           reference: bool = False) -> dict[str, np.ndarray]:
        """Encode with a given per-tensor scale (e.g. the one already stored)."""
        x = as_float32_input(x, name=name)
        shape = self.check_logical_shape(x.shape, name=name)
        rows = x.reshape(math.prod(shape[:-1]), shape[-1])
        got = self._encode_rows(rows, reference=reference, name=name, shape=shape, global_scale=global_scale)
        return self._shape_parts(got, shape)

    def sample_parts(self, shape, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Random codes and scale bytes (NaN bytes included); a positive per-tensor scale."""
        parts = super().sample_parts(shape, rng)
        spec = self._global_part()
        parts[self._global_role] = np.full(spec.shape, np.exp2(rng.uniform(-4.0, 12.0)), np.float32)
        return parts


class NVFP4(NVFP4Format):
    """``nvfp4``: compressed-tensors ``nvfp4-pack-quantized``."""

    info = FormatInfo(
        id=ids.NVFP4,
        title="NVFP4, compressed-tensors naming (E2M1, E4M3 scale per 16, F32 global divisor)",
        block=BLOCK,
        fields=(("e4m3 scale", 1), ("e2m1 codes", 8)),
        parts=(
            Part("packed", ".weight_packed", "U8", (8,)),
            Part("scale", ".weight_scale", "F8_E4M3", (1,)),
        ),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,
        spec="docs/formats/nvfp4.md#compressed-tensors-naming-nvfp4",
        declared_as=("compressed-tensors/nvfp4-pack-quantized",),
        tensor_parts=(PartSpec("global_scale", ".weight_global_scale", "F32", (1,)),),
    )


class NVFP4ModelOpt(NVFP4Format):
    """``nvfp4-modelopt``: NVIDIA ModelOpt naming (``weight`` U8 + ``weight_scale_2`` multiplier)."""

    _multiply = True
    _global_role = "scale_2"

    info = FormatInfo(
        id=ids.NVFP4_MODELOPT,
        title="NVFP4, ModelOpt naming (E2M1, E4M3 scale per 16, F32 weight_scale_2 multiplier)",
        block=BLOCK,
        fields=(("e4m3 scale", 1), ("e2m1 codes", 8)),
        parts=(
            Part("packed", ".weight", "U8", (8,)),
            Part("scale", ".weight_scale", "F8_E4M3", (1,)),
        ),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,
        spec="docs/formats/nvfp4.md#modelopt-naming-nvfp4-modelopt",
        declared_as=("modelopt/nvfp4",),
        tensor_parts=(PartSpec("scale_2", ".weight_scale_2", "F32", (1,)),),
    )

    def logical_shape(self, parts, *, name: str | None = None) -> tuple[int, ...]:
        # ModelOpt files store weight_scale_2 as a 0-d tensor; the table (and our
        # encoder) use [1] like compressed-tensors' global scale.  Both are read.
        s2 = parts.get("scale_2") if hasattr(parts, "get") else None
        if s2 is not None and np.shape(s2) == ():
            parts = {**parts, "scale_2": np.asarray(s2).reshape(1)}
        return super().logical_shape(parts, name=name)
