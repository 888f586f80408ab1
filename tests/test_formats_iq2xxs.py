"""gguf-iq2_xxs's own checks: the grid and search tables, the byte layout by hand, each group's
sign pattern.  The family's common checks (decode == reference == gguf-py, encoder kernel ==
reference, quality, symmetry, importance, llama.cpp's quantizer, golden vectors, ...) are in
test_formats_ggml_family.py."""

from __future__ import annotations

import numpy as np

from ggml_family import BY_KEY
from k3ckpt.formats import iq2xxs
from k3ckpt.formats.iq2xs import sign_table
from k3ckpt.requant import iq2xxs as enc

IQ2_XXS = BY_KEY["iq2xxs"]


# ---------------------------------------------------------------- tables
def test_grid_comes_from_gguf_and_has_the_documented_shape():
    grid = iq2xxs.grid_table()
    assert grid.shape == (256, 8) and grid.dtype == np.uint8
    assert set(np.unique(grid)) == {8, 25, 43} and len({tuple(r) for r in grid}) == 256
    t = enc.search_tables()
    assert len(t.cls_norm) == len(np.unique((grid.astype(int) ** 2).sum(axis=1))) == 12
    assert np.array_equal(t.gt.T, grid[t.order]) and np.array_equal(t.gsq, t.gt * t.gt)


# ---------------------------------------------------------------- decode
def test_decode_formula_by_hand():
    d_bits = np.array([[np.float16(0.5).view(np.uint16)]], np.uint16)
    packed = IQ2_XXS.random_blocks(np.random.default_rng(3), 1, 1, d_bits=d_bits)
    got = iq2xxs.decode_iq2xxs(packed).reshape(8, 4, 8)
    grid, signs = iq2xxs.grid_table(), sign_table()
    for m in range(8):
        sub = packed[0, 2 + 8 * m:10 + 8 * m]
        aux = int.from_bytes(bytes(sub[4:8]), "little")
        for h in range(4):
            sg = (aux >> (7 * h)) & 127
            sign = np.where((signs[sg] >> np.arange(8)) & 1, -1.0, 1.0)
            want = 0.5 * (0.5 + (aux >> 28)) / 4 * grid[sub[h]] * sign
            assert np.array_equal(got[m, h], want.astype(np.float32)), (m, h)


# ---------------------------------------------------------------- encode
def test_each_group_has_the_best_signs_for_its_point():
    # For the decoded point and step of each group, the stored sign pattern has the least weighted
    # error of all 128 allowed patterns (brute force), and follows the inputs' signs but for at
    # most one flip (the parity rule).
    rng = np.random.default_rng(13)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    im = np.exp(rng.normal(0, 1, 256)).astype(np.float32)
    b = enc.encode(x, imatrix=im)[0]
    y = iq2xxs.decode_iq2xxs(b[None])[0].astype(np.float64)
    grid = iq2xxs.grid_table().astype(np.float64)
    signs = sign_table()
    patterns = np.where((signs[:, None] >> np.arange(8)) & 1, -1.0, 1.0)       # [128, 8]
    xs = x[0].astype(np.float64)
    w = im * np.sqrt((xs ** 2).mean() + xs ** 2)
    for g in range(32):
        m, h = divmod(g, 4)
        idx = b[2 + 8 * m + h]
        cols = slice(8 * g, 8 * g + 8)
        mag = np.abs(y[cols])                                  # t * grid[idx]
        errs = (w[cols] * (patterns * mag - xs[cols]) ** 2).sum(axis=1)
        got = (w[cols] * (y[cols] - xs[cols]) ** 2).sum()
        assert got <= errs.min() * (1 + 1e-12) + 1e-15, g
        assert np.allclose(mag / mag.max(), grid[idx] / grid[idx].max())
        assert ((y[cols] < 0) != np.signbit(x[0, cols])).sum() <= 1
