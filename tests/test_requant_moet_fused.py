"""moet_fused: one pass gives the moet-w2 encoders' bytes and the shared metric's bits."""

from __future__ import annotations

import numpy as np
import pytest

from k3ckpt.errors import NaNScaleError, UsageError
from k3ckpt.requant import moet
from k3ckpt.requant.moet_fused import requant_moet, requant_moet_reference


def _mxfp4(rng, shape, lo, hi, zero_blocks=0.05):
    """Random MXFP4 pair layout [..., K/2], [..., K/32] with some all-zero blocks (+0 and -0)."""
    *lead, k = shape
    packed = rng.integers(0, 256, (*lead, k // 2), dtype=np.uint8)
    scale = rng.integers(lo, hi, (*lead, k // 32)).astype(np.uint8)
    blocks = packed.reshape(-1, 16)
    zero = rng.random(blocks.shape[0]) < zero_blocks
    blocks[zero] = rng.choice(np.array([0x00, 0x08, 0x80, 0x88], np.uint8), size=(int(zero.sum()), 16))
    return packed, scale


def _same(a, b):
    assert np.array_equal(a.codes, b.codes) and np.array_equal(a.scale, b.scale)
    assert a.stats == b.stats
    assert a.max_row_bias == b.max_row_bias
    assert (a.source_zeros, a.code_histogram, a.scale_changes) == (b.source_zeros, b.code_histogram,
                                                                  b.scale_changes)


@pytest.mark.parametrize("method", ["refit", "keep-scales"])
@pytest.mark.parametrize("lo,hi", [(112, 130), (0, 12), (0, 255), (246, 256)])
def test_fused_equals_reference_bit_for_bit(method, lo, hi):
    """Typical exponents, the smallest (float32 subnormals), all of them, and the top end where
    values overflow float32 or scales are NaN (counted, as the metric counts them)."""
    rng = np.random.default_rng(lo * 7 + hi)
    packed, scale = _mxfp4(rng, (2, 9, 256), lo, hi)
    a = requant_moet(packed, scale, method, nonfinite="count")
    _same(a, requant_moet_reference(packed, scale, method, nonfinite="count"))
    assert a.codes.shape == (2, 9, 64) and a.scale.shape == scale.shape
    enc = moet.encode_refit if method == "refit" else moet.encode_keep_scales
    codes, new_scale = enc(packed, scale)
    assert np.array_equal(a.codes, codes) and np.array_equal(a.scale, new_scale)
    if hi > 252:
        assert a.stats.nonfinite > 0
        with pytest.raises(NaNScaleError):
            requant_moet(packed, scale, method)
    else:
        assert a.stats.nonfinite == 0 and a.stats.count == 2 * packed.size


def _few_magnitude_blocks(rng, n):
    """Blocks drawn from one to three E2M1 magnitudes plus zeros, random signs: the skewed
    histograms where exponents other than the source's win."""
    nib = np.zeros((n, 32), np.uint8)
    for i in range(n):
        mags = rng.choice(np.arange(1, 8), rng.integers(1, 4), replace=False)
        nonzero = rng.integers(1, 33)
        nib[i, :nonzero] = rng.choice(mags, nonzero) | (rng.integers(0, 2, nonzero) << 3)
        rng.shuffle(nib[i])
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def test_every_refit_candidate_wins_somewhere_and_matches_the_reference():
    """The kernel's split-and-shift error for each candidate exponent is the search's table."""
    rng = np.random.default_rng(7)
    packed = _few_magnitude_blocks(rng, 6000).reshape(60, 100 * 16)
    scale = rng.integers(2, 253, (60, 100)).astype(np.uint8)     # near both ends of the window too
    for method in ("keep-scales", "refit"):
        a = requant_moet(packed, scale, method)
        _same(a, requant_moet_reference(packed, scale, method))
    moved = set(np.unique(a.scale.astype(int) - scale))   # refit's
    assert set(moet.REFIT_WINDOW) - {2} <= moved   # d = +2 bounds the window but never wins alone


@pytest.mark.parametrize("shape", [(300, 256), (3, 1100 * 32), (1, 32)])
def test_fused_over_row_chunks(shape):
    """Rows go through the kernel in chunks of about _CHUNK_BLOCKS blocks: several chunks with a
    short last one, rows longer than a chunk, a single block."""
    from k3ckpt.requant.moet_fused import _CHUNK_BLOCKS

    rows, k = shape
    assert rows * k // 32 > _CHUNK_BLOCKS or k // 32 > _CHUNK_BLOCKS or rows * k == 32
    rng = np.random.default_rng(rows)
    packed, scale = _mxfp4(rng, shape, 100, 140)
    for method in ("refit", "keep-scales"):
        _same(requant_moet(packed, scale, method), requant_moet_reference(packed, scale, method))


def test_fused_counts_against_direct_counts():
    rng = np.random.default_rng(1)
    packed, scale = _mxfp4(rng, (64, 512), 118, 128)
    a = requant_moet(packed, scale, "refit")
    nib = np.concatenate([packed.reshape(-1) & 15, packed.reshape(-1) >> 4])
    assert a.source_zeros == int(np.count_nonzero((nib & 7) == 0))
    fields = np.concatenate([(a.codes.reshape(-1) >> sh) & 3 for sh in (0, 2, 4, 6)])
    assert a.code_histogram == tuple(int(np.count_nonzero(fields == c)) for c in range(4))
    assert a.scale_changes == int(np.count_nonzero(a.scale != scale)) > 0
    assert requant_moet(packed, scale, "keep-scales").scale_changes == 0


def test_all_zero_tensor_and_bad_method():
    packed = np.zeros((4, 16), np.uint8)
    packed[1] = 0x88                                    # -0 everywhere in row 1
    scale = np.full((4, 1), 120, np.uint8)
    for method in ("refit", "keep-scales"):
        a = requant_moet(packed, scale, method)
        _same(a, requant_moet_reference(packed, scale, method))
        assert a.stats.snr_db == -np.inf and a.source_zeros == 128
    assert np.all(requant_moet(packed, scale).scale == 0)
    with pytest.raises(UsageError, match="method"):
        requant_moet(packed, scale, "nearest")


def test_worker_fused_path_equals_general_path():
    """requant_weight's moet-w2 row is the one the general encode / decode / metric path gives."""
    from k3ckpt.formats import get_format
    from k3ckpt.requant import tensor_stats
    from k3ckpt.requant.metrics import error_stats_rows
    from k3ckpt.requant.worker import requant_weight

    rng = np.random.default_rng(2)
    packed, scale = _mxfp4(rng, (48, 256), 116, 128)
    for method in ("refit", "keep-scales"):
        parts, r = requant_weight(packed, scale, "moet-w2", method, name="w")
        codes = get_format("moet-w2").from_mxfp4(packed, scale, method=method)
        assert np.array_equal(parts["packed"], codes["packed"]) and np.array_equal(parts["scale"], codes["scale"])
        src = get_format("mxfp4-pack-quantized").decode({"packed": packed, "scale": scale})
        out = get_format("moet-w2").decode(codes)
        stats, top = error_stats_rows(src, out)
        assert r.stats == stats and r.max_row_bias == top / stats.ref_rms
        assert r.code_histogram == tensor_stats.code_histogram(codes["packed"])
        assert r.source_zero_fraction == tensor_stats.zero_codes(packed) / (2 * packed.size)
        assert r.bytes == codes["packed"].nbytes + codes["scale"].nbytes and r.params == 256 * 48
        assert r.scale_changes == (int(np.count_nonzero(codes["scale"] != scale)) if method == "refit" else None)
