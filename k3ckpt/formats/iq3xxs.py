"""llama.cpp IQ3_XXS (``gguf-iq3_xxs``): 3.0625 bpw, 256-weight super-blocks on a 256-point grid of 4-vectors.

Stored per weight ``[..., K]`` (K a multiple of 256; spec: docs/formats/iq3_xxs.md)
as one tensor ``.weight_packed`` U8 ``[..., K/256*98]``: each row is its
super-blocks in order, each the 98 bytes of GGML's ``block_iq3_xxs``
(ggml-common.h), little-endian:

- bytes 0-1: ``d``, fp16;
- bytes 2-65: one byte per 4 weights, indexing the 256-entry grid (4 values each from
  {4, 12, 20, 28, 36, 44, 52, 62});
- bytes 66-97: per sub-block of 32 weights a u32 whose bits 7g .. 7g+6 index the 128-entry
  sign table for its group of 8 weights g (0-3) and bits 28-31 hold the 4-bit scale ``s``.

value = fp32(fp32(fp32(d * (0.5 + s)) * 0.5) * grid[idx][j]) * (sign bit j ? -1 : +1)

in float32, in that order: what llama.cpp's ``dequantize_row_iq3_xxs`` and gguf-py's
``IQ3_XXS.dequantize_blocks`` compute, so ``gguf.quants.dequantize`` of a row's bytes equals
our decode bit for bit.

The grid is llama.cpp's ``iq3xxs_grid``, read at run time from the ``gguf`` package
(``gguf.quants.IQ3_XXS.grid``) and never copied here; the sign table is the one the IQ2 types
share (``formats.iq2xs.sign_table``).
"""

from __future__ import annotations

import functools
import types

import numpy as np

from .base import FormatInfo, Part
from .ggml_blocks import QK, GGMLBlockFormat, check_blocks, decode_with, f16_table, half_steps, sign_values
from .iq2xs import sign_table
from . import ids

__all__ = ["BLOCK_BYTES", "IQ3XXS", "QK", "check_iq3xxs", "decode_iq3xxs", "decode_iq3xxs_ref", "grid_table"]

BLOCK_BYTES = 2 + 64 + 32   # fp16 d, a grid byte per 4 weights, per 32 weights a u32 of 4 x 7 sign bits + scale = 98
GRID_SIZE = 256
GRID_VALUES = (4, 12, 20, 28, 36, 44, 52, 62)


@functools.cache
def grid_table() -> np.ndarray:
    """The IQ3_XXS grid: uint8 [256, 4] of 4, 12, ..., 52, 62 (llama.cpp ``iq3xxs_grid``, via gguf-py)."""
    from gguf.quants import IQ3_XXS

    IQ3_XXS.init_grid()
    grid = np.asarray(IQ3_XXS.grid, dtype=np.float32).reshape(GRID_SIZE, 4)
    out = grid.astype(np.uint8)
    assert np.array_equal(out, grid) and set(np.unique(out)) == set(GRID_VALUES), "unexpected gguf IQ3_XXS grid"
    assert len({tuple(r) for r in out}) == GRID_SIZE, "IQ3_XXS grid points are not distinct"
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
    # packed [M, nb*98] u8 -> out [M, nb*256] f32; float32 ops in ggml's order.
    hlf = np.float32(0.5)
    for r in range(packed.shape[0]):
        for b in range(packed.shape[1] // 98):
            o = b * 98
            d = f16[np.int64(packed[r, o]) | (np.int64(packed[r, o + 1]) << 8)]
            for m in range(8):
                p = o + 66 + 4 * m
                aux = (np.int64(packed[r, p]) | (np.int64(packed[r, p + 1]) << 8)
                       | (np.int64(packed[r, p + 2]) << 16) | (np.int64(packed[r, p + 3]) << 24))
                db = (d * half[aux >> 28]) * hlf
                for g in range(4):
                    sg = (aux >> (7 * g)) & 127
                    for h in range(2):
                        idx = packed[r, o + 2 + 8 * m + 2 * g + h]
                        x0 = b * 256 + 32 * m + 8 * g + 4 * h
                        for j in range(4):
                            out[r, x0 + j] = (db * grid[idx, j]) * signs[sg, 4 * h + j]


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel))


# ---------------------------------------------------------------- functions
def check_iq3xxs(packed, *, name: str | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate IQ3_XXS bytes U8 ``[..., K/256*98]``; return C-contiguous rows ``[M, K/256*98]`` and ``[..., K]``."""
    return check_blocks(packed, BLOCK_BYTES, "IQ3_XXS", name=name)


def decode_iq3xxs(packed, *, name: str | None = None) -> np.ndarray:
    """IQ3_XXS bytes U8 ``[..., K/256*98]`` -> float32 ``[..., K]`` (numba, one thread)."""
    p, shape = check_iq3xxs(packed, name=name)
    t = _decode_tables()
    return decode_with(_kernels().decode, p, shape, t.grid, t.signs, t.f16, t.half)


def decode_iq3xxs_ref(packed, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_iq3xxs`` (same float32 operations, vectorised)."""
    p, shape = check_iq3xxs(packed, name=name)
    t = _decode_tables()
    blocks = p.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)                # [n, 1]
    idx = blocks[:, 2:66].astype(np.int64).reshape(-1, 8, 4, 2)              # [n, 8, 4, 2]
    aux = blocks[:, 66:98].copy().view("<u4").astype(np.int64)              # [n, 8]
    sg = (aux[:, :, None] >> (7 * np.arange(4))) & 127                       # [n, 8, 4]
    sv = t.signs[sg].reshape(-1, 8, 4, 2, 4)                                 # [n, 8, 4, 2, 4]
    with np.errstate(invalid="ignore", over="ignore"):                       # inf / NaN d stay inf / NaN
        db = (d * t.half[aux >> 28]) * np.float32(0.5)                       # [n, 8]
        vals = (db[:, :, None, None, None] * t.grid[idx]) * sv               # [n, 8, 4, 2, 4]
    return vals.astype(np.float32).reshape(shape)


# ------------------------------------------------------------------- format
class IQ3XXS(GGMLBlockFormat):
    """``gguf-iq3_xxs``: llama.cpp IQ3_XXS blocks, row-major, one U8 tensor."""

    info = FormatInfo(
        id=ids.GGUF_IQ3_XXS,
        title="llama.cpp IQ3_XXS 3.0625 bpw: fp16 d, 8-bit grid index per 4, 7-bit sign per 8, 4-bit scale per 32",
        block=QK,
        fields=(("fp16 d", 2), ("grid indices: 64 x u8", 64), ("signs + scales: 8 x u32", 32)),
        parts=(Part("packed", ".weight_packed", "U8", (BLOCK_BYTES,)),),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,   # d * (0.5 + s) / 2 * g carries up to 22 significant bits
        spec="docs/formats/iq3_xxs.md#stored-tensors",
        mxfp4_codes=True,
        ggml_type="IQ3_XXS",
        weighted=True,
    )

    label = "IQ3_XXS"
    encoder = "iq3xxs"
    decoders = (decode_iq3xxs, decode_iq3xxs_ref)
