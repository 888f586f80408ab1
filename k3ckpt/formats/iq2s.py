"""llama.cpp IQ2_S (``gguf-iq2_s``): 2.5625 bpw, 256-weight super-blocks on a 1024-point E8 grid.

Stored per weight ``[..., K]`` (K a multiple of 256; spec: docs/formats/iq2_s.md)
as one tensor ``.weight_packed`` U8 ``[..., K/256*82]``: each row is its
super-blocks in order, each the 82 bytes of GGML's ``block_iq2_s``
(ggml-common.h):

- bytes 0-1: ``d``, fp16, little-endian;
- bytes 2-33: the low 8 bits of each group's grid index (group g covers
  weights 8g .. 8g+7);
- bytes 34-65: each group's sign byte (bit j set: weight 8g+j negative; any
  pattern, no parity rule);
- bytes 66-73: ``qh``, the grid indices' high 2 bits: group g's in bits
  ``2(g % 4) .. 2(g % 4)+1`` of byte 66 + g/4;
- bytes 74-81: 4-bit scales per 16 weights: weights 16m .. 16m+15 use the
  low nibble of byte 74 + m/2 for even m, the high nibble for odd m.

value = fp32(fp32(fp32(d * (0.5 + s)) * 0.25) * grid[idx][j]) * (sign bit j ? -1 : +1)

in float32, in that order: what llama.cpp's ``dequantize_row_iq2_s`` and
gguf-py's ``IQ2_S.dequantize_blocks`` compute, so ``gguf.quants.dequantize``
of a row's bytes equals our decode bit for bit.

The grid is llama.cpp's ``iq2s_grid``, read at run time from the ``gguf``
package (``gguf.quants.IQ2_S.grid``) and never copied here.
"""

from __future__ import annotations

import functools
import types

import numpy as np

from .base import FormatInfo, Part
from .ggml_blocks import QK, GGMLBlockFormat, check_blocks, decode_with, f16_table, half_steps
from . import ids

__all__ = ["BLOCK_BYTES", "IQ2S", "QK", "check_iq2s", "decode_iq2s", "decode_iq2s_ref", "grid_table"]

BLOCK_BYTES = 2 + 32 + 32 + 8 + 8   # fp16 d, low index bytes, sign bytes, high index bits, scales = 82
GRID_SIZE = 1024


@functools.cache
def grid_table() -> np.ndarray:
    """The IQ2_S grid: uint8 [1024, 8] of 8 / 25 / 43 (llama.cpp ``iq2s_grid``, via gguf-py)."""
    from gguf.quants import IQ2_S

    IQ2_S.init_grid()
    grid = np.asarray(IQ2_S.grid, dtype=np.float32).reshape(GRID_SIZE, 8)
    out = grid.astype(np.uint8)
    assert np.array_equal(out, grid) and set(np.unique(out)) == {8, 25, 43}, "unexpected gguf IQ2_S grid"
    assert len({tuple(r) for r in out}) == GRID_SIZE, "IQ2_S grid points are not distinct"
    out.flags.writeable = False
    return out


@functools.cache
def _decode_tables() -> types.SimpleNamespace:
    signs = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(-1), np.float32(1))
    t = types.SimpleNamespace(grid=grid_table().astype(np.float32), signs=signs.astype(np.float32),
                              f16=f16_table(), half=half_steps())
    t.grid.flags.writeable = False
    t.signs.flags.writeable = False
    return t


# ------------------------------------------------------------------ kernels
def _decode_kernel(packed, grid, signs, f16, half, out):
    # packed [M, nb*82] u8 -> out [M, nb*256] f32; float32 ops in ggml's order.
    quarter = np.float32(0.25)
    for r in range(packed.shape[0]):
        for b in range(packed.shape[1] // 82):
            o = b * 82
            d = f16[np.int64(packed[r, o]) | (np.int64(packed[r, o + 1]) << 8)]
            for m in range(16):
                sc = (packed[r, o + 74 + m // 2] >> (4 * (m & 1))) & 15
                db = (d * half[sc]) * quarter
                for h in range(2):
                    g = 2 * m + h
                    idx = np.int64(packed[r, o + 2 + g]) | (((np.int64(packed[r, o + 66 + g // 4]) >> (2 * (g % 4)))
                                                             & 3) << 8)
                    sg = packed[r, o + 34 + g]
                    x0 = b * 256 + 8 * g
                    for j in range(8):
                        out[r, x0 + j] = (db * grid[idx, j]) * signs[sg, j]


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel))


# ---------------------------------------------------------------- functions
def check_iq2s(packed, *, name: str | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate IQ2_S bytes U8 ``[..., K/256*82]``; return C-contiguous rows ``[M, K/256*82]`` and ``[..., K]``."""
    return check_blocks(packed, BLOCK_BYTES, "IQ2_S", name=name)


def decode_iq2s(packed, *, name: str | None = None) -> np.ndarray:
    """IQ2_S bytes U8 ``[..., K/256*82]`` -> float32 ``[..., K]`` (numba, one thread)."""
    p, shape = check_iq2s(packed, name=name)
    t = _decode_tables()
    return decode_with(_kernels().decode, p, shape, t.grid, t.signs, t.f16, t.half)


def decode_iq2s_ref(packed, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_iq2s`` (same float32 operations, vectorised)."""
    p, shape = check_iq2s(packed, name=name)
    t = _decode_tables()
    blocks = p.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)                # [n, 1]
    high = (blocks[:, 66:74, None].astype(np.int64) >> (2 * np.arange(4))) & 3
    idx = blocks[:, 2:34].astype(np.int64) | (high.reshape(-1, 32) << 8)     # [n, 32]
    sc = blocks[:, 74:82]
    nib = np.stack([sc & 15, sc >> 4], axis=2).reshape(-1, 16)               # [n, 16], sub-block order
    with np.errstate(invalid="ignore", over="ignore"):                       # inf / NaN d stay inf / NaN
        db = (d * t.half[nib]) * np.float32(0.25)                            # [n, 16]
        db = np.repeat(db, 2, axis=1)[:, :, None]                            # [n, 32, 1] per group
        vals = (db * t.grid[idx]) * t.signs[blocks[:, 34:66]]                # [n, 32, 8]
    return vals.astype(np.float32).reshape(shape)


# ------------------------------------------------------------------- format
class IQ2S(GGMLBlockFormat):
    """``gguf-iq2_s``: llama.cpp IQ2_S blocks, row-major, one U8 tensor."""

    info = FormatInfo(
        id=ids.GGUF_IQ2_S,
        title="llama.cpp IQ2_S 2.5625 bpw: fp16 d, 10-bit E8-grid index + 8 sign bits per 8, 4-bit scale per 16",
        block=QK,
        fields=(("fp16 d", 2), ("grid index low bytes", 32), ("sign bytes", 32), ("grid index high bits", 8),
                ("4-bit scales", 8)),
        parts=(Part("packed", ".weight_packed", "U8", (BLOCK_BYTES,)),),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,   # d * (0.5 + s) / 4 * g carries up to 22 significant bits
        spec="docs/formats/iq2_s.md#stored-tensors",
        mxfp4_codes=True,
        ggml_type="IQ2_S",
        weighted=True,
    )

    label = "IQ2_S"
    encoder = "iq2s"
    decoders = (decode_iq2s, decode_iq2s_ref)
