"""llama.cpp IQ2_XXS (``gguf-iq2_xxs``): 2.0625 bpw, 256-weight super-blocks on a 256-point E8 grid.

Stored per weight ``[..., K]`` (K a multiple of 256; spec: docs/formats/iq2_xxs.md)
as one tensor ``.weight_packed`` U8 ``[..., K/256*66]``: each row is its
super-blocks in order, each the 66 bytes of GGML's ``block_iq2_xxs``
(ggml-common.h), little-endian:

- bytes 0-1: ``d``, fp16;
- then 8 bytes per sub-block of 32 weights (sub-block m at bytes 2 + 8m):
  bytes 0-3 index the 256-entry grid (8 values each from {8, 25, 43}) for
  its groups of 8 weights 0-3; bytes 4-7 are a u32 whose bits 7g .. 7g+6
  index the 128-entry sign table for group g and bits 28-31 hold the 4-bit
  scale ``s``.

value = fp32(fp32(fp32(d * (0.5 + s)) * 0.25) * grid[idx][j]) * (sign bit j ? -1 : +1)

in float32, in that order: what llama.cpp's ``dequantize_row_iq2_xxs`` and
gguf-py's ``IQ2_XXS.dequantize_blocks`` compute, so ``gguf.quants.dequantize``
of a row's bytes equals our decode bit for bit.

The grid is llama.cpp's ``iq2xxs_grid``, read at run time from the ``gguf``
package (``gguf.quants.IQ2_XXS.grid``) and never copied here; the sign table
is the one IQ2_XS shares (``formats.iq2xs.sign_table``).
"""

from __future__ import annotations

import functools
import types

import numpy as np

from .base import FormatInfo, Part
from .ggml_blocks import QK, GGMLBlockFormat, check_blocks, decode_with, f16_table, half_steps, sign_values
from .iq2xs import sign_table
from . import ids

__all__ = ["BLOCK_BYTES", "IQ2XXS", "QK", "check_iq2xxs", "decode_iq2xxs", "decode_iq2xxs_ref", "grid_table"]

BLOCK_BYTES = 2 + 8 * (4 + 4)   # fp16 d + per 32 weights: 4 grid bytes, u32 of 4 x 7 sign bits + scale = 66
GRID_SIZE = 256


@functools.cache
def grid_table() -> np.ndarray:
    """The IQ2_XXS grid: uint8 [256, 8] of 8 / 25 / 43 (llama.cpp ``iq2xxs_grid``, via gguf-py)."""
    from gguf.quants import IQ2_XXS

    IQ2_XXS.init_grid()
    grid = np.asarray(IQ2_XXS.grid, dtype=np.float32).reshape(GRID_SIZE, 8)
    out = grid.astype(np.uint8)
    assert np.array_equal(out, grid) and set(np.unique(out)) == {8, 25, 43}, "unexpected gguf IQ2_XXS grid"
    assert len({tuple(r) for r in out}) == GRID_SIZE, "IQ2_XXS grid points are not distinct"
    out.flags.writeable = False
    return out


@functools.cache
def _decode_tables() -> types.SimpleNamespace:
    t = types.SimpleNamespace(
        grid=grid_table().astype(np.float32), signs=sign_values(sign_table()), f16=f16_table(), half=half_steps(),
    )
    t.grid.flags.writeable = False
    return t


# ------------------------------------------------------------------ kernels
def _decode_kernel(packed, grid, signs, f16, half, out):
    # packed [M, nb*66] u8 -> out [M, nb*256] f32; float32 ops in ggml's order.
    quarter = np.float32(0.25)
    for r in range(packed.shape[0]):
        for b in range(packed.shape[1] // 66):
            o = b * 66
            d = f16[np.int64(packed[r, o]) | (np.int64(packed[r, o + 1]) << 8)]
            for m in range(8):
                p = o + 2 + 8 * m
                aux = (np.int64(packed[r, p + 4]) | (np.int64(packed[r, p + 5]) << 8)
                       | (np.int64(packed[r, p + 6]) << 16) | (np.int64(packed[r, p + 7]) << 24))
                db = (d * half[aux >> 28]) * quarter
                for g in range(4):
                    idx = packed[r, p + g]
                    sg = (aux >> (7 * g)) & 127
                    x0 = b * 256 + 32 * m + 8 * g
                    for j in range(8):
                        out[r, x0 + j] = (db * grid[idx, j]) * signs[sg, j]


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel))


# ---------------------------------------------------------------- functions
def check_iq2xxs(packed, *, name: str | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate IQ2_XXS bytes U8 ``[..., K/256*66]``; return C-contiguous rows ``[M, K/256*66]`` and ``[..., K]``."""
    return check_blocks(packed, BLOCK_BYTES, "IQ2_XXS", name=name)


def decode_iq2xxs(packed, *, name: str | None = None) -> np.ndarray:
    """IQ2_XXS bytes U8 ``[..., K/256*66]`` -> float32 ``[..., K]`` (numba, one thread)."""
    p, shape = check_iq2xxs(packed, name=name)
    t = _decode_tables()
    return decode_with(_kernels().decode, p, shape, t.grid, t.signs, t.f16, t.half)


def decode_iq2xxs_ref(packed, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_iq2xxs`` (same float32 operations, vectorised)."""
    p, shape = check_iq2xxs(packed, name=name)
    t = _decode_tables()
    blocks = p.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)                # [n, 1]
    sub = blocks[:, 2:].reshape(-1, 8, 8)
    idx = sub[:, :, 0:4].astype(np.int64)                                   # [n, 8, 4]
    aux = sub[:, :, 4:8].copy().view("<u4").astype(np.int64)                # [n, 8, 1]
    sg = (aux >> (7 * np.arange(4))) & 127                                   # [n, 8, 4]
    with np.errstate(invalid="ignore", over="ignore"):                       # inf / NaN d stay inf / NaN
        db = (d[:, :, None] * t.half[aux >> 28]) * np.float32(0.25)          # [n, 8, 1]
        vals = (db[..., None] * t.grid[idx]) * t.signs[sg]                   # [n, 8, 4, 8]
    return vals.astype(np.float32).reshape(shape)


# ------------------------------------------------------------------- format
class IQ2XXS(GGMLBlockFormat):
    """``gguf-iq2_xxs``: llama.cpp IQ2_XXS blocks, row-major, one U8 tensor."""

    info = FormatInfo(
        id=ids.GGUF_IQ2_XXS,
        title="llama.cpp IQ2_XXS 2.0625 bpw: fp16 d, 8-bit E8-grid index + 7-bit sign per 8, 4-bit scale per 32",
        block=QK,
        fields=(("fp16 d", 2), ("grid indices: 32 x u8", 32), ("signs + scales: 8 x u32", 32)),
        parts=(Part("packed", ".weight_packed", "U8", (BLOCK_BYTES,)),),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,   # d * (0.5 + s) / 4 * g carries up to 22 significant bits
        spec="docs/formats/iq2_xxs.md#stored-tensors",
        mxfp4_codes=True,
        ggml_type="IQ2_XXS",
        weighted=True,
    )

    label = "IQ2_XXS"
    encoder = "iq2xxs"
    decoders = (decode_iq2xxs, decode_iq2xxs_ref)
