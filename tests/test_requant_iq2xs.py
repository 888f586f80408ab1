"""IQ2_XS encoder: kernel == numpy reference bytes, per-group optimality, quality, symmetry, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from k3ckpt.errors import NaNScaleError, ShapeError
from k3ckpt.formats import iq2xs as fmt_mod
from k3ckpt.formats.base import get_format
from k3ckpt.formats.mxfp4 import decode_pair, encode_pair
from k3ckpt.requant import iq2xs
from k3ckpt.requant.metrics import error_stats


@pytest.fixture(scope="module")
def fmt():
    return get_format("gguf-iq2_xs")


def small_inputs() -> dict[str, np.ndarray]:
    """A few super-blocks each of awkward and ordinary data (kept small: the reference is slow)."""
    rng = np.random.default_rng(11)
    gauss = rng.standard_normal((2, 512)).astype(np.float32)
    t5 = (rng.standard_t(5, (1, 512)) * 0.013).astype(np.float32)
    p, s = encode_pair(rng.standard_normal((1, 512)).astype(np.float32))
    mx = decode_pair(p, s)
    mx[0, :40] = -0.0                                   # signed zeros, a sub-block of only zeros
    sparse = np.zeros((1, 512), np.float32)
    sparse[0, [5, 77, 300]] = [2.0, -3.0, 1e-3]          # second block: one value; first: two
    tiny = (rng.standard_normal((1, 256)) * 1e-9).astype(np.float32)  # below fp16's reach: zeros
    huge = (rng.standard_normal((1, 256)) * 1e30).astype(np.float32)  # d clamps to 65504
    mixed = rng.standard_normal((1, 256)).astype(np.float32)
    mixed[0, 128:] *= 1e-4                                  # 16 sub-blocks with very different scales
    subnormal = np.full((1, 256), 2.0 ** -20, np.float32)
    subnormal[0, ::3] = -(2.0 ** -22)
    return {"gauss": gauss, "t5": t5, "mxfp4": mx, "sparse": sparse, "tiny": tiny, "huge": huge,
            "mixed": mixed, "subnormal": subnormal, "zeros": np.zeros((1, 256), np.float32)}


@pytest.mark.parametrize("name", list(small_inputs()))
def test_kernel_and_reference_bytes_identical(name):
    x = small_inputs()[name]
    got = iq2xs.encode(x)
    assert got.shape == x.shape[:-1] + (x.shape[-1] // 256 * 74,) and got.dtype == np.uint8
    assert np.array_equal(got, iq2xs.encode_reference(x))


def test_super_blocks_are_independent_of_their_search_chunk():
    # The kernel searches iq2xs.SB_CHUNK super-blocks at once as SIMD lanes; each block's bytes
    # must not depend on its neighbours or on its position in a chunk (7 blocks: a partial
    # chunk too), whatever the neighbours hold (zeros, tiny, huge, subnormal, plain).
    x = small_inputs()
    blocks = np.concatenate([x["gauss"][0, :256], x["zeros"][0], x["huge"][0], x["t5"][0, 256:],
                             x["tiny"][0], x["subnormal"][0], x["mxfp4"][0, :256]]).reshape(1, 7 * 256)
    got = iq2xs.encode(blocks).reshape(-1, 74)
    alone = np.stack([iq2xs.encode(b[None, :])[0] for b in blocks.reshape(-1, 256)])
    assert np.array_equal(got, alone)
    assert np.array_equal(got[::-1], iq2xs.encode(blocks.reshape(-1, 256)[::-1].reshape(1, -1)).reshape(-1, 74))
    assert np.array_equal(got.reshape(1, -1), iq2xs.encode_reference(blocks))


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


def test_zero_and_tiny_blocks_encode_as_zero_bytes():
    x = small_inputs()
    assert not iq2xs.encode(x["zeros"]).any()
    assert not iq2xs.encode(x["tiny"]).any()


def test_huge_values_clamp_d_to_fp16_max():
    packed = iq2xs.encode(small_inputs()["huge"])
    assert packed[0, :2].copy().view("<f2")[0] == np.float16(65504)


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


def test_sign_symmetric_no_bias():
    # encode(-x) decodes to exactly -decode(encode(x)), signed zeros included, so the mean
    # error over x and -x together is exactly zero.
    rng = np.random.default_rng(13)
    x = decode_pair(*encode_pair(rng.standard_normal((8, 1024)).astype(np.float32)))
    y = fmt_mod.decode_iq2xs(iq2xs.encode(x))
    y_neg = fmt_mod.decode_iq2xs(iq2xs.encode(-x))
    assert np.array_equal((-y).view(np.uint32), y_neg.view(np.uint32))
    both = error_stats(np.concatenate([x, -x]), np.concatenate([y, y_neg]))
    assert both.mean_bias == 0.0
    assert abs(error_stats(x, y).bias_rel_rms) < 5e-3   # one side alone: sampling noise only


def test_from_mxfp4_equals_encoding_the_decoded_values(fmt):
    rng = np.random.default_rng(14)
    p, s = encode_pair(rng.standard_normal((2, 3, 512)).astype(np.float32))
    got = fmt.from_mxfp4(p, s)["packed"]
    assert got.shape == (2, 3, 148)
    assert np.array_equal(got, iq2xs.encode(decode_pair(p, s)))
    assert np.array_equal(fmt.reference_from_mxfp4(p[:1, :1], s[:1, :1])["packed"], got[:1, :1])


def test_from_float_and_wider_inputs(fmt):
    rng = np.random.default_rng(15)
    x64 = rng.standard_normal((2, 256))
    assert np.array_equal(fmt.from_float(x64)["packed"], iq2xs.encode(x64.astype(np.float32)))


def test_bad_input(fmt):
    x = np.ones((2, 512), np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[1, 300] = bad
        with pytest.raises(NaNScaleError, match=r"\[1, 300\]"):
            iq2xs.encode(y, name="w1")
    p, s = encode_pair(x)
    s[0, 3] = 0xFF                                         # NaN MXFP4 scale
    with pytest.raises(NaNScaleError):
        fmt.from_mxfp4(p, s)
    with pytest.raises(ShapeError, match="not applicable"):
        iq2xs.encode(np.ones((2, 2880), np.float32))
    with pytest.raises(ShapeError, match="float32"):
        iq2xs.encode(np.ones((2, 256), np.float64))


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


# ---------------------------------------------------------------- with an importance matrix
@pytest.mark.parametrize("iname", ["ones", "spiky", "holes"])
@pytest.mark.parametrize("name", ["gauss", "t5", "mxfp4", "sparse", "tiny", "huge", "subnormal", "zeros"])
def test_weighted_kernel_and_reference_bytes_identical(name, iname):
    from test_formats_iq2xxs import importances

    x = small_inputs()[name]
    im = {"ones": np.ones(x.shape[-1], np.float32), **importances(x.shape[-1])}[iname]
    got = iq2xs.encode(x, imatrix=im)
    assert got.shape == x.shape[:-1] + (x.shape[-1] // 256 * 74,)
    assert np.array_equal(got, iq2xs.encode_reference(x, imatrix=im))


def test_weighted_bytes_decode_as_gguf_and_move_the_error_to_unimportant_columns(fmt):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    im = np.ones(512, np.float32)
    im[::8] = 100.0
    packed = fmt.from_float(x, imatrix=im)["packed"]
    assert np.array_equal(packed, iq2xs.encode(x, imatrix=im))
    weighted = fmt_mod.decode_iq2xs(packed)
    want = dequantize(packed.reshape(-1, 74), GGMLQuantizationType.IQ2_XS).reshape(x.shape)
    assert np.array_equal(weighted.view(np.uint32), want.view(np.uint32))
    plain = fmt_mod.decode_iq2xs(iq2xs.encode(x))
    err = lambda y: float(((y - x)[:, ::8].astype(np.float64) ** 2).sum())  # noqa: E731
    assert err(weighted) < 0.8 * err(plain)
    assert np.array_equal(iq2xs.encode(x, imatrix=im * 4), packed)        # only relative importance counts


def test_weighted_beats_llama_cpp_quantizer_at_its_own_weighting():
    # llama.cpp's IQ2_XS quantizer (it requires an importance matrix) with a log-normal one, on
    # MXFP4-ized Gaussian data: the weighted SNR of ours is at least its.
    from gguf import GGMLQuantizationType

    from ggml_quant import ggml_quantize
    from test_formats_iq2xxs import snr_db

    rng = np.random.default_rng(9)
    x = decode_pair(*encode_pair(rng.standard_normal((8, 1024)).astype(np.float32)))
    im = np.exp(rng.normal(0, 1, 1024)).astype(np.float32)
    theirs = snr_db(x, fmt_mod.decode_iq2xs(ggml_quantize(GGMLQuantizationType.IQ2_XS, x, 74, im)), im)
    ours = snr_db(x, fmt_mod.decode_iq2xs(iq2xs.encode(x, imatrix=im)), im)
    assert ours >= theirs + 0.2, (ours, theirs)
