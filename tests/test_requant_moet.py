"""Moet 2.25 bpw: keep-scales and refit encoders, the moet-w2 decoder, golden vectors, brute force."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from k3ckpt.errors import ShapeError, UsageError
from k3ckpt.formats.e2m1 import E2M1_VALUES
from k3ckpt.formats.mxfp4 import decode_pair, encode_pair
from k3ckpt.requant import moet
from k3ckpt.requant.metrics import error_stats

GOLDEN = json.loads((Path(__file__).parent / "golden" / "moet_ex1.json").read_text())["vectors"]
ENCODERS = {
    "keep-scales": (moet.encode_keep_scales, moet.encode_keep_scales_reference),
    "refit": (moet.encode_refit, moet.encode_refit_reference),
}


@pytest.fixture(scope="module")
def w2():
    # Imported when a test runs: importing it registers "moet-w2" in the format
    # registry (see the report; tests/test_formats_registry.py checks the table).
    from k3ckpt.formats import moet_w2

    return moet_w2


def _hex(b: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(b), np.uint8)


def _pack_nibbles(nib: np.ndarray) -> np.ndarray:
    nib = np.asarray(nib, np.uint8)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def _mxfp4_values(packed, scale) -> np.ndarray:
    """Independent MXFP4 decode: ml_dtypes E2M1 and E8M0, products in float64."""
    nib = _nibbles(packed)
    v = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sc = np.asarray(scale, np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return v * np.repeat(sc, 32, axis=-1)


def random_mxfp4(rng, rows, k, *, zero_frac=0.0, nan_scales=0, scale_lo=0, scale_hi=255):
    """Random pair-layout MXFP4 bytes; some blocks all-zero (+0/-0 mixed) and some NaN scales."""
    packed = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scale = rng.integers(scale_lo, scale_hi, (rows, k // 32), dtype=np.uint8)
    blocks = packed.reshape(rows, k // 32, 16)
    zero = rng.random((rows, k // 32)) < zero_frac
    blocks[zero] &= 0x88
    flat = scale.reshape(-1)
    if nan_scales:
        flat[rng.choice(flat.size, nan_scales, replace=False)] = 0xFF
    return packed, scale


def _codes_str(packed_w2: np.ndarray) -> str:
    from k3ckpt.formats.moet_w2 import unpack_codes

    return "".join(str(c) for c in unpack_codes(packed_w2).ravel())


# ----------------------------------------------------------------- golden / maps

@pytest.mark.parametrize("vec", GOLDEN, ids=[v["name"] for v in GOLDEN])
def test_golden_vectors(vec, w2):
    packed = _pack_nibbles(vec["nibbles"])[None]
    assert packed.tobytes().hex() == vec["mxfp4_packed"]
    scale = _hex(vec["scale"]).reshape(1, 1)
    for enc in ENCODERS[vec["encoder"]]:
        codes, sc = enc(packed, scale)
        assert codes.tobytes().hex() == vec["w2_packed"]
        assert sc.tobytes().hex() == vec["w2_scale"]
        assert _codes_str(codes) == vec["codes"]
    # SSE in E2M1 units of the source scale, from the independent decode
    src = _mxfp4_values(packed, scale)
    got = w2.decode_w2(codes, sc).astype(np.float64)
    unit = 2.0 ** (int(scale[0, 0]) - 127)
    assert ((got - src) ** 2).sum() / unit**2 == vec["sse_e2m1_units"]


def test_keep_map_is_the_runtime_table_for_every_byte():
    # _NIBBLE_TO_CODE = [2,2,2,2,2,3,3,3,1,1,1,1,1,0,0,0] (moe_w2_planes.py L59-62)
    runtime = [2, 2, 2, 2, 2, 3, 3, 3, 1, 1, 1, 1, 1, 0, 0, 0]
    assert moet.NIBBLE_TO_CODE.tolist() == runtime
    b = np.arange(256, dtype=np.uint8)
    packed = np.stack([b, b[::-1]], axis=1).reshape(-1, 16)      # every byte, in 32-column rows
    codes, _ = moet.encode_keep_scales(packed, np.full((packed.shape[0], 1), 0x7F, np.uint8))
    from k3ckpt.formats.moet_w2 import unpack_codes

    expect = np.array(runtime, np.uint8)[_nibbles(packed)]
    assert np.array_equal(unpack_codes(codes), expect)


def test_keep_is_value_nearest_with_ties_low():
    # Independent reading of the same map: nearest of {1, 4} in magnitude, 2.5 -> 1, sign bit kept.
    for nib in range(16):
        mag = abs(float(E2M1_VALUES[nib]))
        small = mag <= 2.5
        neg = nib >= 8
        want = (1 if small else 0) if neg else (2 if small else 3)
        assert moet.NIBBLE_TO_CODE[nib] == want


# -------------------------------------------------------- kernel == reference

@pytest.mark.parametrize("name", list(ENCODERS))
@pytest.mark.parametrize("kind", ["random", "zeros", "nan", "edge-scales", "gaussian"])
def test_kernel_equals_reference(name, kind):
    rng = np.random.default_rng(len(kind) * 31 + len(name))
    if kind == "random":
        packed, scale = random_mxfp4(rng, 24, 256)
    elif kind == "zeros":
        packed, scale = random_mxfp4(rng, 24, 256, zero_frac=0.5)
    elif kind == "nan":
        packed, scale = random_mxfp4(rng, 24, 256, zero_frac=0.1, nan_scales=40)
    elif kind == "edge-scales":
        packed, scale = random_mxfp4(rng, 24, 256, zero_frac=0.1)
        scale[:] = rng.choice(np.array([0, 1, 2, 3, 4, 5, 250, 251, 252, 253, 254], np.uint8), scale.shape)
    else:
        packed, scale = encode_pair(rng.standard_normal((24, 256)).astype(np.float32))
    fast, ref = ENCODERS[name]
    a = fast(packed, scale)
    b = ref(packed, scale)
    assert a[0].dtype == np.uint8 and a[0].shape == (24, 64) and a[1].shape == scale.shape
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("name", list(ENCODERS))
def test_leading_dims_and_input_checks(name):
    rng = np.random.default_rng(5)
    packed, scale = random_mxfp4(rng, 6, 64)
    fast, ref = ENCODERS[name]
    codes, sc = fast(packed.reshape(2, 3, 32), scale.reshape(2, 3, 2))
    assert codes.shape == (2, 3, 16) and sc.shape == (2, 3, 2)
    assert np.array_equal(codes.reshape(6, 16), fast(packed, scale)[0])
    for f in (fast, ref):
        with pytest.raises(ShapeError, match="w1"):
            f(packed[:, :10], scale, name="w1")
        with pytest.raises(ShapeError):
            f(packed, scale[:, :1])
        with pytest.raises(ShapeError):
            f(packed.astype(np.int8), scale)


def test_nan_blocks_stay_nan_and_zero_blocks_go_lowest():
    rng = np.random.default_rng(6)
    packed, scale = random_mxfp4(rng, 8, 128, zero_frac=0.3, nan_scales=5, scale_lo=100, scale_hi=140)
    codes, sc = moet.encode_refit(packed, scale)
    nan = scale == 0xFF
    zero = ~nan & ((packed.reshape(8, 4, 16) & 0x77) == 0).all(axis=2)
    assert (sc[nan] == 0xFF).all() and (sc[zero] == 0).all()
    keep, _ = moet.encode_keep_scales(packed, scale)
    c4, k4 = codes.reshape(8, 4, 8), keep.reshape(8, 4, 8)
    assert np.array_equal(c4[nan | zero], k4[nan | zero])     # zeros: +-1 by sign bit


# ------------------------------------------------------------- refit optimality

def _brute_force_refit(packed: np.ndarray, scale: np.ndarray):
    """Every E8M0 exponent 0..254 for every block, nearest level with the documented ties.

    Returns (scale bytes, codes [blocks, 32]).  Tie order between exponents:
    least squared error, then nearest the source exponent, then the lower.
    """
    nb = packed.shape[0]
    x = _mxfp4_values(packed, scale.reshape(nb, 1))                 # [blocks, 32] float64
    neg = _nibbles(packed) >= 8
    e = np.arange(255)
    t = np.exp2(e - 127.0)[None, :, None]                            # level unit 2^(e-127)
    ax = np.abs(x)[:, None, :]
    small = 2 * ax <= 5 * t                                          # |x| <= 2.5 t -> level 1
    q = np.where(small, t, 4 * t)
    err = ((ax - q) ** 2).sum(axis=2)                                # [blocks, 255]
    s = scale.reshape(-1).astype(np.int64)
    best = np.empty(nb, np.int64)
    for i in range(nb):
        best[i] = np.lexsort((e, np.abs(e - s[i]), err[i]))[0]
    sm = small[np.arange(nb), best]
    codes = np.where(neg, np.where(sm, 1, 0), np.where(sm, 2, 3)).astype(np.uint8)
    return best.astype(np.uint8), codes


def test_refit_equals_brute_force_over_all_exponents(w2):
    rng = np.random.default_rng(7)
    n = 1200
    packed = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    sparse = rng.random((n, 16)) < rng.random((n, 1))                 # blocks from dense to nearly empty
    packed = np.where(sparse, packed & 0x88, packed).astype(np.uint8)
    packed[:40] = rng.choice(np.array([0x00, 0x08, 0x80, 0x88], np.uint8), (40, 16))
    packed[:40, 0] |= rng.integers(1, 8, 40).astype(np.uint8)         # one nonzero among zeros
    packed[40:50] = 0x77                                              # all 6
    packed[50:60] = 0xFF                                              # all -6
    packed[60:70] = 0x11                                              # all 0.5
    scale = rng.integers(0, 255, n).astype(np.uint8)
    scale[:300] = rng.choice(np.array([0, 1, 2, 3, 4, 5, 6, 250, 251, 252, 253, 254], np.uint8), 300)
    want_scale, want_codes = _brute_force_refit(packed, scale)
    codes, sc = moet.encode_refit(packed, scale.reshape(n, 1))
    assert np.array_equal(sc[:, 0], want_scale)
    assert np.array_equal(w2.unpack_codes(codes), want_codes)


def test_refit_never_worse_than_keep_scales(w2):
    rng = np.random.default_rng(8)
    packed, scale = encode_pair((rng.standard_t(5, (64, 512)) * 0.02).astype(np.float32))
    src = _mxfp4_values(packed, scale)
    e_keep = (w2.decode_w2(*moet.encode_keep_scales(packed, scale)) - src) ** 2
    e_refit = (w2.decode_w2(*moet.encode_refit(packed, scale)) - src) ** 2
    per_block = lambda e: e.reshape(64, -1, 32).sum(axis=2)  # noqa: E731
    assert (per_block(e_refit) <= per_block(e_keep)).all()
    assert e_refit.sum() < e_keep.sum()


@pytest.mark.parametrize("name", list(ENCODERS))
def test_odd_symmetry(name, w2):
    # Negating every source value (sign bit flip, including +-0) negates every
    # decoded value: code c -> 3 - c, same scales.  First-argmin tie-breaking fails this.
    rng = np.random.default_rng(9)
    packed, scale = random_mxfp4(rng, 16, 256, zero_frac=0.2, scale_lo=110, scale_hi=140)
    enc = ENCODERS[name][0]
    c1, s1 = enc(packed, scale)
    c2, s2 = enc(packed ^ 0x88, scale)
    assert np.array_equal(s1, s2)
    assert np.array_equal(w2.unpack_codes(c2), 3 - w2.unpack_codes(c1))


def test_fit_window_is_exact_for_every_level_set():
    # For each of the 21 sets {+-a, +-b}: the best offset over d in [-8, 8]
    # (exact float64 arithmetic there) always lies in fit_window, with the
    # documented tie order (smaller |d|, then smaller d).  Histograms: random,
    # sparse, and the extremes the window proofs rely on.
    rng = np.random.default_rng(10)
    mags = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    hists = [rng.multinomial(32, rng.dirichlet(np.full(8, 0.3))) for _ in range(400)]
    for m in range(1, 8):
        hists.append(np.eye(8, dtype=int)[0] * 31 + np.eye(8, dtype=int)[m])   # one value, 31 zeros
        hists.append(np.eye(8, dtype=int)[m] * 32)                          # all the same value
    hists = np.array(hists)
    ds = np.arange(-8, 9)
    grid = [0.5, 1, 1.5, 2, 3, 4, 6]
    for i, a in enumerate(grid):
        for b in grid[i + 1:]:
            la, lb = a * np.exp2(ds), b * np.exp2(ds)                       # [d]
            q = np.where(2 * mags[None, :] <= (la + lb)[:, None], la[:, None], lb[:, None])
            err = hists @ ((mags[None, :] - q) ** 2).T                      # [hist, d]
            order = sorted(range(len(ds)), key=lambda j: (abs(ds[j]), ds[j]))
            window = set(moet.fit_window(a, b))
            for row in err:
                best = min(order, key=lambda j: row[j])                      # first in tie order
                assert ds[best] in window, (a, b, ds[best], sorted(window))


def test_fit_window_rejects_bad_sets():
    with pytest.raises(AssertionError):
        moet.fit_window(4.0, 1.0)


# ------------------------------------------------------------------- decoder

def test_decode_kernel_equals_reference_on_random_bytes(w2):
    rng = np.random.default_rng(11)
    codes = rng.integers(0, 256, (3, 5, 32), dtype=np.uint8)
    scale = rng.integers(0, 256, (3, 5, 4), dtype=np.uint8)
    scale[0, 0, 0] = 0xFF
    scale[1, 1, :] = rng.choice(np.array([0, 1, 252, 253, 254], np.uint8), 4)
    a = w2.decode_w2(codes, scale)
    b = w2.decode_w2_ref(codes, scale)
    assert a.shape == (3, 5, 128) and a.dtype == np.float32
    nan = np.isnan(b)
    assert (np.isnan(a) == nan).all() and nan[0, 0, :32].all() and nan.sum() == 32
    assert np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def test_to_mxfp4_is_lossless(w2):
    rng = np.random.default_rng(12)
    codes = rng.integers(0, 256, (7, 64), dtype=np.uint8)
    scale = rng.integers(0, 255, (7, 8), dtype=np.uint8)
    packed, sc = w2.to_mxfp4(codes, scale)
    assert set(np.unique(_nibbles(packed)).tolist()) <= {0x2, 0x6, 0xA, 0xE}
    with np.errstate(over="ignore"):
        want = _mxfp4_values(packed, sc).astype(np.float32)
    got = w2.decode_w2(codes, scale)
    assert np.array_equal(got, want) and np.array_equal(decode_pair(packed, sc), got)
    # the keep-scales map sends those nibbles back to the same codes
    assert np.array_equal(moet.encode_keep_scales(packed, sc)[0], codes)


def test_pack_unpack_round_trip_and_checks(w2):
    rng = np.random.default_rng(13)
    c = rng.integers(0, 4, (3, 128), dtype=np.uint8)
    assert np.array_equal(w2.unpack_codes(w2.pack_codes(c)), c)
    assert w2.pack_codes(np.array([[1, 2, 3, 0]])).tolist() == [[1 | 2 << 2 | 3 << 4]]
    with pytest.raises(UsageError):
        w2.pack_codes(np.array([4, 0, 0, 0]))
    with pytest.raises(ShapeError, match="w2"):
        w2.decode_w2(np.zeros((2, 8), np.uint8), np.zeros((2, 2), np.uint8), name="w2")


def test_registry_format(w2):
    fmt = w2.MoetW2()   # the registered instance's class; stateless
    info = fmt.info
    assert info.id == "moet-w2" and info.bits_per_weight == 2.25 and info.fields_text == "1 + 8"
    specs = fmt.part_specs((3072, 3584))
    assert specs["packed"].shape == (3072, 896) and specs["scale"].shape == (3072, 112)
    assert fmt.tensor_names("m.experts.0.w1")["packed"] == "m.experts.0.w1.weight_packed"
    rng = np.random.default_rng(14)
    packed, scale = encode_pair(rng.standard_normal((4, 2, 96)).astype(np.float32))
    parts = fmt.from_mxfp4(packed, scale)
    assert {k: v.tobytes() for k, v in parts.items()} == {
        k: v.tobytes() for k, v in fmt.reference_from_mxfp4(packed, scale).items()}
    assert np.array_equal(fmt.decode(parts), w2.decode_w2(parts["packed"], parts["scale"]))
    assert np.array_equal(fmt.reference_decode(parts, out="bfloat16").astype(np.float32), fmt.decode(parts))
    keep = fmt.from_mxfp4(packed, scale, method="keep-scales")
    assert np.array_equal(keep["scale"], scale)
    with pytest.raises(UsageError, match="method"):
        fmt.from_mxfp4(packed, scale, method="nearest")


def test_quality_on_gaussian_proxy(w2):
    # Smaller copy of the bench's proxy: keep-scales ~9.05 dB, refit ~9.2 dB (REQUANT.md 1b).
    rng = np.random.default_rng(15)
    packed, scale = encode_pair(rng.standard_normal((256, 1024)).astype(np.float32))
    src = decode_pair(packed, scale)
    keep = error_stats(src, w2.decode_w2(*moet.encode_keep_scales(packed, scale)))
    refit = error_stats(src, w2.decode_w2(*moet.encode_refit(packed, scale)))
    assert 8.95 < keep.snr_db < 9.15 and 9.1 < refit.snr_db < 9.3 and refit.snr_db > keep.snr_db + 0.1
    assert abs(keep.bias_rel_rms) < 3e-3 and abs(refit.bias_rel_rms) < 3e-3
