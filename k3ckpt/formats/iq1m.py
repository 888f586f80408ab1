"""llama.cpp IQ1_M (``gguf-iq1_m``): 1.75 bpw, 256-weight super-blocks on IQ1_S's ternary grid,
a scale per 16 weights and a shift per 8.

Stored per weight ``[..., K]`` (K a multiple of 256; spec: docs/formats/iq1_m.md)
as one tensor ``.weight_packed`` U8 ``[..., K/256*56]``: each row is its
super-blocks in order, each the 56 bytes of GGML's ``block_iq1_m``
(ggml-common.h), little-endian:

- bytes 0-31: the low 8 bits of each group's grid index (group g covers
  weights 8g .. 8g+7);
- bytes 32-47: ``qh``, one byte per two groups: the low nibble for group 2i,
  the high one for group 2i+1, each the index's high 3 bits (bits 0-2) and the
  sign of the group's shift ``delta`` (bit 3, set: -1/8);
- bytes 48-55: four u16; u16 k holds the 3-bit scales of sub-blocks 4k .. 4k+3
  (16 weights each) at bits 0, 3, 6, 9, and bits 4k .. 4k+3 of the fp16 ``d``
  in its top nibble (bits 12-15). There is no other copy of ``d``.

value = fp32(fp32(d * (2 s + 1)) * fp32(grid[idx][j] + delta)),  delta = +-0.125

in float32, in that order: what llama.cpp's ``dequantize_row_iq1_m`` and
gguf-py's ``IQ1_M.dequantize_blocks`` compute, so ``gguf.quants.dequantize``
of a row's bytes equals our decode bit for bit.

The grid is IQ1_S's (``formats.iq1s.grid_table``, read from the ``gguf``
package at run time).
"""

from __future__ import annotations

import functools
import types

import numpy as np

from .base import FormatInfo, Part
from .ggml_blocks import QK, GGMLBlockFormat, check_blocks, decode_with, f16_table
from .iq1s import DELTA, grid_table
from . import ids

__all__ = ["BLOCK_BYTES", "IQ1M", "QK", "check_iq1m", "decode_iq1m", "decode_iq1m_ref"]

BLOCK_BYTES = 32 + 16 + 8   # low index bytes, high bits and shift signs, scales with d's nibbles = 56


@functools.cache
def _decode_tables() -> types.SimpleNamespace:
    from gguf.quants import IQ1_M

    assert float(IQ1_M.delta) == DELTA, "unexpected gguf IQ1_M delta"
    t = types.SimpleNamespace(grid=grid_table().astype(np.float32), f16=f16_table(),
                              odd=(2 * np.arange(8) + 1).astype(np.float32),
                              delta=np.array([DELTA, -DELTA], np.float32))
    for arr in (t.grid, t.odd, t.delta):
        arr.flags.writeable = False
    return t


# ------------------------------------------------------------------ kernels
def _decode_kernel(packed, grid, f16, odd, delta, out):
    # packed [M, nb*56] u8 -> out [M, nb*256] f32; float32 ops in ggml's order.
    for r in range(packed.shape[0]):
        for b in range(packed.shape[1] // 56):
            o = b * 56
            bits = 0
            for k in range(4):
                sc = np.int64(packed[r, o + 48 + 2 * k]) | (np.int64(packed[r, o + 49 + 2 * k]) << 8)
                bits |= (sc >> 12) << (4 * k)
            d = f16[bits]
            for s in range(16):
                k = s // 4
                sc = np.int64(packed[r, o + 48 + 2 * k]) | (np.int64(packed[r, o + 49 + 2 * k]) << 8)
                dl = d * odd[(sc >> (3 * (s % 4))) & 7]
                for h in range(2):
                    g = 2 * s + h
                    nib = (np.int64(packed[r, o + 32 + g // 2]) >> (4 * (g % 2))) & 15
                    idx = np.int64(packed[r, o + g]) | ((nib & 7) << 8)
                    dv = delta[nib >> 3]
                    x0 = b * 256 + 8 * g
                    for j in range(8):
                        out[r, x0 + j] = dl * (grid[idx, j] + dv)


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel))


# ---------------------------------------------------------------- functions
def check_iq1m(packed, *, name: str | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate IQ1_M bytes U8 ``[..., K/256*56]``; return C-contiguous rows ``[M, K/256*56]`` and ``[..., K]``."""
    return check_blocks(packed, BLOCK_BYTES, "IQ1_M", name=name)


def decode_iq1m(packed, *, name: str | None = None) -> np.ndarray:
    """IQ1_M bytes U8 ``[..., K/256*56]`` -> float32 ``[..., K]`` (numba, one thread)."""
    p, shape = check_iq1m(packed, name=name)
    t = _decode_tables()
    return decode_with(_kernels().decode, p, shape, t.grid, t.f16, t.odd, t.delta)


def decode_iq1m_ref(packed, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_iq1m`` (same float32 operations, vectorised)."""
    p, shape = check_iq1m(packed, name=name)
    t = _decode_tables()
    blocks = p.reshape(-1, BLOCK_BYTES)
    sc = blocks[:, 48:56].copy().view("<u2").astype(np.int64)              # [n, 4]
    dbits = ((sc >> 12) << (4 * np.arange(4))).sum(axis=1)                  # [n]
    d = t.f16[dbits][:, None]                                               # [n, 1]
    scales = ((sc[:, :, None] >> (3 * np.arange(4))) & 7).reshape(-1, 16)   # [n, 16]
    nib = (blocks[:, 32:48, None].astype(np.int64) >> np.array([0, 4])) & 15
    nib = nib.reshape(-1, 32)                                               # [n, 32]
    idx = blocks[:, 0:32].astype(np.int64) | ((nib & 7) << 8)               # [n, 32]
    with np.errstate(invalid="ignore", over="ignore"):                      # inf / NaN d stay inf / NaN
        dl = np.repeat(d * t.odd[scales], 2, axis=1)                        # [n, 32]: per group
        shifted = t.grid[idx] + t.delta[nib >> 3][:, :, None]               # [n, 32, 8]
        vals = dl[:, :, None] * shifted
    return vals.astype(np.float32).reshape(shape)


# ------------------------------------------------------------------- format
class IQ1M(GGMLBlockFormat):
    """``gguf-iq1_m``: llama.cpp IQ1_M blocks, row-major, one U8 tensor."""

    info = FormatInfo(
        id=ids.GGUF_IQ1_M,
        title="llama.cpp IQ1_M 1.75 bpw: 11-bit ternary-grid index and +-1/8 shift per 8, 3-bit scale per 16, "
              "fp16 d in the scales' top nibbles",
        block=QK,
        fields=(("grid index low bytes", 32), ("qh: high index bits and shift signs", 16),
                ("scales: 4 x u16, 3-bit scales and d's nibbles", 8)),
        parts=(Part("packed", ".weight_packed", "U8", (BLOCK_BYTES,)),),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,   # d * (2 s + 1) * (g +- 1/8) carries up to 19 significant bits
        spec="docs/formats/iq1_m.md#stored-tensors",
        mxfp4_codes=True,
        ggml_type="IQ1_M",
        weighted=True,
    )

    label = "IQ1_M"
    encoder = "iq1m"
    decoders = (decode_iq1m, decode_iq1m_ref)
