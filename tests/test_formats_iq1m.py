"""gguf-iq1_m's own checks: IQ1_S's grid with both shifts in the search tables, the byte layout by
hand (d in the scales' top nibbles), each group's shift.  The family's common checks (decode ==
reference == gguf-py, encoder kernel == reference, quality against IQ1_S, importance, llama.cpp's
quantizer, golden vectors, requant, ...) are in test_formats_ggml_family.py."""

from __future__ import annotations

import numpy as np

from ggml_family import BY_KEY
from k3ckpt.formats import iq1m, iq1s
from k3ckpt.requant import grid_search
from k3ckpt.requant import iq1m as enc

IQ1_M = BY_KEY["iq1m"]


# ---------------------------------------------------------------- tables
def test_grid_is_iq1_s_grid_with_both_shifts():
    t = enc.search_tables()
    grid = iq1s.grid_table()
    assert np.array_equal(t.gt.T, grid[t.order]) and enc.GRID.deltas == (0.125, -0.125)
    assert enc.GRID.shift_per_group and enc.GRID.shift_slots == 32


# ---------------------------------------------------------------- decode
def test_decode_formula_by_hand():
    d_bits = np.array([[np.float16(0.5).view(np.uint16)]], np.uint16)
    packed = IQ1_M.random_blocks(np.random.default_rng(3), 1, 1, d_bits=d_bits)
    got = iq1m.decode_iq1m(packed).reshape(32, 8)
    grid, blk = iq1s.grid_table(), packed[0]
    u16 = [int(blk[48 + 2 * k]) | (int(blk[49 + 2 * k]) << 8) for k in range(4)]
    assert sum((u >> 12) << (4 * k) for k, u in enumerate(u16)) == int(d_bits[0, 0])
    for g in range(32):
        nib = (int(blk[32 + g // 2]) >> (4 * (g % 2))) & 15
        idx = int(blk[g]) | ((nib & 7) << 8)
        delta = -0.125 if nib & 8 else 0.125
        s = (u16[g // 8] >> (3 * ((g // 2) % 4))) & 7
        want = np.float32(np.float32(0.5) * np.float32(2 * s + 1)) * (grid[idx] + np.float32(delta)).astype(np.float32)
        assert np.array_equal(got[g], want.astype(np.float32)), g


# ---------------------------------------------------------------- encode
def test_each_group_takes_the_better_shift():
    # IQ1_M's shift is per group of 8: the search pairs each group's points with both shifts, so with
    # d, the scales and the points kept, the other shift errs more on (almost) every group.
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    codes, _ = grid_search.search(x, enc.GRID, enc.search_tables())
    assert codes.delta.shape == (2, 32) and set(np.unique(codes.delta)) == {0, 1}
    y = iq1m.decode_iq1m(enc.pack(codes)).astype(np.float64)
    flipped = enc.pack(grid_search.Codes(codes.d, codes.index, codes.signs, codes.scales, 1 - codes.delta))
    z = iq1m.decode_iq1m(flipped).astype(np.float64)
    x64 = x.astype(np.float64)
    w = np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + x64 ** 2)
    err = lambda v: (w * (v - x64) ** 2).reshape(2, 32, 8).sum(axis=2)  # noqa: E731
    assert (err(y) <= err(z) * (1 + 1e-9)).mean() > 0.9
