"""float32 -> llama.cpp IQ2_S (2.5625 bpw): the weighted E8-grid search with a 4-bit scale
per 16 weights and free signs, numba.

The stored format (decoder, byte layout, tables) is ``k3ckpt.formats.iq2s``; the search
(``requant.grid_search``, shared with IQ2_XXS) chooses d, per sub-block of 2 groups its
scale, per group of 8 a point of the 1024-point grid and its signs (all 8 stored, so each
is the input's own).  ``encode`` (numba) and ``encode_reference`` (numpy) return identical
bytes.
"""

from __future__ import annotations

import functools

import numpy as np

from . import grid_search
from ._ggml_encode import as_rows, bit_fields
from .grid_search import Codes, Grid

__all__ = ["C_TAU", "GRID", "encode", "encode_reference", "pack", "search_tables"]

BLOCK_BYTES = 82
C_TAU = 0.0366
# One d candidate (0.97) and one least-squares step, not four and two: -0.004 dB on average over the
# benchmark's six SNR cells (tools/bench_llamacpp_quants.py), 17% faster.
GRID = Grid("IQ2_S", group_count=2, parity=False, tau=C_TAU, d_mult=(0.97,), ls_steps=1)


@functools.cache
def search_tables():
    """``grid_search.search_tables`` of ``formats.iq2s.grid_table`` (16 norm classes)."""
    from ..formats.iq2s import grid_table

    return grid_search.search_tables(grid_table(), GRID)


def pack(codes: Codes) -> np.ndarray:
    """Codes -> ``block_iq2_s`` bytes [n, 82]: fp16 d, the index low bytes, the sign bytes, the
    index high bits 4 groups a byte, the scales 2 sub-blocks a byte."""
    n = len(codes.d)
    out = np.zeros((n, BLOCK_BYTES), np.uint8)
    out[:, 0:2] = codes.d.astype("<u2")[:, None].view(np.uint8)
    out[:, 2:34] = codes.index & 255
    out[:, 34:66] = codes.signs
    out[:, 66:74] = bit_fields((codes.index >> 8).reshape(n, 8, 4), 2)
    out[:, 74:82] = codes.scales[:, 0::2] | (codes.scales[:, 1::2] << 4)
    return out


def _bytes(codes: Codes, shape) -> np.ndarray:
    return as_rows(pack(codes), shape)


def encode(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """float32 ``[..., K]`` (K a multiple of 256, finite) -> IQ2_S bytes U8 ``[..., K/256*82]`` (numba, one thread).

    ``imatrix``: importance per column, float ``[K]`` (None: all ones; ``_ggml_encode.check_imatrix``)."""
    return _bytes(*grid_search.search(x, GRID, search_tables(), imatrix=imatrix, name=name))


def encode_reference(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """Numpy twin of ``encode`` (same decisions, same float operations; slow)."""
    return _bytes(*grid_search.search_reference(x, GRID, search_tables(), imatrix=imatrix, name=name))
