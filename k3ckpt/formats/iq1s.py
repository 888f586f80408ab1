"""llama.cpp IQ1_S (``gguf-iq1_s``): 1.5625 bpw, 256-weight super-blocks on a 2048-point ternary grid.

Stored per weight ``[..., K]`` (K a multiple of 256; spec: docs/formats/iq1_s.md)
as one tensor ``.weight_packed`` U8 ``[..., K/256*50]``: each row is its
super-blocks in order, each the 50 bytes of GGML's ``block_iq1_s``
(ggml-common.h), little-endian:

- bytes 0-1: ``d``, fp16;
- bytes 2-33: the low 8 bits of each group's grid index (group g covers
  weights 8g .. 8g+7);
- bytes 34-49: ``qh``, one u16 per sub-block of 32 weights (groups 4m .. 4m+3):
  bits ``3l .. 3l+2`` the index's high 3 bits for its group l, bits 12-14
  the 3-bit scale ``s``, bit 15 the sign of its shift ``delta`` (set: -1/8).

value = fp32(fp32(d * (2 s + 1)) * fp32(grid[idx][j] + delta)),  delta = +-0.125

in float32, in that order: what llama.cpp's ``dequantize_row_iq1_s`` and
gguf-py's ``IQ1_S.dequantize_blocks`` compute, so ``gguf.quants.dequantize``
of a row's bytes equals our decode bit for bit.

The grid (entries -1, 0, 1: the signs are in the grid) is llama.cpp's
``iq1s_grid``, read at run time from the ``gguf`` package
(``gguf.quants.IQ1_S.grid``) and never copied here.
"""

from __future__ import annotations

import functools
import types

import numpy as np

from .base import FormatInfo, Part
from .ggml_blocks import QK, GGMLBlockFormat, check_blocks, decode_with, f16_table
from . import ids

__all__ = ["BLOCK_BYTES", "DELTA", "IQ1S", "QK", "check_iq1s", "decode_iq1s", "decode_iq1s_ref", "grid_table"]

BLOCK_BYTES = 2 + 32 + 16   # fp16 d, low index bytes, 8 x u16 (high index bits, scale, delta sign) = 50
GRID_SIZE = 2048
DELTA = 0.125               # llama.cpp's IQ1S_DELTA


@functools.cache
def grid_table() -> np.ndarray:
    """The IQ1_S grid: int8 [2048, 8] of -1 / 0 / 1 (llama.cpp ``iq1s_grid``, via gguf-py)."""
    from gguf.quants import IQ1_S

    IQ1_S.init_grid()
    grid = np.asarray(IQ1_S.grid, dtype=np.float32).reshape(GRID_SIZE, 8)
    out = grid.astype(np.int8)
    assert np.array_equal(out, grid) and set(np.unique(out)) == {-1, 0, 1}, "unexpected gguf IQ1_S grid"
    assert len({tuple(r) for r in out}) == GRID_SIZE, "IQ1_S grid points are not distinct"
    assert float(IQ1_S.delta) == DELTA, "unexpected gguf IQ1_S delta"
    out.flags.writeable = False
    return out


@functools.cache
def _decode_tables() -> types.SimpleNamespace:
    t = types.SimpleNamespace(grid=grid_table().astype(np.float32), f16=f16_table(),
                              odd=(2 * np.arange(8) + 1).astype(np.float32),
                              delta=np.array([DELTA, -DELTA], np.float32))
    for arr in (t.grid, t.odd, t.delta):
        arr.flags.writeable = False
    return t


# ------------------------------------------------------------------ kernels
def _decode_kernel(packed, grid, f16, odd, delta, out):
    # packed [M, nb*50] u8 -> out [M, nb*256] f32; float32 ops in ggml's order.
    for r in range(packed.shape[0]):
        for b in range(packed.shape[1] // 50):
            o = b * 50
            d = f16[np.int64(packed[r, o]) | (np.int64(packed[r, o + 1]) << 8)]
            for m in range(8):
                qh = np.int64(packed[r, o + 34 + 2 * m]) | (np.int64(packed[r, o + 35 + 2 * m]) << 8)
                dl = d * odd[(qh >> 12) & 7]
                dv = delta[qh >> 15]
                for h in range(4):
                    g = 4 * m + h
                    idx = np.int64(packed[r, o + 2 + g]) | (((qh >> (3 * h)) & 7) << 8)
                    x0 = b * 256 + 8 * g
                    for j in range(8):
                        out[r, x0 + j] = dl * (grid[idx, j] + dv)


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel))


# ---------------------------------------------------------------- functions
def check_iq1s(packed, *, name: str | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate IQ1_S bytes U8 ``[..., K/256*50]``; return C-contiguous rows ``[M, K/256*50]`` and ``[..., K]``."""
    return check_blocks(packed, BLOCK_BYTES, "IQ1_S", name=name)


def decode_iq1s(packed, *, name: str | None = None) -> np.ndarray:
    """IQ1_S bytes U8 ``[..., K/256*50]`` -> float32 ``[..., K]`` (numba, one thread)."""
    p, shape = check_iq1s(packed, name=name)
    t = _decode_tables()
    return decode_with(_kernels().decode, p, shape, t.grid, t.f16, t.odd, t.delta)


def decode_iq1s_ref(packed, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_iq1s`` (same float32 operations, vectorised)."""
    p, shape = check_iq1s(packed, name=name)
    t = _decode_tables()
    blocks = p.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)                # [n, 1]
    qh = blocks[:, 34:50].copy().view("<u2").astype(np.int64)               # [n, 8]
    high = (qh[:, :, None] >> (3 * np.arange(4))) & 7                       # [n, 8, 4]
    idx = blocks[:, 2:34].astype(np.int64).reshape(-1, 8, 4) | (high << 8)  # [n, 8, 4]
    with np.errstate(invalid="ignore", over="ignore"):                      # inf / NaN d stay inf / NaN
        dl = d * t.odd[(qh >> 12) & 7]                                      # [n, 8]
        shifted = t.grid[idx] + t.delta[qh >> 15][:, :, None, None]          # [n, 8, 4, 8]
        vals = dl[:, :, None, None] * shifted
    return vals.astype(np.float32).reshape(shape)


# ------------------------------------------------------------------- format
class IQ1S(GGMLBlockFormat):
    """``gguf-iq1_s``: llama.cpp IQ1_S blocks, row-major, one U8 tensor."""

    info = FormatInfo(
        id=ids.GGUF_IQ1_S,
        title="llama.cpp IQ1_S 1.5625 bpw: fp16 d, 11-bit ternary-grid index per 8, 3-bit scale and +-1/8 shift per 32",
        block=QK,
        fields=(("fp16 d", 2), ("grid index low bytes", 32), ("qh: 8 x u16 high bits, scale, shift", 16)),
        parts=(Part("packed", ".weight_packed", "U8", (BLOCK_BYTES,)),),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,   # d * (2 s + 1) * (g +- 1/8) carries up to 19 significant bits
        spec="docs/formats/iq1_s.md#stored-tensors",
        mxfp4_codes=True,
        ggml_type="IQ1_S",
        weighted=True,
    )

    label = "IQ1_S"
    encoder = "iq1s"
    decoders = (decode_iq1s, decode_iq1s_ref)
