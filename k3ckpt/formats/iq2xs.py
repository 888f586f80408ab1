"""llama.cpp IQ2_XS (``gguf-iq2_xs``): 2.3125 bpw, 256-weight super-blocks on the E8-lattice grid.

Stored per weight ``[..., K]`` (K a multiple of 256; spec: docs/formats/iq2xs.md)
as one tensor ``.weight_packed`` U8 ``[..., K/256*74]``: each row is its
super-blocks in order, each the 74 bytes of GGML's ``block_iq2_xs``
(ggml-common.h), little-endian:

- bytes 0-1: ``d``, fp16;
- bytes 2-65: ``qs``, 32 x u16; ``qs[g]`` covers weights 8g .. 8g+7: bits 0-8
  index the 512-entry grid (8 values each from {8, 25, 43}), bits 9-15 index
  the 128-entry sign table (8 sign bits with an even count of minus signs);
- bytes 66-73: ``scales``, 4 bits per 16 weights: weights 16m .. 16m+15 use
  the low nibble of byte 66 + m/2 for even m, the high nibble for odd m.

value = fp32(fp32(fp32(d * (0.5 + s)) * 0.25) * grid[idx][j]) * (sign bit j ? -1 : +1)

in float32, in that order: what llama.cpp's ``dequantize_row_iq2_xs`` and
gguf-py's ``IQ2_XS.dequantize_blocks`` compute, so ``gguf.quants.dequantize``
of a row's bytes equals our decode bit for bit.

The grid and sign tables are llama.cpp's data: they are read at run time from
the ``gguf`` package (``gguf.quants.IQ2_XS.grid``, ``IQ2_XXS.ksigns``), never
copied here, which keeps us byte-compatible with whatever llama.cpp ships.
"""

from __future__ import annotations

import functools
import types

import numpy as np

from .base import FormatInfo, Part
from .ggml_blocks import QK, GGMLBlockFormat, check_blocks, decode_with, f16_table, half_steps, sign_values
from . import ids

__all__ = [
    "BLOCK_BYTES",
    "IQ2XS",
    "QK",
    "check_iq2xs",
    "decode_iq2xs",
    "decode_iq2xs_ref",
    "grid_table",
    "sign_table",
]

BLOCK_BYTES = 2 + 2 * 32 + 8   # fp16 d + 32 x u16 qs + 16 x 4-bit scales = 74
GRID_SIZE = 512


# ------------------------------------------------------------------- tables
@functools.cache
def grid_table() -> np.ndarray:
    """The IQ2_XS grid: uint8 [512, 8] of 8 / 25 / 43 (llama.cpp ``iq2xs_grid``, via gguf-py)."""
    from gguf.quants import IQ2_XS

    IQ2_XS.init_grid()
    grid = np.asarray(IQ2_XS.grid, dtype=np.float32).reshape(GRID_SIZE, 8)
    out = grid.astype(np.uint8)
    assert np.array_equal(out, grid) and set(np.unique(out)) == {8, 25, 43}, "unexpected gguf IQ2_XS grid"
    out.flags.writeable = False
    return out


@functools.cache
def sign_table() -> np.ndarray:
    """The sign table: uint8 [128], bit j set = weight j negative (llama.cpp ``ksigns_iq2xs``, via gguf-py).

    Entry i is i with bit 7 set when i has an odd number of ones, so every
    pattern has an even number of minus signs; the encoder relies on that.
    """
    from gguf.quants import IQ2_XXS

    out = np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8).copy()
    i = np.arange(128)
    parity = np.array([bin(v).count("1") & 1 for v in i])
    assert out.shape == (128,) and np.array_equal(out, i | (parity << 7)), "unexpected gguf ksigns table"
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
    # packed [M, nb*74] u8 -> out [M, nb*256] f32; float32 ops in ggml's order.
    quarter = np.float32(0.25)
    for r in range(packed.shape[0]):
        for b in range(packed.shape[1] // 74):
            o = b * 74
            d = f16[np.int64(packed[r, o]) | (np.int64(packed[r, o + 1]) << 8)]
            for ib in range(16):
                sc = (packed[r, o + 66 + ib // 2] >> (4 * (ib & 1))) & 15
                db = (d * half[sc]) * quarter
                for h in range(2):
                    g = 2 * ib + h
                    q = np.int64(packed[r, o + 2 + 2 * g]) | (np.int64(packed[r, o + 3 + 2 * g]) << 8)
                    idx = q & 511
                    sg = q >> 9
                    x0 = b * 256 + 8 * g
                    for j in range(8):
                        out[r, x0 + j] = (db * grid[idx, j]) * signs[sg, j]


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel))


# ---------------------------------------------------------------- functions
def check_iq2xs(packed, *, name: str | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate IQ2_XS bytes U8 ``[..., K/256*74]``; return C-contiguous rows ``[M, K/256*74]`` and ``[..., K]``."""
    return check_blocks(packed, BLOCK_BYTES, "IQ2_XS", name=name)


def decode_iq2xs(packed, *, name: str | None = None) -> np.ndarray:
    """IQ2_XS bytes U8 ``[..., K/256*74]`` -> float32 ``[..., K]`` (numba, one thread)."""
    p, shape = check_iq2xs(packed, name=name)
    t = _decode_tables()
    return decode_with(_kernels().decode, p, shape, t.grid, t.signs, t.f16, t.half)


def decode_iq2xs_ref(packed, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_iq2xs`` (same float32 operations, vectorised)."""
    p, shape = check_iq2xs(packed, name=name)
    t = _decode_tables()
    blocks = p.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)               # [n, 1]
    qs = blocks[:, 2:66].copy().view("<u2").astype(np.int64)               # [n, 32]
    sc = blocks[:, 66:74]
    nib = np.stack([sc & 15, sc >> 4], axis=2).reshape(-1, 16)              # [n, 16], sub-block order
    with np.errstate(invalid="ignore", over="ignore"):                      # inf / NaN d stay inf / NaN
        db = (d * t.half[nib]) * np.float32(0.25)                           # [n, 16] float32
        db = np.repeat(db, 2, axis=1)[:, :, None]                           # [n, 32, 1] per group
        vals = (db * t.grid[qs & 511]) * t.signs[qs >> 9]                   # [n, 32, 8]
    return vals.astype(np.float32).reshape(shape)


# ------------------------------------------------------------------- format
class IQ2XS(GGMLBlockFormat):
    """``gguf-iq2_xs``: llama.cpp IQ2_XS blocks, row-major, one U8 tensor."""

    info = FormatInfo(
        id=ids.GGUF_IQ2_XS,
        title="llama.cpp IQ2_XS 2.3125 bpw: fp16 d, 9-bit E8-grid + 7-bit sign per 8, 4-bit scale per 16",
        block=QK,
        fields=(("fp16 d", 2), ("qs: 32 x u16 grid + sign index", 64), ("4-bit scales", 8)),
        parts=(Part("packed", ".weight_packed", "U8", (BLOCK_BYTES,)),),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,   # d * (0.5 + s) / 4 * g carries up to 22 significant bits
        spec="docs/formats/iq2xs.md#stored-tensors",
        mxfp4_codes=True,
        ggml_type="IQ2_XS",
        weighted=True,
    )

    label = "IQ2_XS"
    encoder = "iq2xs"
    decoders = (decode_iq2xs, decode_iq2xs_ref)
