"""compressed-tensors ``pack-quantized`` INT4, group 32, symmetric (Kimi K2-Thinking / K2.5).

Stored per weight ``[N, K]``:

* ``weight_packed`` I32 ``[N, K/8]``: element ``8w + j`` of a row in bits
  ``[4j, 4j + 4)`` of word ``w`` (lowest nibble = lowest column), stored as
  ``q + 8`` so the nibble is unsigned (compressed-tensors ``pack_to_int32``:
  ``offset = 1 << (num_bits - 1)``, element i at bit ``i * num_bits``);
* ``weight_scale`` BF16 ``[N, K/32]``;
* ``weight_shape`` ``[2]`` = ``[N, K]`` (I64 from current compressed-tensors; I32 accepted).

Value = ``(nibble - 8) * scale``.  The float32 product is exact (4-bit times
8-bit significands), so float32 output holds the exact value and bfloat16
output is that value rounded to nearest even -- the same bits compressed-tensors'
``dequantize`` gives on a bfloat16 model (``x_q.to(bf16) * scale``).

Encoding follows compressed-tensors' symmetric INT rule (``calculate_qparams``:
``scale = amax / (bit_range / 2)`` with ``bit_range = 7 - (-8) = 15``, a zero
scale replaced by the scale dtype's eps; ``_quantize``: ``round(clamp(x / scale,
-8, 7))``), with the arithmetic torch does on a bfloat16 model: the scale
``bf16(f32(amax) / 7.5)`` (eps ``2^-7`` for an all-zero group), the quotient
``bf16(f32(x) / f32(scale))``, then round half to even.  The largest element of
a group therefore lands on 7 or -8 (7.5 rounds to 8, then clamps to 7; -7.5 to
-8), so decode -> encode is *not* a fixed point when a group's extreme is
negative.  See docs/formats/int4-pack.md.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np

from ..errors import ShapeError, UsageError
from .base import Format, FormatInfo, Part, PartSpec, first_nonfinite
from . import ids

__all__ = [
    "GROUP",
    "Int4PackQuantized",
    "decode_int4",
    "decode_int4_ref",
    "encode_int4",
    "encode_int4_ref",
]

GROUP = 32
OFFSET = 8
ZERO_SCALE_BITS = 0x3C00   # bf16 eps 2^-7: compressed-tensors' scale for an all-zero group
_INV_RANGE = np.float32(7.5)  # (q_max - q_min) / 2
# byte -> value of its low / high nibble minus the offset: one lookup per element
_NIB_LO = ((np.arange(256) & 15) - OFFSET).astype(np.float32)
_NIB_HI = ((np.arange(256) >> 4) - OFFSET).astype(np.float32)
_NIB_LO.flags.writeable = False
_NIB_HI.flags.writeable = False


# --------------------------------------------------------------------------- kernels
def _decode_kernel(pbytes, scale, lo, hi, out):
    # pbytes [M, K/2] uint8: the little-endian words' bytes, so byte i holds columns
    # 2i (low nibble) and 2i+1 (high nibble); scale [M, K/32] uint16 bf16 bits
    m = pbytes.shape[0]
    groups = scale.shape[1]
    sb = np.empty(1, np.uint32)
    sf = sb.view(np.float32)
    for r in range(m):
        for g in range(groups):
            sb[0] = np.uint32(scale[r, g]) << np.uint32(16)
            sc = sf[0]
            for i in range(16):
                byte = pbytes[r, g * 16 + i]
                out[r, g * 32 + 2 * i] = lo[byte] * sc
                out[r, g * 32 + 2 * i + 1] = hi[byte] * sc


def _decode_bf16_kernel(pbytes, scale, vals, out):
    # As _decode_kernel into bf16 bits: a 16-entry table per group holds each
    # (nibble - 8) * scale rounded to bfloat16 (nearest even; NaN kept quiet).
    m = pbytes.shape[0]
    groups = scale.shape[1]
    sb = np.empty(1, np.uint32)
    sf = sb.view(np.float32)
    fb = np.empty(1, np.float32)
    ub = fb.view(np.uint32)
    tab = np.empty(16, np.uint16)
    for r in range(m):
        for g in range(groups):
            sb[0] = np.uint32(scale[r, g]) << np.uint32(16)
            sc = sf[0]
            for c in range(16):
                fb[0] = vals[c] * sc
                u = ub[0]
                if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                    tab[c] = np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
                else:
                    tab[c] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                                       >> np.uint32(16))
            for i in range(16):
                byte = pbytes[r, g * 16 + i]
                out[r, g * 32 + 2 * i] = tab[byte & 15]
                out[r, g * 32 + 2 * i + 1] = tab[byte >> 4]


def _encode_kernel(x, packed, scale):
    # x [M, K] float32 finite -> packed [M, K/8] uint32, scale [M, K/32] uint16 bf16 bits
    m, k = x.shape
    groups = k // 32
    fb = np.empty(1, np.float32)
    ub = fb.view(np.uint32)
    for r in range(m):
        for g in range(groups):
            amax = np.float32(0.0)
            for j in range(32):
                a = abs(x[r, g * 32 + j])
                if a > amax:
                    amax = a
            fb[0] = amax / np.float32(7.5)
            u = ub[0]
            bits = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
            if bits == 0:
                bits = np.uint16(0x3C00)
            scale[r, g] = bits
            ub[0] = np.uint32(bits) << np.uint32(16)
            sc = fb[0]
            for w in range(4):
                word = np.uint32(0)
                for j in range(8):
                    fb[0] = x[r, g * 32 + w * 8 + j] / sc
                    u = ub[0]
                    # the quotient is a bf16 tensor in torch: round it to bf16 first
                    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                    ub[0] = u << np.uint32(16)
                    q = fb[0]
                    if q > np.float32(7.0):
                        q = np.float32(7.0)
                    elif q < np.float32(-8.0):
                        q = np.float32(-8.0)
                    qi = np.int32(np.rint(q)) + 8
                    word |= np.uint32(qi) << np.uint32(4 * j)
                packed[r, g * 4 + w] = word


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(
        decode=njit(_decode_kernel), decode_bf16=njit(_decode_bf16_kernel), encode=njit(_encode_kernel),
        first_nonfinite=njit(first_nonfinite),
    )


# --------------------------------------------------------------------------- helpers
def _rows2(packed, scale, name) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    if packed.dtype not in (np.int32, np.uint32):
        raise ShapeError(f"int4 weight_packed must be int32, found {packed.dtype}", tensor=name)
    if scale.dtype != np.uint16:
        try:
            import ml_dtypes

            ok = scale.dtype == np.dtype(ml_dtypes.bfloat16)
        except ImportError:  # pragma: no cover
            ok = False
        if not ok:
            raise ShapeError(f"int4 weight_scale must be BF16 (uint16 bits), found {scale.dtype}", tensor=name)
        scale = scale.view(np.uint16)
    if packed.ndim < 1 or packed.shape[-1] % 4:
        raise ShapeError(f"int4 weight_packed must be [..., K/8] with K a multiple of 32, found "
                         f"{list(packed.shape)}", tensor=name)
    k = packed.shape[-1] * 8
    want = packed.shape[:-1] + (k // GROUP,)
    if scale.shape != want:
        raise ShapeError(f"int4 weight_scale must have shape {list(want)}, found {list(scale.shape)}", tensor=name)
    m = math.prod(packed.shape[:-1])
    p2 = np.ascontiguousarray(packed).view(np.uint32).reshape(m, k // 8)
    s2 = np.ascontiguousarray(scale).reshape(m, k // GROUP)
    return p2, s2, packed.shape[:-1] + (k,)


def _check_finite(x2: np.ndarray, shape, name, first: int) -> None:
    if first >= 0:
        where = list(map(int, np.unravel_index(first, shape)))
        raise UsageError(f"cannot encode non-finite value {x2.reshape(-1)[first]} at {where} as INT4", tensor=name)


def _input_rows(x, name) -> tuple[np.ndarray, tuple[int, ...]]:
    from .base import as_float32_input

    x = as_float32_input(x, name=name)
    if x.ndim < 1 or x.shape[-1] % GROUP:
        raise ShapeError(f"INT4 groups of {GROUP} need K a multiple of {GROUP}, found shape {list(x.shape)}",
                         tensor=name)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), x.shape


# --------------------------------------------------------------------------- codecs
def decode_int4(packed, scale, *, out=np.float32, dst: np.ndarray | None = None,
                name: str | None = None) -> np.ndarray:
    """``weight_packed`` I32 ``[..., K/8]`` + ``weight_scale`` BF16 ``[..., K/32]``
    -> ``[..., K]`` float32 (exact) or bfloat16 (nearest even) (numba, one thread);
    ``dst`` optionally receives the result."""
    from .base import output_dtype
    from .fp8_block import destination

    p2, s2, shape = _rows2(packed, scale, name)
    dt = output_dtype(out)
    res = destination(dst, shape, dt, name)
    # word w's bytes in little-endian order are columns 8w .. 8w+7, two per byte
    pbytes = np.ascontiguousarray(p2, dtype="<u4").view(np.uint8)
    if dt == np.float32:
        _kernels().decode(pbytes, s2, _NIB_LO, _NIB_HI, res.reshape(p2.shape[0], shape[-1]))
    else:
        _kernels().decode_bf16(pbytes, s2, _NIB_LO[:16], res.view(np.uint16).reshape(p2.shape[0], shape[-1]))
    return res


def decode_int4_ref(packed, scale, *, out=np.float32, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_int4``: nibbles by shifts, float64 product, one cast."""
    from .base import output_dtype
    from .fp8_block import to_output

    p2, s2, shape = _rows2(packed, scale, name)
    shifts = np.arange(8, dtype=np.uint32) * np.uint32(4)
    nib = ((p2[:, :, None] >> shifts) & np.uint32(15)).reshape(p2.shape[0], -1).astype(np.int64) - OFFSET
    sc = (s2.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        res = (nib * np.repeat(sc, GROUP, axis=1)).astype(np.float32)
    return to_output(res, output_dtype(out)).reshape(shape)


def encode_int4(x, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float ``[..., K]`` -> (``weight_packed`` int32 ``[..., K/8]``, ``weight_scale``
    uint16 bf16 bits ``[..., K/32]``), compressed-tensors' symmetric rule (numba).
    Non-finite input: ``UsageError`` naming the position."""
    x2, shape = _input_rows(x, name)
    kern = _kernels()
    _check_finite(x2, shape, name, int(kern.first_nonfinite(x2)))
    m, k = x2.shape
    packed = np.empty((m, k // 8), np.uint32)
    scale = np.empty((m, k // GROUP), np.uint16)
    kern.encode(x2, packed, scale)
    return packed.view(np.int32).reshape(shape[:-1] + (k // 8,)), scale.reshape(shape[:-1] + (k // GROUP,))


def _to_bf16_f32(v: np.ndarray) -> np.ndarray:
    """float32 -> nearest-even bfloat16, returned as float32 (via ml_dtypes)."""
    import ml_dtypes

    return v.astype(ml_dtypes.bfloat16).astype(np.float32)


def encode_int4_ref(x, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Numpy reference of ``encode_int4`` (ml_dtypes for the bf16 roundings)."""
    import ml_dtypes

    x2, shape = _input_rows(x, name)
    finite = np.isfinite(x2)
    _check_finite(x2, shape, name, -1 if finite.all() else int(np.argmin(finite.reshape(-1))))
    m, k = x2.shape
    g = x2.reshape(m, k // GROUP, GROUP)
    amax = np.abs(g).max(axis=2)
    scale = (amax / _INV_RANGE).astype(np.float32).astype(ml_dtypes.bfloat16)
    bits = scale.view(np.uint16).copy()
    bits[bits == 0] = ZERO_SCALE_BITS
    sc = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    quot = _to_bf16_f32((g / sc[:, :, None]).astype(np.float32))
    q = np.rint(np.clip(quot, -8.0, 7.0)).astype(np.int64) + OFFSET
    q = q.reshape(m, k // 8, 8).astype(np.uint32)
    words = np.bitwise_or.reduce(q << (np.arange(8, dtype=np.uint32) * np.uint32(4)), axis=2).astype(np.uint32)
    return words.view(np.int32).reshape(shape[:-1] + (k // 8,)), bits.reshape(shape[:-1] + (k // GROUP,))


# --------------------------------------------------------------------------- format
class Int4PackQuantized(Format):
    """``int4-pack-quantized``: compressed-tensors ``pack-quantized`` INT4 (Kimi K2-Thinking experts)."""

    info = FormatInfo(
        id=ids.INT4_PACK,
        title="INT4 group 32 symmetric, compressed-tensors pack-quantized (Kimi K2-Thinking)",
        block=GROUP,
        fields=(("bf16 scale", 2), ("int4 codes", 16)),
        parts=(
            Part("packed", ".weight_packed", "I32", (4,)),
            Part("scale", ".weight_scale", "BF16", (1,)),
        ),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,
        spec="docs/formats/int4-pack.md#int4-pack-quantized-compressed-tensors",
        declared_as=("compressed-tensors/pack-quantized",),
        tensor_parts=(PartSpec("shape", ".weight_shape", "I64", (2,)),),
    )

    def _storage(self, arr, part, name):
        # weight_shape is I64 from current compressed-tensors; some checkpoints store I32.
        if part.role == "shape":
            arr = np.asarray(arr)
            if arr.dtype in (np.int32, np.int64):
                return arr.astype(np.int64)
        return super()._storage(arr, part, name)

    reencode_fixed_point = False
    """decode -> encode need not give the same bytes: a group whose extreme is
    negative decodes to 8 * scale, and re-encoding picks scale * 8 / 7.5."""

    def logical_shape(self, parts, *, name: str | None = None) -> tuple[int, ...]:
        """As the base, and ``weight_shape`` must say ``[rows, K]`` -- or more rows
        than given, so that a row range of a weight decodes with the weight's own
        ``weight_shape`` (readers decode large weights in row chunks)."""
        shape = super().logical_shape(parts, name=name)
        stored = [int(v) for v in np.asarray(parts["shape"]).reshape(-1)]
        rows = math.prod(shape[:-1])
        if stored[1] != shape[-1] or stored[0] < rows:
            raise ShapeError(
                f"{self.id} weight_shape says {stored}, the packed words hold {[rows, shape[-1]]}", tensor=name
            )
        return shape

    def sample_parts(self, shape, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Random words; scales are random finite positive bf16 values; weight_shape matches."""
        parts = super().sample_parts(shape, rng)
        spec = self.part_specs(shape)["scale"]
        mag = np.exp2(rng.uniform(-16.0, 0.0, spec.shape)).astype(np.float32)
        parts["scale"] = (mag.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        parts["shape"] = np.array([math.prod(shape[:-1]), shape[-1]], np.int64)
        return parts

    def _decode_rows(self, rows, k, *, reference, bf16):
        dec = decode_int4_ref if reference else decode_int4
        return dec(rows["packed"].view(np.int32), rows["scale"], out="bfloat16" if bf16 else np.float32)

    def _encode_rows(self, x, *, reference, name, shape):
        packed, scale = (encode_int4_ref if reference else encode_int4)(x.reshape(shape), name=name)
        m = x.shape[0]
        return {
            "packed": packed.reshape(m, -1),
            "scale": scale.reshape(m, -1),
            "shape": np.array([m, shape[-1]], np.int64),
        }
