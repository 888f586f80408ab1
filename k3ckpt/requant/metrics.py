"""One error metric for every requantization report and test.

``error_stats(ref, approx)`` compares a reference tensor (for k3ckpt: the
decoded MXFP4 source) with its approximation and returns an ``ErrorStats``.
All sums are float64, accumulated left to right in element order (C order).
The numba kernel and its numpy reference (``error_stats_reference``) use the
same order, so they agree to the bit.

Definitions (x = ref, y = approx, e = y - x, n = count of finite pairs):

- ``snr_db   = 10*log10(sum x^2 / sum e^2)``
- ``rel_mse  = sum e^2 / sum x^2``;  ``rel_rms = sqrt(rel_mse)``
- ``mean_bias = sum e / n`` (positive: approx too large on average)
- ``bias_rel_rms = mean_bias / sqrt(sum x^2 / n)``
- ``max_abs = max |e|``;  ``cosine = sum x*y / sqrt(sum x^2 * sum y^2)``

Degenerate cases are defined, never NaN:

- exact match (sum e^2 == 0, including an all-zero ref and approx and an empty
  input): snr_db = +inf, rel_mse = rel_rms = 0, bias 0, cosine 1;
- ref all zero but approx not: snr_db = -inf, rel_mse = rel_rms = +inf,
  bias_rel_rms = +-inf (sign of the bias), cosine 0;
- approx all zero but ref not: cosine 0 (snr_db is 0 dB, as the formula says).

Non-finite inputs (NaN, +-inf) are never skipped silently.  E2M1 has no NaN
or inf, so in a decoded MXFP4 tensor they come from E8M0 0xFF scales (NaN) or
from float32 overflow at scale bytes >= 253.  ``nonfinite="raise"`` (default)
raises ``NaNScaleError``; ``nonfinite="count"`` leaves those positions out of
every sum and reports how many there were in ``ErrorStats.nonfinite``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import NaNScaleError, ShapeError, UsageError

NONFINITE_POLICIES = ("raise", "count")


@dataclass(frozen=True)
class ErrorStats:
    """Error of ``approx`` against ``ref``; see the module docstring for definitions."""

    count: int            # finite pairs the sums cover
    nonfinite: int        # positions left out because ref or approx was NaN/inf
    snr_db: float
    rel_mse: float
    rel_rms: float
    mean_bias: float
    bias_rel_rms: float
    max_abs: float
    cosine: float
    ref_rms: float        # sqrt(sum x^2 / n)
    err_rms: float        # sqrt(sum e^2 / n)

    def __post_init__(self) -> None:
        assert self.count >= 0 and self.nonfinite >= 0

    def to_dict(self) -> dict:
        """JSON-ready dict; infinities become the strings "inf" / "-inf"."""
        out = {}
        for k, v in asdict(self).items():
            if isinstance(v, float) and math.isinf(v):
                v = "inf" if v > 0 else "-inf"
            out[k] = v
        return out


# Sums vector layout shared by kernel, reference and _finish.
_SXX, _SYY, _SEE, _SE, _SXY, _MAXABS, _N, _BAD = range(8)


def _accumulate_loop(ref, approx):
    """float64 sums over finite pairs of a [rows, K] pair, strictly in element order
    (see module doc), and in the same pass the largest |mean(approx - ref)| of a row,
    summed left to right in float64 as ``tensor_stats.max_row_bias`` does."""
    sxx = 0.0
    syy = 0.0
    see = 0.0
    se = 0.0
    sxy = 0.0
    maxabs = 0.0
    n = 0
    bad = 0
    top = 0.0
    k = ref.shape[1]
    for r in range(ref.shape[0]):
        row = 0.0
        for j in range(k):
            x = np.float64(ref[r, j])
            y = np.float64(approx[r, j])
            e = y - x
            row += e
            if not (math.isfinite(x) and math.isfinite(y)):
                bad += 1
                continue
            sxx += x * x
            syy += y * y
            see += e * e
            se += e
            sxy += x * y
            a = abs(e)
            if a > maxabs:
                maxabs = a
            n += 1
        if k:
            m = abs(row / k)
            if m > top:
                top = m
    out = np.empty(8, np.float64)
    out[_SXX] = sxx
    out[_SYY] = syy
    out[_SEE] = see
    out[_SE] = se
    out[_SXY] = sxy
    out[_MAXABS] = maxabs
    out[_N] = n
    out[_BAD] = bad
    return out, top


@functools.cache
def _accumulate():
    """The numba kernel of ``_accumulate_loop``, compiled (or loaded from numba's cache)
    on first use, so that reading a report (``k3ckpt report``) never imports numba."""
    from .._numba import njit

    return njit(_accumulate_loop)


def _sums(r: np.ndarray, a: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """(sums vector, max row bias) of flat ``r`` and ``a`` read as rows of ``k``."""
    if k and r.size:
        return _accumulate()(r.reshape(-1, k), a.reshape(-1, k))
    return _accumulate()(r.reshape(1, -1), a.reshape(1, -1))


def _sequential_sum(v: np.ndarray) -> float:
    # np.sum is pairwise; np.cumsum (add.accumulate) adds strictly left to right,
    # which is the order the kernel uses.
    return float(np.cumsum(v)[-1]) if v.size else 0.0


def _accumulate_reference(ref: np.ndarray, approx: np.ndarray) -> np.ndarray:
    x = ref.astype(np.float64)
    y = approx.astype(np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    bad = int(ok.size - np.count_nonzero(ok))
    x = x[ok]
    y = y[ok]
    e = y - x
    out = np.zeros(8, np.float64)
    out[_SXX] = _sequential_sum(x * x)
    out[_SYY] = _sequential_sum(y * y)
    out[_SEE] = _sequential_sum(e * e)
    out[_SE] = _sequential_sum(e)
    out[_SXY] = _sequential_sum(x * y)
    out[_MAXABS] = float(np.max(np.abs(e))) if e.size else 0.0
    out[_N] = x.size
    out[_BAD] = bad
    return out


def _flat(a, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind not in "fiub" and not _is_ml_float(a.dtype):
        raise ShapeError(f"{what} must be a real numeric array, found dtype {a.dtype}")
    if a.dtype not in (np.float32, np.float64):
        # float16, bfloat16 / float8 (ml_dtypes), ints: every value is exact in float64.
        a = a.astype(np.float64)
    return np.ascontiguousarray(a).reshape(-1)


def _is_ml_float(dt: np.dtype) -> bool:
    # ml_dtypes floats (bfloat16, float8_*) are numpy void-kind dtypes.
    if dt.kind != "V":
        return False
    import ml_dtypes

    try:
        ml_dtypes.finfo(dt)
    except (TypeError, ValueError):
        return False
    return True


def _prepare(ref, approx, nonfinite: str) -> tuple[np.ndarray, np.ndarray]:
    if nonfinite not in NONFINITE_POLICIES:
        raise UsageError(f"nonfinite must be one of {NONFINITE_POLICIES}, found {nonfinite!r}")
    ref_a = np.asarray(ref)
    approx_a = np.asarray(approx)
    if ref_a.shape != approx_a.shape:
        raise ShapeError(f"ref and approx shapes differ: expected {ref_a.shape}, found {approx_a.shape}")
    return _flat(ref_a, "ref"), _flat(approx_a, "approx")


def _finish(s: np.ndarray, nonfinite: str) -> ErrorStats:
    n = int(s[_N])
    bad = int(s[_BAD])
    if bad and nonfinite == "raise":
        raise NaNScaleError(
            f"{bad} positions hold NaN or inf in ref or approx (E2M1 has neither: they come from "
            "E8M0 0xFF scales or float32 overflow); pass nonfinite='count' to leave them out"
        )
    sxx, syy, see, se, sxy = (float(s[i]) for i in (_SXX, _SYY, _SEE, _SE, _SXY))
    mean_bias = se / n if n else 0.0
    ref_rms = math.sqrt(sxx / n) if n else 0.0
    err_rms = math.sqrt(see / n) if n else 0.0
    if see == 0.0:  # exact match (also all-zero and empty inputs)
        snr_db, rel_mse = math.inf, 0.0
    elif sxx == 0.0:
        snr_db, rel_mse = -math.inf, math.inf
    else:
        rel_mse = see / sxx
        snr_db = 10.0 * math.log10(sxx / see)
    if mean_bias == 0.0:
        bias_rel = 0.0
    elif ref_rms == 0.0:
        bias_rel = math.copysign(math.inf, mean_bias)
    else:
        bias_rel = mean_bias / ref_rms
    if sxx == 0.0 and syy == 0.0:
        cosine = 1.0
    elif sxx == 0.0 or syy == 0.0:
        cosine = 0.0
    else:
        cosine = sxy / math.sqrt(sxx * syy)
    return ErrorStats(
        count=n,
        nonfinite=bad,
        snr_db=snr_db,
        rel_mse=rel_mse,
        rel_rms=math.sqrt(rel_mse),
        mean_bias=mean_bias,
        bias_rel_rms=bias_rel,
        max_abs=float(s[_MAXABS]),
        cosine=cosine,
        ref_rms=ref_rms,
        err_rms=err_rms,
    )


def error_stats(ref, approx, *, nonfinite: str = "raise") -> ErrorStats:
    """Error of ``approx`` against ``ref`` (same shape, any real dtype); numba kernel."""
    r, a = _prepare(ref, approx, nonfinite)
    return _finish(_sums(r, a, r.size)[0], nonfinite)


def error_stats_rows(ref, approx, *, nonfinite: str = "raise") -> tuple[ErrorStats, float]:
    """``error_stats(ref, approx)`` and ``tensor_stats.max_row_bias(ref, approx)`` of
    arrays whose last axis is the row, in one pass; the same bits as calling the two."""
    r, a = _prepare(ref, approx, nonfinite)
    sums, top = _sums(r, a, np.shape(ref)[-1] if np.ndim(ref) else 1)
    return _finish(sums, nonfinite), float(top)


def error_stats_reference(ref, approx, *, nonfinite: str = "raise") -> ErrorStats:
    """Plain-numpy twin of ``error_stats``; identical bits, much slower."""
    r, a = _prepare(ref, approx, nonfinite)
    return _finish(_accumulate_reference(r, a), nonfinite)
