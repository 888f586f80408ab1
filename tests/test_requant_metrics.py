"""error_stats: the one error metric (numba kernel vs numpy reference, definitions, edge cases)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from k3ckpt.errors import NaNScaleError, ShapeError, UsageError
from k3ckpt.requant.metrics import ErrorStats, error_stats, error_stats_reference


def _pair(rng, shape, dtype=np.float32, noise=0.3):
    x = rng.standard_normal(shape).astype(dtype)
    y = (x + noise * rng.standard_normal(shape)).astype(dtype)
    return x, y


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_equals_reference_bit_exact(dtype):
    rng = np.random.default_rng(0)
    x, y = _pair(rng, (37, 129), dtype)
    assert error_stats(x, y) == error_stats_reference(x, y)


def test_kernel_equals_reference_with_nonfinite_counted():
    rng = np.random.default_rng(1)
    x, y = _pair(rng, (64, 96))
    x[3, 5] = np.nan
    y[7, 1] = np.inf
    y[9, 9] = -np.inf
    a = error_stats(x, y, nonfinite="count")
    assert a == error_stats_reference(x, y, nonfinite="count")
    assert a.nonfinite == 3 and a.count == x.size - 3


def test_definitions_against_independent_float64():
    rng = np.random.default_rng(2)
    x, y = _pair(rng, (50, 70))
    st = error_stats(x, y)
    xd, yd = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    e = yd - xd
    sxx, see = math.fsum(xd * xd), math.fsum(e * e)
    assert st.count == x.size and st.nonfinite == 0
    assert st.snr_db == pytest.approx(10 * math.log10(sxx / see), rel=1e-12)
    assert st.rel_mse == pytest.approx(see / sxx, rel=1e-12)
    assert st.rel_rms == pytest.approx(math.sqrt(see / sxx), rel=1e-12)
    assert st.mean_bias == pytest.approx(math.fsum(e) / e.size, rel=1e-9, abs=1e-15)
    assert st.bias_rel_rms == pytest.approx(st.mean_bias / math.sqrt(sxx / e.size), rel=1e-9)
    assert st.max_abs == np.abs(e).max()
    cos = math.fsum(xd * yd) / math.sqrt(sxx * math.fsum(yd * yd))
    assert st.cosine == pytest.approx(cos, rel=1e-12)
    assert st.err_rms == pytest.approx(math.sqrt(see / e.size), rel=1e-12)


def test_known_values():
    x = np.ones(1000, np.float32)
    st = error_stats(x, np.full(1000, 1.5, np.float32))
    assert st.rel_mse == 0.25 and st.snr_db == pytest.approx(10 * math.log10(4))
    assert st.mean_bias == 0.5 and st.bias_rel_rms == 0.5 and st.max_abs == 0.5 and st.cosine == 1.0


def test_exact_match_and_all_zero_are_infinite_snr():
    x = np.arange(-5, 5, dtype=np.float32)
    for ref, approx in [(x, x.copy()), (np.zeros(8), np.zeros(8)), (np.zeros(0), np.zeros(0))]:
        st = error_stats(ref, approx)
        assert st.snr_db == math.inf and st.rel_mse == 0.0 and st.rel_rms == 0.0
        assert st.mean_bias == 0.0 and st.bias_rel_rms == 0.0 and st.max_abs == 0.0 and st.cosine == 1.0
        assert st == error_stats_reference(ref, approx)


def test_zero_reference_nonzero_approx():
    st = error_stats(np.zeros(4), np.array([0.0, 0.0, 1.0, 0.0]))
    assert st.snr_db == -math.inf and st.rel_mse == math.inf and st.rel_rms == math.inf
    assert st.bias_rel_rms == math.inf and st.cosine == 0.0
    neg = error_stats(np.zeros(4), np.array([0.0, -2.0, 0.0, 0.0]))
    assert neg.bias_rel_rms == -math.inf
    assert st.to_dict()["snr_db"] == "-inf" and st.to_dict()["rel_mse"] == "inf"


def test_zero_approx_is_zero_db_and_orthogonal():
    st = error_stats(np.array([1.0, -2.0]), np.zeros(2))
    assert st.snr_db == 0.0 and st.rel_mse == 1.0 and st.cosine == 0.0


def test_nonfinite_raises_by_default():
    x = np.ones(8, np.float32)
    y = x.copy()
    y[2] = np.nan
    for f in (error_stats, error_stats_reference):
        with pytest.raises(NaNScaleError, match="1 positions"):
            f(x, y)
        with pytest.raises(NaNScaleError):
            f(y, x)


def test_all_nonfinite_counted_is_empty_stats():
    st = error_stats(np.full(3, np.nan), np.ones(3), nonfinite="count")
    assert st.count == 0 and st.nonfinite == 3 and st.snr_db == math.inf


def test_input_checks():
    with pytest.raises(ShapeError, match=r"\(2, 3\)"):
        error_stats(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(UsageError, match="nonfinite"):
        error_stats(np.zeros(2), np.zeros(2), nonfinite="skip")
    with pytest.raises(ShapeError, match="complex"):
        error_stats(np.zeros(2, np.complex64), np.zeros(2, np.complex64))


def test_other_dtypes_widen_exactly():
    rng = np.random.default_rng(3)
    x, y = _pair(rng, (16, 32))
    xb, yb = x.astype(ml_dtypes.bfloat16), y.astype(ml_dtypes.bfloat16)
    assert error_stats(xb, yb) == error_stats(xb.astype(np.float32), yb.astype(np.float32))
    assert error_stats(x.astype(np.float16), y) == error_stats(x.astype(np.float16).astype(np.float32), y)
    assert error_stats(np.arange(10), np.arange(10) + 1).mean_bias == 1.0


def test_non_contiguous_input():
    rng = np.random.default_rng(4)
    x, y = _pair(rng, (20, 40))
    assert error_stats(x.T, y.T) == error_stats_reference(np.ascontiguousarray(x.T), np.ascontiguousarray(y.T))


def test_stats_is_frozen():
    st = error_stats(np.ones(2), np.ones(2))
    assert isinstance(st, ErrorStats)
    with pytest.raises(AttributeError):
        st.snr_db = 1.0  # type: ignore[misc]


def _independent_row_bias(x, y):
    """max |mean(y - x)| over rows without non-finite pairs, summed exactly (math.fsum)."""
    xd, yd = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if xd.shape[-1] == 0:
        return 0.0
    xd, yd = xd.reshape(-1, xd.shape[-1]), yd.reshape(-1, yd.shape[-1])
    ok = (np.isfinite(xd) & np.isfinite(yd)).all(axis=1)
    return max((abs(math.fsum(yr - xr)) / xd.shape[1] for xr, yr in zip(xd[ok], yd[ok])), default=0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(7, 96), (1, 5), (33, 1), (0, 8), (4, 0), (3, 2, 40)])
def test_rows_pass_kernel_equals_reference(dtype, shape):
    """error_stats_rows: kernel and numpy twin give the same bits; error_stats is its first half;
    the row bias agrees with an exactly summed one to rounding."""
    from k3ckpt.requant.metrics import error_stats_rows, error_stats_rows_reference

    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(dtype)
    y = (x.astype(np.float64) + 0.01 * rng.standard_normal(shape) + 0.003).astype(dtype)
    stats, top = error_stats_rows(x, y)
    assert (stats, top) == error_stats_rows_reference(x, y)
    assert stats == error_stats(x, y)
    assert top == pytest.approx(_independent_row_bias(x, y), rel=1e-12, abs=1e-300)


def test_sums_follow_32_element_blocks_of_rows():
    """The documented order: in-block sums from +0.0, block sums added in row-major order."""
    from k3ckpt.requant.metrics import error_stats_rows

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 70)) * 10.0 ** rng.uniform(-8, 8, (3, 70))).astype(np.float64)
    y = x + rng.standard_normal(x.shape)
    sxx = 0.0
    for row in x:
        for j0 in range(0, 70, 32):
            block = 0.0
            for v in row[j0:j0 + 32]:
                block += v * v
            sxx += block
    assert error_stats(x, y).ref_rms == math.sqrt(sxx / x.size)
    assert error_stats_rows(x, y)[0].ref_rms == math.sqrt(sxx / x.size)


def test_rows_pass_with_nonfinite_counted():
    """Non-finite pairs leave the sums and their whole row leaves the max row bias."""
    from k3ckpt.requant.metrics import error_stats_rows, error_stats_rows_reference

    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    y = x + np.float32(0.05) * rng.standard_normal(x.shape).astype(np.float32)
    y[0] += np.float32(1.0)      # the worst row, then made non-finite
    x[0, 5] = np.nan
    y[4, 1] = np.inf
    stats, top = error_stats_rows(x, y, nonfinite="count")
    assert (stats, top) == error_stats_rows_reference(x, y, nonfinite="count")
    assert stats == error_stats(x, y, nonfinite="count") and stats.nonfinite == 2
    assert top == pytest.approx(_independent_row_bias(x, y), rel=1e-12) and top < 0.5
    with pytest.raises(NaNScaleError):
        error_stats_rows(x, y)


