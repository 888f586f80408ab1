"""gguf-iq1_s's own checks: the grid and search tables, the byte layout by hand, each sub-block's
shift.  The family's common checks (decode == reference == gguf-py, encoder kernel == reference,
quality, importance, llama.cpp's quantizer, golden vectors, ...) are in test_formats_ggml_family.py."""

from __future__ import annotations

import numpy as np

from ggml_family import BY_KEY
from k3ckpt.formats import iq1s
from k3ckpt.requant import grid_search
from k3ckpt.requant import iq1s as enc

IQ1_S = BY_KEY["iq1s"]


# ---------------------------------------------------------------- tables
def test_grid_comes_from_gguf_and_has_the_documented_shape():
    grid = iq1s.grid_table()
    assert grid.shape == (2048, 8) and grid.dtype == np.int8
    assert set(np.unique(grid)) == {-1, 0, 1} and len({tuple(r) for r in grid}) == 2048
    t = enc.search_tables()
    keys = {(int((r != 0).sum()), int(r.sum())) for r in grid}
    assert len(t.cls_norm) == len(keys) == 39
    assert np.array_equal(t.gt.T, grid[t.order]) and enc.GRID.deltas == (0.125, -0.125)
    for c in range(len(t.cls_norm)):                  # a class: equal |g|^2 and sum g
        pts = grid[t.order[t.cls_start[c]:t.cls_start[c + 1]]].astype(int)
        assert len({(int((p * p).sum()), int(p.sum())) for p in pts}) == 1


# ---------------------------------------------------------------- decode
def test_decode_formula_by_hand():
    d_bits = np.array([[np.float16(0.5).view(np.uint16)]], np.uint16)
    packed = IQ1_S.random_blocks(np.random.default_rng(3), 1, 1, d_bits=d_bits)
    got = iq1s.decode_iq1s(packed).reshape(32, 8)
    grid, blk = iq1s.grid_table(), packed[0]
    for g in range(32):
        m, h = divmod(g, 4)
        qh = int(blk[34 + 2 * m]) | (int(blk[35 + 2 * m]) << 8)
        idx = int(blk[2 + g]) | (((qh >> (3 * h)) & 7) << 8)
        delta = -0.125 if qh >> 15 else 0.125
        want = 0.5 * (2 * ((qh >> 12) & 7) + 1) * (grid[idx] + delta)
        assert np.array_equal(got[g], want.astype(np.float32)), g


# ---------------------------------------------------------------- encode
def test_each_sub_block_takes_the_better_shift():
    # The search compares both shifts, each with its own points, at every candidate step; so with
    # d, the scales and the points kept, the other shift errs more on (almost) every sub-block.
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    codes, _ = grid_search.search(x, enc.GRID, enc.search_tables())
    assert set(np.unique(codes.delta)) == {0, 1}       # both shifts are used
    packed = enc.pack(codes)
    y = iq1s.decode_iq1s(packed).astype(np.float64)
    flipped = enc.pack(grid_search.Codes(codes.d, codes.index, codes.signs, codes.scales, 1 - codes.delta))
    z = iq1s.decode_iq1s(flipped).astype(np.float64)
    x64 = x.astype(np.float64)
    w = np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + x64 ** 2)
    err = lambda v: (w * (v - x64) ** 2).reshape(2, 8, 32).sum(axis=2)  # noqa: E731
    assert (err(y) <= err(z) * (1 + 1e-9)).mean() > 0.9
