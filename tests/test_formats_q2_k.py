"""gguf-q2_k's own checks: the code order, the byte layout by hand, constant and positive blocks
(the min), quality against min-max rounding on the encoder's own objective.  The family's common
checks (decode == reference == gguf-py, encoder kernel == reference, importance, llama.cpp's
quantizer, golden vectors, ...) are in test_formats_ggml_family.py."""

from __future__ import annotations

import numpy as np

from ggml_family import BY_KEY, small_inputs, snr_db
from k3ckpt.formats import q2_k
from k3ckpt.requant import q2_k as enc

Q2_K = BY_KEY["q2_k"]


def weighted_error(x, y, imatrix=None) -> float:
    """sum w (y - x)^2 with the encoder's weights w = imatrix * sqrt(sigma^2 + x^2), in float64."""
    k = x.shape[-1]
    q = np.ones(k) if imatrix is None else np.asarray(imatrix, np.float64)
    xb = x.astype(np.float64).reshape(-1, k // 256, 256)
    yb = y.astype(np.float64).reshape(xb.shape)
    w = q.reshape(k // 256, 256) * np.sqrt((xb * xb).mean(axis=2, keepdims=True) + xb * xb)
    return float((w * (yb - xb) ** 2).sum())


# ---------------------------------------------------------------- format
def test_code_order_covers_every_bit_once():
    byte, shift = q2_k.code_order()
    slots = byte * 4 + shift // 2
    assert sorted(slots.tolist()) == list(range(256))
    assert (byte[:32] == np.arange(32)).all() and (shift[:32] == 0).all()
    assert (byte[32:64] == np.arange(32)).all() and (shift[32:64] == 2).all()
    assert byte[128] == 32 and shift[128] == 0


# ---------------------------------------------------------------- decode
def test_decode_formula_by_hand():
    d_bits = np.array([[np.float16(0.5).view(np.uint16)]], np.uint16)
    packed = Q2_K.random_blocks(np.random.default_rng(3), 1, 1, d_bits=d_bits)   # d = dmin = 0.5
    packed[0, :16] = (np.arange(16) | ((15 - np.arange(16)) << 4)).astype(np.uint8)
    got = q2_k.decode_q2k(packed)[0]
    qs = packed[0, 16:80]
    for i in range(256):
        h, g, j = i // 128, (i % 128) // 32, i % 32
        q = (int(qs[32 * h + j]) >> (2 * g)) & 3
        s = i // 16
        assert got[i] == np.float32(0.5 * s * q - 0.5 * (15 - s)), i


# ---------------------------------------------------------------- encode
def test_constant_and_positive_blocks():
    x = small_inputs()
    # constant sub-blocks are exact up to the fp16 / 4-bit grid of d * sc (and dmin * mc)
    y = q2_k.decode_q2k(enc.encode(x["const"]))[0]
    assert np.abs(y[:256] - 0.37).max() < 2e-3 and np.abs(y[256:512] + 1.5).max() < 1e-2
    assert (y[512:] == 0).all()
    # a block above zero everywhere: every sub-block's lowest level is still <= 0 (d, dmin >= 0,
    # as llama.cpp writes them), which costs accuracy but not much
    b = enc.encode(x["positive"])
    p = q2_k.decode_q2k(b)
    assert not (b[0, 81] & 0x80) and not (b[0, 83] & 0x80)
    assert snr_db(x["positive"], p) > 15


def test_beats_min_max_rounding_on_its_own_objective_and_in_snr():
    # Baseline any reasonable Q2_K encoder should beat: per sub-block min-max levels, nibbles
    # rounded on d = max scale / 15 and dmin = max min / 15, codes rounded.
    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    xb = x.astype(np.float64).reshape(-1, 16, 16)
    lo = np.minimum(xb.min(axis=2), 0)
    s = (xb.max(axis=2) - lo) / 3
    d = s.max(axis=1, keepdims=True) / 15
    dm = (-lo).max(axis=1, keepdims=True) / 15
    sc = np.rint(s / d)
    mc = np.rint(-lo / dm)
    a, b = (d * sc)[..., None], (dm * mc)[..., None]
    base = (a * np.clip(np.rint((xb + b) / np.where(a > 0, a, 1)), 0, 3) - b).reshape(x.shape)
    y = q2_k.decode_q2k(enc.encode(x))
    assert weighted_error(x, y) < 0.8 * weighted_error(x, base)
    assert snr_db(x, y) > snr_db(x, base) + 1.0
    assert snr_db(x, y) > 11.0             # iid Gaussian: llama.cpp's own Q2_K reaches 11.4 dB (ones)


def test_lighter_search_without_a_matrix_only():
    # None takes the lighter search (as ggml's Q2_K runs its simpler rule only without a matrix);
    # all ones, given, the full one, which errs less on the same objective
    assert enc.effort_for(None) is enc.PLAIN
    assert enc.effort_for(np.ones(256, np.float32)) is enc.WEIGHTED
    assert len(enc.PLAIN.r_cand) < len(enc.WEIGHTED.r_cand)
    x = np.random.default_rng(11).standard_normal((8, 1024)).astype(np.float32)
    plain = enc.encode(x)
    full = enc.encode(x, imatrix=np.ones(1024, np.float32))
    assert np.array_equal(plain, enc.encode_reference(x))
    assert not np.array_equal(plain, full)
    assert weighted_error(x, q2_k.decode_q2k(full)) < weighted_error(x, q2_k.decode_q2k(plain))
