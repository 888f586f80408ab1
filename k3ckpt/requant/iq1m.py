"""float32 -> llama.cpp IQ1_M (1.75 bpw): the weighted grid search on IQ1_S's ternary grid, with
a 3-bit odd scale per 16 weights and a +-1/8 shift per 8, numba.

The stored format (decoder, byte layout) is ``k3ckpt.formats.iq1m``; the search
(``requant.grid_search``, shared with IQ1_S and the IQ2 types) chooses d, per sub-block of 2
groups its scale ``s`` (step ``d (2 s + 1)``), per group of 8 a point of the 2048-point grid
and its shift (``Grid.shift_per_group``: each group takes the best (shift, class) pair).
``encode`` (numba) and ``encode_reference`` (numpy) return identical bytes.
"""

from __future__ import annotations

import functools

import numpy as np

from . import grid_search
from ._ggml_encode import as_rows, bit_fields
from .grid_search import Codes, Grid

__all__ = ["C_TAU", "GRID", "encode", "encode_reference", "pack", "search_tables"]

BLOCK_BYTES = 56
C_TAU = 1.0
# step d * 2 * (0.5 + s) = d (2 s + 1), s in 0..7; shift index 0: +1/8, 1: -1/8 (the nibble's bit 3).
# One least-squares step, not two: each of the benchmark's six SNR cells within 0.001 dB
# (tools/bench_llamacpp_quants.py), 4% faster.  Two d candidates (0.97, 0.91), not four: each cell
# within 0.003 dB, 9% faster; one alone cost 0.010 dB.
GRID = Grid("IQ1_M", group_count=2, parity=False, tau=C_TAU, levels=(-1, 0, 1), signed=True,
            deltas=(0.125, -0.125), step_unit=2.0, scale_max=7, shift_per_group=True, d_mult=(0.97, 0.91),
            ls_steps=1)


@functools.cache
def search_tables():
    """``grid_search.search_tables`` of IQ1_S's grid (``formats.iq1s.grid_table``)."""
    from ..formats.iq1s import DELTA, grid_table

    assert GRID.deltas == (DELTA, -DELTA)
    return grid_search.search_tables(grid_table(), GRID)


def pack(codes: Codes) -> np.ndarray:
    """Codes -> ``block_iq1_m`` bytes [n, 56]: the index low bytes, per group a nibble of its index's
    high bits and shift sign (two groups a byte, the first low), then four u16 of four 3-bit
    scales each with fp16 d's nibbles on top (u16 k: d's bits 4k .. 4k+3)."""
    n = len(codes.d)
    out = np.zeros((n, BLOCK_BYTES), np.uint8)
    out[:, 0:32] = codes.index & 255
    nib = ((codes.index >> 8) & 7) | (codes.delta << 3)                       # [n, 32]
    out[:, 32:48] = nib[:, 0::2] | (nib[:, 1::2] << 4)
    sc = bit_fields(codes.scales.reshape(n, 4, 4), 3)                          # [n, 4]
    d = codes.d.astype(np.int64)
    sc |= ((d[:, None] >> (4 * np.arange(4))) & 15) << 12
    out[:, 48:56] = sc.astype("<u2").view(np.uint8).reshape(n, 8)
    return out


def _bytes(codes: Codes, shape) -> np.ndarray:
    return as_rows(pack(codes), shape)


def encode(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """float32 ``[..., K]`` (K a multiple of 256, finite) -> IQ1_M bytes U8 ``[..., K/256*56]`` (numba, one thread).

    ``imatrix``: importance per column, float ``[K]`` (None: all ones; ``_ggml_encode.check_imatrix``)."""
    return _bytes(*grid_search.search(x, GRID, search_tables(), imatrix=imatrix, name=name))


def encode_reference(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """Numpy twin of ``encode`` (same decisions, same float operations; slow)."""
    return _bytes(*grid_search.search_reference(x, GRID, search_tables(), imatrix=imatrix, name=name))
