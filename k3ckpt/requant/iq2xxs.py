"""float32 -> llama.cpp IQ2_XXS (2.0625 bpw): the weighted E8-grid search with a 4-bit scale
per 32 weights and the parity rule, numba.

The stored format (decoder, byte layout, tables) is ``k3ckpt.formats.iq2xxs``; the
search (``requant.grid_search``, shared with IQ2_S) chooses d, per sub-block of 4 groups
its scale, per group of 8 a point of the 256-point grid and a sign pattern with an
even number of minus signs (7 bits stored).  ``encode`` (numba) and
``encode_reference`` (numpy) return identical bytes.
"""

from __future__ import annotations

import functools

import numpy as np

from . import grid_search
from ._ggml_encode import as_rows, bit_fields
from .grid_search import ALT, SB_CHUNK, Codes, Grid

__all__ = ["ALT", "C_TAU", "GRID", "SB_CHUNK", "encode", "encode_reference", "pack", "search_tables"]

BLOCK_BYTES = 66
C_TAU = 0.0366      # the median of t* / RMS on Gaussian and Student-t data
# One d candidate: against the default four, -0.002 dB on average over the benchmark's six cells
# (tools/bench_llamacpp_quants.py) for 10% of the time.  One least-squares step after it, not
# two: +0.004 dB on average there (the steps minimise the weighted error, not the SNR), 3% faster.
GRID = Grid("IQ2_XXS", group_count=4, parity=True, tau=C_TAU, d_mult=(0.97,), ls_steps=1)


@functools.cache
def search_tables():
    """``grid_search.search_tables`` of ``formats.iq2xxs.grid_table`` (12 norm classes)."""
    from ..formats.iq2xxs import grid_table

    return grid_search.search_tables(grid_table(), GRID)


def pack(codes: Codes) -> np.ndarray:
    """Codes -> ``block_iq2_xxs`` bytes [n, 66]: fp16 d, then per sub-block its 4 grid bytes and
    a u32 of 4 x 7 sign bits and the scale in bits 28-31."""
    n = len(codes.d)
    out = np.zeros((n, BLOCK_BYTES), np.uint8)
    out[:, 0:2] = codes.d.astype("<u2")[:, None].view(np.uint8)
    sub = out[:, 2:].reshape(n, 8, 8)
    sub[:, :, 0:4] = codes.index.reshape(n, 8, 4)
    aux = (codes.scales << 28) | bit_fields(codes.signs.reshape(n, 8, 4) & 127, 7)
    sub[:, :, 4:8] = aux.astype("<u4")[:, :, None].view(np.uint8)
    return out


def _bytes(codes: Codes, shape) -> np.ndarray:
    return as_rows(pack(codes), shape)


def encode(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """float32 ``[..., K]`` (K a multiple of 256, finite) -> IQ2_XXS bytes U8 ``[..., K/256*66]`` (numba, one thread).

    ``imatrix``: importance per column, float ``[K]`` (None: all ones; ``_ggml_encode.check_imatrix``)."""
    return _bytes(*grid_search.search(x, GRID, search_tables(), imatrix=imatrix, name=name))


def encode_reference(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """Numpy twin of ``encode`` (same decisions, same float operations; slow)."""
    return _bytes(*grid_search.search_reference(x, GRID, search_tables(), imatrix=imatrix, name=name))
