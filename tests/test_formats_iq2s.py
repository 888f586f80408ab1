"""gguf-iq2_s's own checks: the grid and search tables, the byte layout by hand, its free signs.
The family's common checks (decode == reference == gguf-py, encoder kernel == reference, quality
against IQ2_XXS, symmetry, importance, llama.cpp's quantizer, golden vectors, ...) are in
test_formats_ggml_family.py."""

from __future__ import annotations

import numpy as np

from ggml_family import BY_KEY
from k3ckpt.formats import iq2s
from k3ckpt.requant import grid_search
from k3ckpt.requant import iq2s as enc

IQ2_S = BY_KEY["iq2s"]


# ---------------------------------------------------------------- tables
def test_grid_comes_from_gguf_and_has_the_documented_shape():
    grid = iq2s.grid_table()
    assert grid.shape == (1024, 8) and grid.dtype == np.uint8
    assert set(np.unique(grid)) == {8, 25, 43} and len({tuple(r) for r in grid}) == 1024
    t = enc.search_tables()
    assert len(t.cls_norm) == len(np.unique((grid.astype(int) ** 2).sum(axis=1))) == 16
    assert np.array_equal(t.gt.T, grid[t.order]) and np.array_equal(t.gsq, t.gt * t.gt)


# ---------------------------------------------------------------- decode
def test_decode_formula_by_hand():
    d_bits = np.array([[np.float16(0.5).view(np.uint16)]], np.uint16)
    packed = IQ2_S.random_blocks(np.random.default_rng(3), 1, 1, d_bits=d_bits)
    got = iq2s.decode_iq2s(packed).reshape(32, 8)
    grid, blk = iq2s.grid_table(), packed[0]
    for g in range(32):
        idx = int(blk[2 + g]) | (((int(blk[66 + g // 4]) >> (2 * (g % 4))) & 3) << 8)
        m = g // 2                                            # sub-block of 16
        s = (int(blk[74 + m // 2]) >> (4 * (m % 2))) & 15
        sign = np.where((int(blk[34 + g]) >> np.arange(8)) & 1, -1.0, 1.0)
        want = 0.5 * (0.5 + s) / 4 * grid[idx] * sign
        assert np.array_equal(got[g], want.astype(np.float32)), g


# ---------------------------------------------------------------- encode
def test_signs_are_the_inputs_own():
    # All 8 sign bits are stored (no parity rule), so each group's pattern is its inputs' sign
    # bits and every nonzero decoded value has its input's sign.
    rng = np.random.default_rng(13)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    im = np.exp(rng.normal(0, 1, 256)).astype(np.float32)
    b = enc.encode(x, imatrix=im)[0]
    y = iq2s.decode_iq2s(b[None])[0]
    nz = y != 0
    assert nz.sum() > 200 and (np.signbit(y[nz]) == np.signbit(x[0][nz])).all()
    codes, _ = grid_search.search(x, enc.GRID, enc.search_tables(), imatrix=im)
    assert np.array_equal(codes.signs[0], (np.signbit(x[0]).reshape(32, 8) << np.arange(8)).sum(axis=1))
    assert np.array_equal(b[34:66], codes.signs[0])
