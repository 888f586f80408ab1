"""gguf-iq2_xs's own checks: the grid and sign tables, the byte layout by hand.  The family's
common checks (decode == reference == gguf-py, shapes, encoder kernel == reference, importance,
llama.cpp's quantizer, golden vectors, ...) are in test_formats_ggml_family.py; the encoder's own
search in test_requant_iq2xs.py."""

from __future__ import annotations

import numpy as np

from ggml_family import BY_KEY
from k3ckpt.formats import iq2xs

IQ2_XS = BY_KEY["iq2xs"]


# ---------------------------------------------------------------- tables
def test_tables_come_from_gguf_and_have_the_documented_shape():
    grid = iq2xs.grid_table()
    assert grid.shape == (512, 8) and grid.dtype == np.uint8
    assert set(np.unique(grid)) == {8, 25, 43}
    assert len({tuple(r) for r in grid}) == 512
    signs = iq2xs.sign_table()
    popcount = np.array([bin(int(v)).count("1") for v in signs])
    assert signs.shape == (128,) and np.all(popcount % 2 == 0)
    assert np.array_equal(signs & 127, np.arange(128))


# ---------------------------------------------------------------- decode
def test_decode_formula_by_hand():
    # one block: d = 0.5, sub-block scale nibbles 0..15, qs[g] = grid index g | sign index (g % 128) << 9
    d_bits = np.array([[np.float16(0.5).view(np.uint16)]], np.uint16)
    packed = IQ2_XS.random_blocks(np.random.default_rng(3), 1, 1, d_bits=d_bits)
    qs = (np.arange(32) * 13 % 512) | ((np.arange(32) * 5 % 128) << 9)
    packed[0, 2:66] = qs.astype("<u2").view(np.uint8)
    packed[0, 66:74] = np.array([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], np.uint8)
    got = iq2xs.decode_iq2xs(packed).reshape(32, 8)
    grid, signs = iq2xs.grid_table(), iq2xs.sign_table()
    for g in range(32):
        s = g // 2                                    # the nibbles above put scale m on sub-block m
        sign = np.where((signs[qs[g] >> 9] >> np.arange(8)) & 1, -1.0, 1.0)
        want = 0.5 * (0.5 + s) / 4 * grid[qs[g] & 511] * sign
        assert np.array_equal(got[g], want.astype(np.float32)), g
