"""float32 -> llama.cpp IQ1_S (1.5625 bpw): the weighted grid search on IQ1_S's ternary grid,
with a 3-bit odd scale and a +-1/8 shift per 32 weights, numba.

The stored format (decoder, byte layout, tables) is ``k3ckpt.formats.iq1s``; the search
(``requant.grid_search``, shared with IQ2_XXS and IQ2_S) chooses d, per sub-block of 4
groups its scale ``s`` (step ``d (2 s + 1)``) and its shift, per group of 8 a point of the
2048-point grid (entries -1, 0, 1, so the search runs on the signed values and stores no
sign bits).  ``encode`` (numba) and ``encode_reference`` (numpy) return identical bytes.
"""

from __future__ import annotations

import functools

import numpy as np

from . import grid_search
from ._ggml_encode import as_rows, bit_fields
from .grid_search import Codes, Grid

__all__ = ["C_TAU", "GRID", "encode", "encode_reference", "pack", "search_tables"]

BLOCK_BYTES = 50
C_TAU = 1.0         # swept 0.2-3.0 on Gaussian and Student-t data: the weighted SNR peaks near 1
# step d * 2 * (0.5 + s) = d (2 s + 1), s in 0..7; shift index 0: +1/8, 1: -1/8 (qh bit 15).
# One d candidate and one least-squares step, not four and two: +0.002 dB on average over the
# benchmark's six cells (tools/bench_llamacpp_quants.py; -0.001 to +0.009 each), 14% faster.
GRID = Grid("IQ1_S", group_count=4, parity=False, tau=C_TAU, levels=(-1, 0, 1), signed=True,
            deltas=(0.125, -0.125), step_unit=2.0, scale_max=7, d_mult=(0.97,), ls_steps=1)


@functools.cache
def search_tables():
    """``grid_search.search_tables`` of ``formats.iq1s.grid_table`` (39 classes of equal
    ``|g|^2`` and ``sum g``)."""
    from ..formats.iq1s import DELTA, grid_table

    assert GRID.deltas == (DELTA, -DELTA)
    return grid_search.search_tables(grid_table(), GRID)


def pack(codes: Codes) -> np.ndarray:
    """Codes -> ``block_iq1_s`` bytes [n, 50]: fp16 d, the index low bytes, per sub-block a u16
    of its 4 groups' high index bits, its scale (bits 12-14) and its shift's sign (bit 15)."""
    n = len(codes.d)
    out = np.zeros((n, BLOCK_BYTES), np.uint8)
    out[:, 0:2] = codes.d.astype("<u2")[:, None].view(np.uint8)
    out[:, 2:34] = codes.index & 255
    high = bit_fields((codes.index >> 8).reshape(n, 8, 4), 3)
    qh = high | (codes.scales << 12) | (codes.delta << 15)
    out[:, 34:50] = qh.astype("<u2").view(np.uint8).reshape(n, 16)
    return out


def _bytes(codes: Codes, shape) -> np.ndarray:
    return as_rows(pack(codes), shape)


def encode(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """float32 ``[..., K]`` (K a multiple of 256, finite) -> IQ1_S bytes U8 ``[..., K/256*50]`` (numba, one thread).

    ``imatrix``: importance per column, float ``[K]`` (None: all ones; ``_ggml_encode.check_imatrix``)."""
    return _bytes(*grid_search.search(x, GRID, search_tables(), imatrix=imatrix, name=name))


def encode_reference(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """Numpy twin of ``encode`` (same decisions, same float operations; slow)."""
    return _bytes(*grid_search.search_reference(x, GRID, search_tables(), imatrix=imatrix, name=name))
