"""IQ2_XS encoder's own checks: the free step against a dense scan, each group's grid point and
signs by brute force, quality on MXFP4-ized Gaussian and Student-t, fp16 rounding.  Its common
checks (kernel == numpy reference bytes, super-blocks alone, symmetry, special blocks, importance,
from_mxfp4, bad input, llama.cpp's quantizer, golden vectors) are in test_formats_ggml_family.py."""

from __future__ import annotations

import numpy as np

from k3ckpt.formats import iq2xs as fmt_mod
from k3ckpt.formats.mxfp4 import decode_pair, encode_pair
from k3ckpt.requant import iq2xs
from k3ckpt.requant.metrics import error_stats


def test_best_free_step_matches_a_dense_scan():
    # Independent check of step 2: the error of a sub-block's two groups at its t* is the least
    # over t (dense scan of the exact per-group minimum over the 22 norm classes, float64).
    t = iq2xs.search_tables()
    nh = 16 * iq2xs.SB_CHUNK
    rng = np.random.default_rng(17)
    norm = t.cls_norm
    bmax = (np.sqrt(norm)[:, None] * rng.uniform(0.2, 1.0, (len(norm), 2 * nh))).astype(np.float32)
    bmax[:, 3] = 0.0                                     # a group with all-zero inputs: B = 0
    tstar = np.empty(nh)
    iq2xs._best_steps(bmax, t.nn, t.inv_nn32, tstar, np.empty(nh, np.float32), np.empty(nh, np.int32))
    b = bmax.astype(np.float64)

    def err(m, tt):                                      # [len(tt)]: both groups' least error at tt
        tt = np.asarray(tt, np.float64)[None, :]
        e = lambda col: (tt * (tt * norm[:, None] - 2.0 * b[:, col][:, None])).min(axis=0)  # noqa: E731
        return e(m) + e(nh + m)

    for m in range(nh):
        grid = np.linspace(0.0, 2.0 * max(tstar[m], 1e-3), 4001)
        assert err(m, [tstar[m]])[0] <= err(m, grid).min() + 1e-9 * abs(err(m, grid).min()), m
        gain = ((b[:, None, m] + b[None, :, nh + m]) ** 2 / t.nn).max()     # float64 over every pair
        assert -err(m, [tstar[m]])[0] >= gain * (1 - 1e-6), m


def test_each_group_is_the_best_grid_point_and_sign_pattern_for_its_scale():
    # Independent brute force: given the block's decoded d and 4-bit scales, every group of 8
    # must hold the least-squares choice among all 512 grid points x 128 even-parity sign patterns.
    rng = np.random.default_rng(12)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    x[0, 256:] = decode_pair(*encode_pair(x[:, 256:]))          # one plain block, one MXFP4 block
    packed = iq2xs.encode(x)
    y = fmt_mod.decode_iq2xs(packed).astype(np.float64).reshape(-1, 8)
    grid = fmt_mod.grid_table().astype(np.float64)
    signs = np.where((fmt_mod.sign_table()[:, None] >> np.arange(8)) & 1, -1.0, 1.0)
    cand = (grid[:, None, :] * signs[None, :, :]).reshape(-1, 8)    # [65536, 8]
    blocks = packed.reshape(-1, 74)
    d = blocks[:, :2].copy().view("<f2").astype(np.float64)[:, 0]
    nib = np.stack([blocks[:, 66:] & 15, blocks[:, 66:] >> 4], axis=2).reshape(-1, 16)
    db = (d[:, None] * (0.5 + nib) / 4).reshape(-1)                   # per 16 weights
    xs = x.astype(np.float64).reshape(-1, 8)
    for g in range(xs.shape[0]):
        err = ((xs[g] - db[g // 2] * cand) ** 2).sum(axis=1)
        ours = ((xs[g] - y[g]) ** 2).sum()
        assert ours <= err.min() * (1 + 1e-6) + 1e-12, (g, ours, err.min())


def test_quality_on_mxfp4_gaussian_and_t5():
    rng = np.random.default_rng(0)
    gauss = rng.standard_normal((24, 3584)).astype(np.float32)
    t5 = (rng.standard_t(5, (24, 3584)) * np.exp(rng.normal(0.0, 0.5, (24, 1)))).astype(np.float32)
    for x, bound in ((gauss, 10.5), (t5, 9.9)):
        src = decode_pair(*encode_pair(x))
        st = error_stats(src, fmt_mod.decode_iq2xs(iq2xs.encode(src)))
        assert st.snr_db > bound, st


def test_round_f16_matches_numpy():
    rng = np.random.default_rng(16)
    v = np.concatenate([
        np.abs(rng.standard_normal(2000)) * 10.0 ** rng.uniform(-9, 5, 2000),
        [0.0, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -24, 2.0 ** -14, 65504.0, 65519.0, 1.0 + 2.0 ** -11,
         1.0 + 3 * 2.0 ** -11, 2048.0 + 1.0, 2048.0 + 3.0],
    ])
    for x in v:
        want = np.float16(min(x, 65504.0))
        q = iq2xs.round_f16(float(x))
        assert q == float(want), x
        assert iq2xs.f16_bits(q) == int(want.view(np.uint16)), x
