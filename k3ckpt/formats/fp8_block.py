"""Block FP8 (DeepSeek-V3, Kimi K2): F8_E4M3 weights with one F32 scale per 128x128 tile.

``X.weight`` F8_E4M3 ``[N, K]`` and ``X.weight_scale_inv`` F32
``[ceil(N/128), ceil(K/128)]``; value = float32(fp8) * scale_inv[i // 128, j // 128]
(a multiply despite the name), the product rounded to float32; edge tiles are
partial.  bfloat16 output rounds that float32 product to nearest even, as
DeepSeek-V3's ``weight_dequant`` does (see docs/formats/fp8-block.md).

Why a ``Format`` subclass that overrides the shape hooks: the base class models
blocks along the last axis only, and a 2-D tile's scale tensor neither grows
linearly with K nor fixes the logical shape by itself.  The subclass keeps the
registry contract (``decode`` / ``reference_decode`` / ``part_specs`` /
``logical_shape`` / ``tensor_names`` / ``match_name``) and replaces only
``check_logical_shape``, ``part_specs``, ``logical_shape``, ``_rows`` and
``sample_parts``.  Leading axes (``[..., N, K]``) are batches of independent
weights, each with its own ``[..., ceil(N/128), ceil(K/128)]`` scales.  In the
table a "block" is one full tile (4 + 16384 bytes).  Decode only: FP8 bytes of
a checkpoint are kept, never re-made (fixtures use ``generate.fp8_block_quantize``).
"""

from __future__ import annotations

import functools
import math
import types
from typing import Mapping

import numpy as np

from ..errors import ShapeError, UsageError
from .base import Format, FormatInfo, Part, PartSpec, output_dtype
from .plain import FP8_E4M3_F32, decode_fp8_e4m3_ref
from . import ids

__all__ = ["TILE", "BlockFP8", "decode_fp8_block", "decode_fp8_block_ref", "destination", "scale_shape", "to_output"]

TILE = 128
"""Rows and columns of one scale tile."""


def scale_shape(shape) -> tuple[int, ...]:
    """``[..., N, K]`` -> the scale tensor's shape ``[..., ceil(N/128), ceil(K/128)]``."""
    *lead, n, k = (int(d) for d in shape)
    return (*lead, -(-n // TILE), -(-k // TILE))


# --------------------------------------------------------------------------- kernels
def _decode_kernel(w, s, lut, out):
    # w [B, N, K] uint8, s [B, TN, TK] float32, out [B, N, K] float32.
    # Per tile row, one 256-entry product table per tile column (the same float32
    # multiply as lut[byte] * scale), then each element is a single lookup.
    nb, n, k = w.shape
    tn, tk = s.shape[1], s.shape[2]
    tab = np.empty((tk, 256), np.float32)
    for b in range(nb):
        for ti in range(tn):
            for t in range(tk):
                sc = s[b, ti, t]
                for c in range(256):
                    tab[t, c] = lut[c] * sc
            for i in range(ti * 128, min(n, (ti + 1) * 128)):
                for j in range(k):
                    out[b, i, j] = tab[j >> 7, w[b, i, j]]


def _decode_bf16_kernel(w, s, lut, out):
    # As _decode_kernel, the table holding each float32 product rounded to bfloat16
    # (nearest even; NaN kept quiet), so out [B, N, K] uint16 gets bf16 bits.
    nb, n, k = w.shape
    tn, tk = s.shape[1], s.shape[2]
    tab = np.empty((tk, 256), np.uint16)
    fb = np.empty(1, np.float32)
    ub = fb.view(np.uint32)
    for b in range(nb):
        for ti in range(tn):
            for t in range(tk):
                sc = s[b, ti, t]
                for c in range(256):
                    fb[0] = lut[c] * sc
                    u = ub[0]
                    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                        tab[t, c] = np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
                    else:
                        tab[t, c] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                                              >> np.uint32(16))
            for i in range(ti * 128, min(n, (ti + 1) * 128)):
                for j in range(k):
                    out[b, i, j] = tab[j >> 7, w[b, i, j]]


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel), decode_bf16=njit(_decode_bf16_kernel))


def _as3(weight: np.ndarray, scale: np.ndarray, name) -> tuple[np.ndarray, np.ndarray]:
    weight = np.asarray(weight)
    scale = np.asarray(scale)
    if weight.ndim < 2:
        raise ShapeError(f"block FP8 weight must be [..., N, K], found shape {list(weight.shape)}", tensor=name)
    want = scale_shape(weight.shape)
    if tuple(scale.shape) != want:
        raise ShapeError(
            f"block FP8 weight_scale_inv for weight {list(weight.shape)} must have shape {list(want)}, "
            f"found {list(scale.shape)}",
            tensor=name,
        )
    if weight.dtype != np.uint8:
        import ml_dtypes

        if weight.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
            raise ShapeError(f"block FP8 weight must be F8_E4M3 bytes (uint8), found {weight.dtype}", tensor=name)
        weight = weight.view(np.uint8)
    if scale.dtype != np.float32:
        raise ShapeError(f"block FP8 weight_scale_inv must be float32, found {scale.dtype}", tensor=name)
    n, k = weight.shape[-2:]
    b = math.prod(weight.shape[:-2])
    w3 = np.ascontiguousarray(weight).reshape(b, n, k)
    s3 = np.ascontiguousarray(scale).reshape(b, *want[-2:])
    return w3, s3


def destination(dst, shape, dt, name) -> np.ndarray:
    """``dst`` checked as a C-contiguous ``dt`` array of ``shape``, or a new one."""
    shape = tuple(shape)
    if dst is None:
        return np.empty(shape, dt)
    if not isinstance(dst, np.ndarray) or dst.dtype != dt or dst.shape != shape or not dst.flags.c_contiguous:
        raise ShapeError(
            f"decode destination must be a C-contiguous {dt} array of shape {list(shape)}, found "
            f"{getattr(dst, 'dtype', type(dst).__name__)} {list(getattr(dst, 'shape', ()))}",
            tensor=name,
        )
    return dst


def to_output(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """float32 result of a reference decoder in the output dtype (bfloat16: nearest even, ml_dtypes)."""
    if dt == np.float32:
        return x
    with np.errstate(invalid="ignore"):
        return x.astype(dt)


def decode_fp8_block(weight, scale_inv, *, out=np.float32, dst: np.ndarray | None = None,
                     name: str | None = None) -> np.ndarray:
    """F8_E4M3 ``[..., N, K]`` (uint8 bytes or ml_dtypes float8_e4m3fn) and F32
    scales ``[..., ceil(N/128), ceil(K/128)]`` -> ``[..., N, K]`` float32 or bfloat16
    (the float32 product rounded to nearest even) (numba, one thread); ``dst``
    optionally receives the result."""
    w3, s3 = _as3(weight, scale_inv, name)
    dt = output_dtype(out)
    res = destination(dst, np.shape(weight), dt, name)
    if dt == np.float32:
        _kernels().decode(w3, s3, FP8_E4M3_F32, res.reshape(w3.shape))
    else:
        _kernels().decode_bf16(w3, s3, FP8_E4M3_F32, res.view(np.uint16).reshape(w3.shape))
    return res


def decode_fp8_block_ref(weight, scale_inv, *, out=np.float32, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_fp8_block``: E4M3 from its bit fields, scales
    repeated over each tile and cut at the edges, one float32 multiply."""
    w3, s3 = _as3(weight, scale_inv, name)
    n, k = w3.shape[1:]
    vals = decode_fp8_e4m3_ref(w3)
    full = np.repeat(np.repeat(s3, TILE, axis=1), TILE, axis=2)[:, :n, :k]
    with np.errstate(invalid="ignore", over="ignore"):
        res = vals * full
    assert res.dtype == np.float32
    return to_output(res, output_dtype(out)).reshape(np.shape(weight))


# --------------------------------------------------------------------------- format
class BlockFP8(Format):
    """``fp8-block``: DeepSeek-V3 / Kimi K2 ``weight`` + ``weight_scale_inv`` (decode only)."""

    info = FormatInfo(
        id=ids.FP8_BLOCK,
        title="FP8 E4M3 with an F32 scale per 128x128 tile (DeepSeek-V3, Kimi K2)",
        block=TILE * TILE,
        fields=(("f32 scale_inv", 4), ("e4m3 codes", TILE * TILE)),
        parts=(
            Part("weight", ".weight", "F8_E4M3", (TILE * TILE,)),
            Part("scale_inv", ".weight_scale_inv", "F32", (1,)),
        ),
        can_encode=False,
        can_decode=True,
        bf16_exact=False,
        spec="docs/formats/fp8-block.md#block-fp8-deepseek-v3-kimi-k2",
        declared_as=("fp8/block",),   # quant_method fp8 with a weight_block_size
    )

    tile = TILE
    """Rows per scale row: a row range read on its own must start at a multiple of this."""

    # -- shape hooks (2-D tiles instead of last-axis blocks)
    def check_logical_shape(self, shape, *, name: str | None = None) -> tuple[int, ...]:
        """Any ``[..., N, K]`` with N, K >= 0 (edge tiles may be partial)."""
        shape = tuple(int(d) for d in shape)
        if len(shape) < 2:
            raise ShapeError(f"{self.id} stores [..., N, K] weights (2-D tiles), found shape {list(shape)}",
                             tensor=name)
        if any(d < 0 for d in shape):
            raise ShapeError(f"negative dimension in shape {list(shape)}", tensor=name)
        return shape

    def part_specs(self, shape, *, name: str | None = None) -> dict[str, PartSpec]:
        shape = self.check_logical_shape(shape, name=name)
        w, s = self.info.parts
        return {
            "weight": PartSpec(w.role, w.suffix, w.dtype, shape),
            "scale_inv": PartSpec(s.role, s.suffix, s.dtype, scale_shape(shape)),
        }

    def logical_shape(self, parts: Mapping[str, np.ndarray], *, name: str | None = None) -> tuple[int, ...]:
        self.check_roles(parts, name=name)
        shape = self.check_logical_shape(np.shape(parts["weight"]), name=name)
        for role, spec in self.part_specs(shape, name=name).items():
            got = tuple(np.shape(parts[role]))
            if got != spec.shape:
                raise ShapeError(
                    f"{self.id} part {role!r}: expected shape {list(spec.shape)} for weight shape "
                    f"{list(shape)}, found {list(got)}",
                    tensor=name,
                )
            self._storage(parts[role], self._part(role), name)
        return shape

    def _rows(self, parts, shape, name) -> dict[str, np.ndarray]:
        # The kernel needs whole tiles: hand over [B, N, K] and [B, TN, TK], not rows.
        n, k = shape[-2:]
        b = math.prod(shape[:-2])
        w = np.ascontiguousarray(self._storage(parts["weight"], self._part("weight"), name)).reshape(b, n, k)
        s = np.ascontiguousarray(self._storage(parts["scale_inv"], self._part("scale_inv"), name))
        return {"weight": w, "scale_inv": s.reshape(b, *scale_shape(shape)[-2:])}

    def _decode_rows(self, rows, k, *, reference, bf16):
        w, s = rows["weight"], rows["scale_inv"]
        res = (decode_fp8_block_ref if reference else decode_fp8_block)(w, s, out="bfloat16" if bf16 else np.float32)
        return res.reshape(w.shape[0] * w.shape[1], k)

    def sample_parts(self, shape, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Random FP8 bytes and positive scales around 2^-8 (as real checkpoints hold)."""
        specs = self.part_specs(shape)
        w = rng.integers(0, 256, specs["weight"].shape, dtype=np.uint8)
        s = np.exp2(rng.uniform(-14.0, -4.0, specs["scale_inv"].shape)).astype(np.float32)
        return {"weight": w, "scale_inv": s}

    def logical_shape_from_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The logical shape from the stored tensors' shapes (headers): the weight's own."""
        return self.check_logical_shape(shapes["weight"])

    # -- reading part of a weight
    def part_rows(self, role: str, r0: int, r1: int, n: int) -> tuple[int, int]:
        """Rows ``[a, b)`` of part ``role`` that weight rows ``[r0, r1)`` of an
        ``[N, K]`` weight need; ``r0`` must be a multiple of 128 and ``r1`` one or N."""
        if not (0 <= r0 <= r1 <= n) or r0 % TILE or (r1 % TILE and r1 != n):
            raise UsageError(f"{self.id}: row range [{r0}, {r1}) of {n} rows is not tile aligned (128)")
        if role == "weight":
            return r0, r1
        if role == "scale_inv":
            return r0 // TILE, -(-r1 // TILE)
        raise UsageError(f"{self.id} has no part {role!r}")
