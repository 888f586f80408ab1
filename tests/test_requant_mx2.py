"""k3ckpt MX2: plan search, encoder, decoder, golden vector, brute force over the 21 level sets."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from k3ckpt.errors import InvalidFileError, ShapeError, UnsupportedError, UsageError
from k3ckpt.formats.mxfp4 import decode_pair, encode_pair
from k3ckpt.requant.metrics import error_stats

GOLDEN = json.loads((Path(__file__).parent / "golden" / "mx2_ex1.json").read_text())


@pytest.fixture(scope="module")
def mods():
    # Imported when a test runs: importing k3ckpt.formats.mx2 registers
    # "k3ckpt-mx2" in the format registry (tests/test_formats_registry.py
    # checks the registry against docs/formats/README.md).
    from k3ckpt.formats import moet_w2
    from k3ckpt.formats import mx2 as fmx2
    from k3ckpt.requant import mx2

    class M:
        pass

    m = M()
    m.enc, m.fmt, m.w2 = mx2, fmx2, moet_w2
    return m


def _hex(b: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(b), np.uint8)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def _mxfp4_values(packed, scale) -> np.ndarray:
    """Independent MXFP4 decode (ml_dtypes E2M1 and E8M0, float64 products)."""
    v = _nibbles(packed).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sc = np.asarray(scale, np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return v * np.repeat(sc, 32, axis=-1)


def _parts_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def mixed_tensor(rng, rows, k, *, lo=118, hi=134, zero_frac=0.0, nan=0, sparse_frac=0.1):
    """MXFP4 bytes: Gaussian-like rows, random-byte blocks, sparse blocks, zero blocks, NaN scales."""
    x = rng.standard_normal((rows, k)) * np.exp(rng.normal(0, 1, (rows, 1)))
    packed, scale = encode_pair(x.astype(np.float32))
    blocks = packed.reshape(rows, k // 32, 16)
    nb = blocks.shape[0] * blocks.shape[1]
    rand = rng.random((rows, k // 32)) < 0.3
    blocks[rand] = rng.integers(0, 256, (int(rand.sum()), 16), dtype=np.uint8)
    sparse = rng.random((rows, k // 32)) < sparse_frac
    keep = rng.random((int(sparse.sum()), 16)) < 0.1
    blocks[sparse] = np.where(keep, blocks[sparse], blocks[sparse] & 0x88)
    blocks[sparse, 0] |= 0x01                     # at least one nonzero
    zero = rng.random((rows, k // 32)) < zero_frac
    blocks[zero] &= 0x88
    scale[:] = rng.integers(lo, hi + 1, scale.shape)
    if nan:
        scale.reshape(-1)[rng.choice(nb, nan, replace=False)] = 0xFF
    return packed, scale


# ------------------------------------------------------------------- golden

def test_golden_example(mods):
    packed = _hex(GOLDEN["mxfp4_packed"]).reshape(1, 64)
    scale = _hex(GOLDEN["mxfp4_scale"]).reshape(1, 4)
    for encode in (mods.enc.encode, mods.enc.encode_reference):
        parts, plan = encode(packed, scale)
        assert [list(s) for s in plan.sets] == GOLDEN["sets"] and plan.sse == GOLDEN["sse"]
        assert parts["packed"].tobytes().hex() == GOLDEN["packed"]
        assert parts["scale"].tobytes().hex() == GOLDEN["scale"]
        assert parts["levels"].tobytes().hex() == GOLDEN["levels"]
        assert parts["exp_base"].tobytes().hex() == GOLDEN["exp_base"]
    got = mods.fmt.decode_mx2(**parts)
    assert np.array_equal(got.astype(np.float64), _mxfp4_values(packed, scale))


@pytest.mark.parametrize("case", GOLDEN["decode_checks"], ids=[c["name"] for c in GOLDEN["decode_checks"]])
def test_golden_decode_rules(case, mods):
    levels = _hex(GOLDEN["levels"]).reshape(4, 2)
    base = _hex(case["exp_base"])
    block = _hex(case["block_byte"]).reshape(1, 1)
    codes = np.arange(256, dtype=np.uint8)[:8].reshape(1, 8)
    for dec in (mods.fmt.decode_mx2, mods.fmt.decode_mx2_ref):
        out = dec(codes, block, levels, base)
        assert np.isnan(out).all() == case["nan"] and (np.isnan(out).any() == case["nan"])
    _, sc = mods.fmt.to_mxfp4(codes, block, levels, base)
    assert sc.tobytes().hex() == ("ff" if case["nan"] else case["scale_byte"])


# ------------------------------------------------------- kernel == reference

@pytest.mark.parametrize("kind", ["gaussian", "mixed", "zeros-nan", "clipped", "edge-low", "edge-high", "all-zero"])
def test_kernel_equals_reference(kind, mods):
    rng = np.random.default_rng(len(kind) * 17)
    if kind == "gaussian":
        packed, scale = encode_pair(rng.standard_normal((16, 512)).astype(np.float32))
    elif kind == "mixed":
        packed, scale = mixed_tensor(rng, 16, 512)
    elif kind == "zeros-nan":
        packed, scale = mixed_tensor(rng, 16, 512, zero_frac=0.2, nan=12)
    elif kind == "clipped":      # spread 57 > FULL_SPREAD: windows clipped by the base
        packed, scale = mixed_tensor(rng, 16, 512, lo=100, hi=157)
        scale[0, 0], scale[0, 1] = 100, 157
    elif kind == "edge-low":     # E8M0 bytes near 0: the lower end of the byte range clips
        packed, scale = mixed_tensor(rng, 16, 512, lo=0, hi=20)
    elif kind == "edge-high":    # near 254: the upper end clips
        packed, scale = mixed_tensor(rng, 16, 512, lo=240, hi=254)
    else:
        packed = (rng.integers(0, 256, (4, 64), dtype=np.uint8) & 0x88).astype(np.uint8)
        scale = rng.integers(0, 255, (4, 4), dtype=np.uint8)
    a, pa = mods.enc.encode(packed, scale)
    b, pb = mods.enc.encode_reference(packed, scale)
    assert pa == pb and _parts_equal(a, b)
    assert pa == mods.enc.plan(packed, scale) == mods.enc.plan_reference(packed, scale)
    # one search pass or plan then encode_with_plan: same bytes
    assert _parts_equal(mods.enc.encode_with_plan(packed, scale, pa), a)
    assert _parts_equal(mods.enc.encode_with_plan_reference(packed, scale, pa), a)
    # the plan's error is the decoded error (float64 via the lossless MXFP4 view:
    # float32 overflows at scale bytes >= 253)
    src = _mxfp4_values(packed, scale)
    got = _mxfp4_values(*mods.fmt.to_mxfp4(**a))
    live = ~np.isnan(src)
    assert np.isnan(got[~live]).all()
    sse = float(((got[live] - src[live]) ** 2).sum())
    assert sse == pytest.approx(pa.sse, rel=1e-9, abs=1e-300)


def test_search_totals_kernel_equals_direct_minimum(mods):
    # The kernel sums 4-subset minima through sorted prefixes (_combo_totals);
    # the reference takes the minimum of every subset directly.
    rng = np.random.default_rng(3)
    packed, scale = mixed_tensor(rng, 32, 256, zero_frac=0.1, nan=5)
    p, s = mods.enc.check_mxfp4(packed, scale)
    t = mods.enc._tables(mods.enc.SHAPES)
    fast = mods.enc._search(p, s, 0, 254, t, combos=True, reference=False)
    ref = mods.enc._search(p, s, 0, 254, t, combos=True, reference=True)
    assert np.array_equal(fast[0], ref[0]) and np.array_equal(fast[1], ref[1])
    assert fast[2] == ref[2] and np.array_equal(fast[3], ref[3])



def test_kernel_key_tables_equal_the_full_dot_product(mods):
    # The search kernel drops h[0] (h[0] = 32 - the rest) and the trailing padding candidates;
    # its keys must equal key0 + h . key_t exactly for every histogram of 32 magnitudes.
    rng = np.random.default_rng(21)
    hist = rng.multinomial(32, rng.dirichlet(np.ones(8), 200)).astype(np.float64)     # [200, 8]
    for sets in (mods.enc.SHAPES, ((1.0, 4.0), (1.0, 3.0), (2.0, 6.0), (3.0, 4.0))):
        t = mods.enc._tables(sets)
        full = t.key0[None, :] + hist @ t.key_t
        short = t.key0_h[None, :] + hist[:, 1:] @ t.key_h
        assert np.array_equal(full[:, :t.n_used], short[:, :t.n_used])
        assert not t.valid[t.n_used:].any() and t.valid[t.n_used - 1]


def test_sort11_sorts_every_01_input_and_random_keys(mods):
    for bits in range(1 << 11):
        k = np.array([(bits >> i) & 1 for i in range(11)], np.int64)
        mods.enc._sort11(k)
        assert (np.diff(k) >= 0).all(), bits
    rng = np.random.default_rng(14)
    for _ in range(200):
        k = rng.integers(-50, 50, 11).astype(np.int64)
        want = np.sort(k)
        mods.enc._sort11(k)
        assert np.array_equal(k, want)


# ------------------------------------------------------------- optimality

def _best_per_set(x_blocks: np.ndarray, e_lo, e_hi) -> np.ndarray:
    """[blocks, 21] least squared error of each set over exponents e_lo..e_hi (nearest level, float64)."""
    from k3ckpt.requant.mx2 import ALL_SETS

    e = np.arange(e_lo, e_hi + 1)
    t = np.exp2(e - 127.0)[None, :, None]
    ax = np.abs(x_blocks)[:, None, :]
    out = np.empty((x_blocks.shape[0], len(ALL_SETS)))
    for j, (a, b) in enumerate(ALL_SETS):
        q = np.where(2 * ax <= (a + b) * t, a * t, b * t)
        out[:, j] = ((ax - q) ** 2).sum(axis=2).min(axis=1)
    return out


def _brute_force_total(best: np.ndarray) -> float:
    combos = np.array(list(itertools.combinations(range(best.shape[1]), 4)))   # 5985 subsets of the 21
    return float(best[:, combos].min(axis=2).sum(axis=0).min())


def test_plan_is_the_optimum_over_all_21_sets_and_all_exponents(mods):
    # Nonzero blocks only (an all-zero block's optimum, exponent byte 0, is below exp_base).
    rng = np.random.default_rng(4)
    packed, scale = mixed_tensor(rng, 8, 256, lo=118, hi=136, sparse_frac=0.2)
    x = _mxfp4_values(packed, scale).reshape(-1, 32)
    assert (np.abs(x).max(axis=1) > 0).all()
    want = _brute_force_total(_best_per_set(x, 0, 254))
    parts, plan = mods.enc.encode(packed, scale)
    assert plan.sse == pytest.approx(want, rel=1e-12)
    got = mods.fmt.decode_mx2(**parts).astype(np.float64).reshape(-1, 32)
    assert ((got - x) ** 2).sum() == pytest.approx(want, rel=1e-12)


def test_clipped_plan_is_the_optimum_for_its_base(mods):
    rng = np.random.default_rng(5)
    packed, scale = mixed_tensor(rng, 8, 256, lo=90, hi=146, sparse_frac=0.2)
    scale[0, 0], scale[0, 1] = 90, 146                     # spread 56: the base clips low blocks
    x = _mxfp4_values(packed, scale).reshape(-1, 32)
    parts, plan = mods.enc.encode(packed, scale)
    assert plan.exp_base == 146 + mods.enc.D_MAX - mods.enc.MAX_OFFSET
    want = _brute_force_total(_best_per_set(x, plan.exp_base, plan.exp_base + mods.enc.MAX_OFFSET))
    assert plan.sse == pytest.approx(want, rel=1e-12)


def test_scale_spread_limits(mods):
    rng = np.random.default_rng(6)
    packed, scale = mixed_tensor(rng, 4, 128, lo=100, hi=150)
    scale[0, 0], scale[0, 1] = 100, 100 + mods.enc.MAX_SPREAD
    mods.enc.plan(packed, scale)
    scale[0, 1] += 1
    for f in (mods.enc.plan, mods.enc.plan_reference, mods.enc.encode):
        with pytest.raises(UnsupportedError, match="spread"):
            f(packed, scale, name="w2")
    # a zero block's scale does not count
    packed2, scale2 = packed.copy(), scale.copy()
    packed2[0, 16:32] &= 0x88
    assert mods.enc.plan(packed2, scale2).zero_blocks == 1


def test_zero_and_nan_blocks(mods):
    rng = np.random.default_rng(7)
    packed, scale = mixed_tensor(rng, 8, 256, zero_frac=0.25, nan=6)
    parts, plan = mods.enc.encode(packed, scale)
    blocks = packed.reshape(8, 8, 16)
    nan = scale == 0xFF
    zero = ~nan & ((blocks & 0x77) == 0).all(axis=2)
    assert plan.nan_blocks == nan.sum() and plan.zero_blocks == zero.sum() and plan.blocks == 64 - nan.sum()
    assert (parts["scale"][nan] == 0xFF).all()
    zsel = min(range(4), key=lambda i: (plan.sets[i][0], i))
    assert (parts["scale"][zero] == zsel << 6).all()
    out = mods.fmt.decode_mx2(**parts).reshape(8, 8, 32)
    assert np.isnan(out[nan]).all() and not np.isnan(out[~nan]).any()
    # zeros decode to +-a * 2^(base-127) with the source sign bit
    z = out[zero]
    sign = np.where(_nibbles(blocks[zero]) >= 8, -1.0, 1.0)
    assert np.array_equal(z, (sign * plan.sets[zsel][0] * 2.0 ** (plan.exp_base - 127)).astype(np.float32))


def test_odd_symmetry(mods):
    rng = np.random.default_rng(8)
    packed, scale = mixed_tensor(rng, 8, 256, zero_frac=0.1)
    a, pa = mods.enc.encode(packed, scale)
    b, pb = mods.enc.encode(packed ^ 0x88, scale)
    assert pa == pb and np.array_equal(a["scale"], b["scale"])
    c = mods.w2.unpack_codes
    assert np.array_equal(c(b["packed"]), 3 - c(a["packed"]))


def test_encode_with_a_given_plan(mods):
    rng = np.random.default_rng(9)
    packed, scale = mixed_tensor(rng, 8, 256, zero_frac=0.1, nan=3)
    base = mods.enc.plan(packed, scale).exp_base
    fixed = mods.enc.MX2Plan(exp_base=base, sets=((1.0, 4.0), (1.0, 3.0), (2.0, 6.0), (3.0, 4.0)))
    a = mods.enc.encode_with_plan(packed, scale, fixed)
    assert _parts_equal(a, mods.enc.encode_with_plan_reference(packed, scale, fixed))
    assert a["levels"].tolist() == [[2, 6], [2, 5], [4, 7], [5, 6]]
    # selector 0 alone at the plan's base is Moet refit wherever refit's exponent fits
    only = mods.enc.MX2Plan(exp_base=base, sets=((1.0, 4.0),) * 4)
    b = mods.enc.encode_with_plan(packed, scale, only)
    from k3ckpt.requant.moet import encode_refit

    codes, sc = encode_refit(packed, scale)
    live = (scale != 0xFF) & ((packed.reshape(8, 8, 16) & 0x77) != 0).any(axis=2)
    assert np.array_equal(b["packed"].reshape(8, 8, 8)[live], codes.reshape(8, 8, 8)[live])
    assert np.array_equal((b["scale"][live] & 63).astype(int) + base, sc[live].astype(int))
    with pytest.raises(UnsupportedError, match="exp_base"):
        mods.enc.encode_with_plan(packed, scale, mods.enc.MX2Plan(exp_base=int(scale[scale < 255].max()) + 1,
                                                               sets=fixed.sets))
    with pytest.raises(UsageError):
        mods.enc.MX2Plan(exp_base=255, sets=fixed.sets)
    with pytest.raises(UsageError):
        mods.enc.MX2Plan(exp_base=100, sets=((1.0, 4.0), (4.0, 1.0), (1.0, 2.0), (1.0, 3.0)))


def test_quality_on_gaussian_proxy(mods):
    # Smaller copy of the bench's proxy: MX2 ~9.49 dB vs keep-scales ~9.05 dB (REQUANT.md 1b).
    rng = np.random.default_rng(10)
    packed, scale = encode_pair(rng.standard_normal((256, 1024)).astype(np.float32))
    src = decode_pair(packed, scale)
    parts, plan = mods.enc.encode(packed, scale)
    st = error_stats(src, mods.fmt.decode_mx2(**parts))
    assert st.snr_db > 9.4 and abs(st.bias_rel_rms) < 3e-3
    assert st.snr_db == pytest.approx(10 * math.log10(float((src.astype(np.float64) ** 2).sum()) / plan.sse), abs=1e-9)


# ------------------------------------------------------------------- decoder

def _random_side(rng):
    pairs = [(a, b) for a in range(1, 8) for b in range(a + 1, 8)]
    levels = np.array([pairs[i] for i in rng.choice(len(pairs), 4)], np.uint8)
    return levels, np.array([rng.integers(0, 255)], np.uint8)


def test_decode_kernel_equals_reference_on_random_bytes(mods):
    rng = np.random.default_rng(11)
    for _ in range(8):
        codes = rng.integers(0, 256, (3, 4, 16), dtype=np.uint8)
        block = rng.integers(0, 256, (3, 4, 2), dtype=np.uint8)
        levels, base = _random_side(rng)
        a = mods.fmt.decode_mx2(codes, block, levels, base)
        b = mods.fmt.decode_mx2_ref(codes, block, levels, base)
        assert a.shape == (3, 4, 64)
        nan = np.isnan(b)
        assert (np.isnan(a) == nan).all()
        assert np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def test_to_mxfp4_is_lossless(mods):
    rng = np.random.default_rng(12)
    codes = rng.integers(0, 256, (6, 32), dtype=np.uint8)
    block = rng.integers(0, 256, (6, 4), dtype=np.uint8)
    levels, base = _random_side(rng)
    packed, sc = mods.fmt.to_mxfp4(codes, block, levels, base)
    got = mods.fmt.decode_mx2(codes, block, levels, base)
    with np.errstate(over="ignore", invalid="ignore"):
        want = _mxfp4_values(packed, sc).astype(np.float32)
    both = np.isnan(want)
    assert (np.isnan(got) == both).all()
    assert np.array_equal(got[~both], want[~both])
    dp = decode_pair(packed, sc)
    assert np.array_equal(np.isnan(dp), both) and np.array_equal(dp[~both], got[~both])


def test_side_data_checks(mods):
    codes = np.zeros((1, 8), np.uint8)
    block = np.zeros((1, 1), np.uint8)
    good = np.array([[1, 2], [1, 7], [3, 4], [6, 7]], np.uint8)
    for bad in ([[0, 2]] + [[1, 2]] * 3, [[2, 2]] + [[1, 2]] * 3, [[3, 1]] + [[1, 2]] * 3, [[1, 8]] + [[1, 2]] * 3):
        with pytest.raises(InvalidFileError, match="levels"):
            mods.fmt.decode_mx2(codes, block, np.array(bad, np.uint8), np.array([10], np.uint8), name="w")
    with pytest.raises(InvalidFileError, match="exp_base"):
        mods.fmt.decode_mx2(codes, block, good, np.array([255], np.uint8))
    with pytest.raises(ShapeError):
        mods.fmt.decode_mx2(codes, block, good[:3], np.array([10], np.uint8))
    with pytest.raises(ShapeError):
        mods.fmt.decode_mx2(codes, block, good, np.array(10, np.uint8))


def test_registry_format(mods):
    fmt = mods.fmt.MX2()
    info = fmt.info
    assert info.id == "k3ckpt-mx2" and info.bits_per_weight == 2.25 and info.fields_text == "1 + 8"
    specs = fmt.part_specs((3584, 3072))
    assert specs["packed"].shape == (3584, 768) and specs["scale"].shape == (3584, 96)
    assert specs["levels"].shape == (4, 2) and specs["exp_base"].shape == (1,)
    names = fmt.tensor_names("m.experts.3.w2")
    assert names["levels"] == "m.experts.3.w2.weight_levels" and names["exp_base"] == "m.experts.3.w2.weight_exp_base"
    for role, name in names.items():
        assert fmt.match_name(name) == ("m.experts.3.w2", role)
    rng = np.random.default_rng(13)
    packed, scale = encode_pair(rng.standard_normal((2, 3, 128)).astype(np.float32))
    parts = fmt.from_mxfp4(packed, scale)
    assert _parts_equal(parts, fmt.reference_from_mxfp4(packed, scale))
    assert parts["packed"].shape == (2, 3, 32)
    out = fmt.decode(parts)
    assert out.shape == (2, 3, 128) and np.array_equal(out, mods.fmt.decode_mx2(**parts))
    assert np.array_equal(fmt.reference_decode(parts, out="bfloat16").astype(np.float32), out)
    with pytest.raises(UsageError, match="levels"):
        fmt.decode({"packed": parts["packed"], "scale": parts["scale"]})
    with pytest.raises(UsageError, match="unexpected"):
        fmt.decode({**parts, "extra": parts["scale"]})
    with pytest.raises(ShapeError, match="scale"):
        fmt.decode({**parts, "scale": parts["scale"][..., :1]}, name="w")
