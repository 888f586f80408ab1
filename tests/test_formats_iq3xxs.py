"""gguf-iq3_xxs's own checks: the grid and the cells' nearest points, the byte layout by hand,
the kernel against the reference on more blocks, the point search and the signs.  The family's
common checks (decode == reference == gguf-py, encoder kernel == reference, quality against IQ2_S,
symmetry, importance, llama.cpp's quantizer, golden vectors, requant, ...) are in
test_formats_ggml_family.py."""

from __future__ import annotations

import numpy as np

from ggml_family import BY_KEY
from k3ckpt.formats import iq3xxs
from k3ckpt.formats.iq2xs import sign_table
from k3ckpt.requant import iq3xxs as enc

IQ3_XXS = BY_KEY["iq3xxs"]


def weights(x: np.ndarray, imatrix=None) -> np.ndarray:
    """ggml's IQ3_XXS weights per super-block: imatrix * sqrt(2 mean x^2 + x^2)."""
    x64 = x.astype(np.float64).reshape(-1, 256)
    q = np.ones(256) if imatrix is None else np.asarray(imatrix, np.float64).reshape(-1, 256)
    return (q * np.sqrt(2 * (x64 ** 2).mean(axis=1, keepdims=True) + x64 ** 2)).reshape(x.shape)


# ---------------------------------------------------------------- tables
def test_grid_comes_from_gguf_and_has_the_documented_shape():
    grid = iq3xxs.grid_table()
    assert grid.shape == (256, 4) and grid.dtype == np.uint8 and not grid.flags.writeable
    assert sorted(set(grid.reshape(-1).tolist())) == [4, 12, 20, 28, 36, 44, 52, 62]
    from gguf.quants import IQ3_XXS

    assert np.array_equal(grid.astype(np.float32), np.asarray(IQ3_XXS.grid, np.float32).reshape(256, 4))


def test_each_cell_tries_its_nearest_grid_points_its_own_first():
    t = enc.search_tables()
    grid = iq3xxs.grid_table().astype(np.int64)
    levels = np.asarray(enc.LEVELS)
    cand = t.cand.reshape(4096, enc.NEAREST) // 4
    assert np.array_equal(t.gf.reshape(256, 4), grid.astype(np.float32))
    # the packed copy the kernel reads: candidate c's value j is byte j of its word
    unpacked = (t.cpk.astype(np.int64)[:, None] >> (8 * np.arange(4))) & 255
    assert np.array_equal(unpacked, grid[cand.reshape(-1)])
    rng = np.random.default_rng(4)
    for u in list(rng.integers(0, 4096, 200)) + [0, 4095]:
        cell = levels[[(u >> (3 * j)) & 7 for j in range(4)]]
        dist = ((grid - cell) ** 2).sum(axis=1)
        assert np.array_equal(dist[cand[u]], np.sort(dist)[:enc.NEAREST]), u      # the 8 nearest, nearest first
        on = np.flatnonzero(dist == 0)
        if len(on):
            assert cand[u, 0] == on[0]


def test_cells_count_the_level_bounds_at_every_boundary():
    """The kernel's cell (floor / clamp arithmetic) is each weight's count of BOUNDS at or below
    y / t, the reference's rule, on and around every bound, below zero and far above the top."""
    bounds = np.asarray(enc.BOUNDS, np.float32)
    near = np.concatenate([bounds, np.nextafter(bounds, np.float32(-1)), np.nextafter(bounds, np.float32(99)),
                           np.float32([-5.0, -0.0, 0.0, 55.99, 56.0, 56.5, 63.0, 1e30])])
    rng = np.random.default_rng(8)
    y = np.concatenate([near, rng.uniform(-10, 80, 4 * 256 - len(near)).astype(np.float32)])
    y4 = y.reshape(4, 256)
    for t in (np.float32(1.0), np.float32(0.37), np.float32(3.0)):
        tl = np.full(256, t, np.float32)
        cell = np.empty(256, np.int64)
        enc._cells(y4, tl, cell)
        v = y4 * (np.float32(1.0) / tl)
        lv = sum((v >= b).astype(np.int64) for b in bounds)
        assert np.array_equal(cell, lv[0] + (lv[1] << 3) + (lv[2] << 6) + (lv[3] << 9))


# ---------------------------------------------------------------- decode
def test_decode_formula_by_hand():
    d_bits = np.array([[np.float16(0.5).view(np.uint16)]], np.uint16)
    packed = IQ3_XXS.random_blocks(np.random.default_rng(3), 1, 1, d_bits=d_bits)
    got = iq3xxs.decode_iq3xxs(packed).reshape(8, 4, 8)
    grid, signs = iq3xxs.grid_table(), sign_table()
    blk = packed[0]
    for m in range(8):
        aux = int.from_bytes(bytes(blk[66 + 4 * m:70 + 4 * m]), "little")
        for g in range(4):
            sg = (aux >> (7 * g)) & 127
            sign = np.where((signs[sg] >> np.arange(8)) & 1, -1.0, 1.0)
            pts = np.concatenate([grid[blk[2 + 8 * m + 2 * g]], grid[blk[3 + 8 * m + 2 * g]]])
            want = 0.5 * (0.5 + (aux >> 28)) / 2 * pts * sign
            assert np.array_equal(got[m, g], want.astype(np.float32)), (m, g)


# ---------------------------------------------------------------- encode
def test_kernel_and_reference_agree_on_many_blocks():
    rng = np.random.default_rng(14)
    x = np.concatenate([rng.standard_normal((4, 1024)), rng.standard_t(3, (4, 1024)) * 0.02,
                        rng.laplace(size=(4, 1024)) * 1e-5]).astype(np.float32)
    im = np.exp(rng.normal(0, 1.5, 1024)).astype(np.float32)
    for q in (None, im):
        assert np.array_equal(enc.encode(x, imatrix=q), enc.encode_reference(x, imatrix=q))


def test_each_half_group_has_the_best_of_its_cells_candidates_and_signs_follow_the_inputs():
    # At the decoded step of each sub-block, every half-group's point errs no more than any other
    # of the 8 grid points nearest its cell (and no more than every grid point when that cell is on
    # the grid), and the stored signs are the inputs' but for at most one flip per group of 8, on
    # the element the parity rule flips (the least w x^2).
    rng = np.random.default_rng(13)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    im = np.exp(rng.normal(0, 1, 256)).astype(np.float32)
    b = enc.encode(x, imatrix=im)[0]
    y = iq3xxs.decode_iq3xxs(b[None])[0].astype(np.float64)
    grid = iq3xxs.grid_table().astype(np.float64)
    cand = enc.search_tables().cand.reshape(4096, enc.NEAREST) // 4
    w = weights(x, im)[0]
    xs = x[0].astype(np.float64)
    d = float(np.frombuffer(bytes(b[0:2]), "<f2")[0])
    for g in range(32):
        cols = slice(8 * g, 8 * g + 8)
        flips = (y[cols] < 0) != np.signbit(x[0, cols])
        assert flips.sum() == np.signbit(x[0, cols]).sum() % 2
        if flips.any():
            c = w[cols] * xs[cols] ** 2
            assert np.flatnonzero(flips)[0] == np.argmin(c)
    for k in range(64):
        m = k // 8
        aux = int.from_bytes(bytes(b[66 + 4 * m:70 + 4 * m]), "little")
        t = d * (0.5 + (aux >> 28)) * 0.5
        cols = slice(4 * k, 4 * k + 4)
        target = np.where((y[cols] < 0) == (xs[cols] < 0), np.abs(xs[cols]), -np.abs(xs[cols]))
        err = lambda p: (w[cols] * (t * grid[p] - target) ** 2).sum()  # noqa: E731
        v = target / t
        lv = sum((v >= bnd).astype(int) for bnd in enc.BOUNDS)
        u = int((lv << (3 * np.arange(4))).sum())
        chosen = int(b[2 + k])
        assert err(chosen) <= min(err(p) for p in cand[u]) * (1 + 1e-6) + 1e-12, k
        if (grid[cand[u, 0]] == np.asarray(enc.LEVELS)[lv]).all():          # the cell is on the grid
            assert err(chosen) <= min(err(p) for p in range(256)) * (1 + 1e-6) + 1e-12, k
