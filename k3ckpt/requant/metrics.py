"""One error metric for every requantization report and test.

``error_stats(ref, approx)`` compares a reference tensor (for k3ckpt: the
decoded MXFP4 source) with its approximation and returns an ``ErrorStats``.
All sums are float64 in one fixed order, so the numba kernel, its numpy
reference (``error_stats_reference``) and the fused MXFP4 -> moet-w2 kernel
(``moet_fused``) agree to the bit:

- the arrays are read as rows of their last axis (a 0-d or 1-d array is one
  row), and each row as blocks of ``BLOCK`` = 32 consecutive elements (the
  last block of a row may be shorter);
- each sum is taken within a block, from +0.0, left to right;
- block sums are added, from +0.0, in row-major block order.

Blocks are the 32-element scale blocks of the MX formats, so a kernel that
knows a block's values exactly (MXFP4 in, 2-bit codes out) gets its block sums
from integer tables: in-order float64 sums of exact terms are exact.  The max
row bias (``error_stats_rows``) adds a row's block error sums in block order;
rows holding a non-finite pair are left out of it.

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
from dataclasses import dataclass

import numpy as np

from ..errors import NaNScaleError, ShapeError, UsageError

NONFINITE_POLICIES = ("raise", "count")


@dataclass(frozen=True, slots=True)
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
        for k in self.__slots__:   # fields in order; asdict's deep copy took ~25 us a result
            v = getattr(self, k)
            if isinstance(v, float) and math.isinf(v):
                v = "inf" if v > 0 else "-inf"
            out[k] = v
        return out


def snr_from_sums(sum_ref_sq: float, sum_err_sq: float) -> float:
    """``10*log10(sum x^2 / sum e^2)`` with the module's degenerate cases (+inf exact, -inf zero ref)."""
    if sum_err_sq == 0.0:
        return math.inf
    if sum_ref_sq == 0.0:
        return -math.inf
    return 10.0 * math.log10(sum_ref_sq / sum_err_sq)


def pooled_snr_db(stats) -> float:
    """SNR of several tensors taken together: their energies summed (``math.fsum``), never an
    average of dBs; what ``error_stats`` gives over the concatenated tensors, up to rounding."""
    sxx, see = [], []
    for s in stats:
        sxx.append(s.count * s.ref_rms * s.ref_rms)
        see.append(s.count * s.err_rms * s.err_rms)
    return snr_from_sums(math.fsum(sxx), math.fsum(see))


def weighted_sums(ref, approx, columns) -> tuple[float, float]:
    """``(sum_ij w_j x_ij^2, sum_ij w_j (x_ij - y_ij)^2)`` in float64 for ``[N, K]`` tensors and
    importance ``columns`` ``[K]`` (``--imatrix``): the error an importance matrix weighs, pooled
    across tensors by adding the sums (``snr_from_sums`` of them is the weighted SNR)."""
    x = np.asarray(ref, np.float32).reshape(-1, np.shape(columns)[-1])
    y = np.asarray(approx, np.float32).reshape(x.shape)
    w = np.asarray(columns, np.float64)
    e = x.astype(np.float64) - y
    return float(np.einsum("ij,ij->j", x, x, dtype=np.float64) @ w), float(np.einsum("ij,ij->j", e, e) @ w)


# Sums vector layout shared by kernels, reference and _finish.
_SXX, _SYY, _SEE, _SE, _SXY, _MAXABS, _N, _BAD = range(8)
BLOCK = 32


def _block_into(ref, approx, r, j0, j1, acc):
    """Add block ``ref[r, j0:j1]`` / ``approx[r, j0:j1]`` to ``acc`` (the sums vector) in the
    module doc's order; return (the block's error sum, whether it held a non-finite pair)."""
    bxx = 0.0
    byy = 0.0
    bee = 0.0
    be = 0.0
    bxy = 0.0
    bad = 0
    top = acc[_MAXABS]          # a local, so the loop keeps it in a register (a maximum is exact in any order)
    for j in range(j0, j1):
        x = np.float64(ref[r, j])
        y = np.float64(approx[r, j])
        if not (math.isfinite(x) and math.isfinite(y)):
            bad += 1
            continue
        e = y - x
        bxx += x * x
        byy += y * y
        bee += e * e
        be += e
        bxy += x * y
        a = abs(e)
        top = a if a > top else top
    acc[_MAXABS] = top
    acc[_SXX] += bxx
    acc[_SYY] += byy
    acc[_SEE] += bee
    acc[_SE] += be
    acc[_SXY] += bxy
    acc[_N] += (j1 - j0) - bad
    acc[_BAD] += bad
    return be, bad > 0


def _accumulate_loop(ref, approx):
    """(sums vector, max row bias) of a [rows, K] pair, in the order of the module doc."""
    acc = np.zeros(8, np.float64)
    top = 0.0
    k = ref.shape[1]
    for r in range(ref.shape[0]):
        row = 0.0
        row_bad = False
        for j0 in range(0, k, BLOCK):
            be, bad = _block_into(ref, approx, r, j0, min(j0 + BLOCK, k), acc)
            row += be
            row_bad = row_bad or bad
        if k and not row_bad:
            m = abs(row / k)
            if m > top:
                top = m
    return acc, top


@functools.cache
def _kernels():
    """(block helper, rows kernel) jitted (or loaded from numba's cache) on first use, so that
    reading a report (``k3ckpt report``) never imports numba."""
    from .._numba import njit, njit_with

    block_into = njit(inline="always")(_block_into)
    return block_into, njit_with(_accumulate_loop, _block_into=block_into)


def _rows(a: np.ndarray) -> np.ndarray:
    """``a`` as [rows, K] of its last axis (0-d and 1-d: one row)."""
    return a.reshape(1, -1) if a.ndim < 2 else a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def _ordered_sums(t: np.ndarray) -> np.ndarray:
    """float64 sums over the last axis from +0.0, left to right (np.cumsum is sequential;
    np.sum is pairwise, another order)."""
    return np.cumsum(np.concatenate([np.zeros(t.shape[:-1] + (1,)), t], axis=-1), axis=-1)[..., -1]


def _accumulate_reference(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Numpy twin of ``_accumulate_loop`` on float64 [rows, K]: the same sums in the same order."""
    rows, k = x.shape
    ok = np.isfinite(x) & np.isfinite(y)
    out = np.zeros(8, np.float64)
    out[_N] = np.count_nonzero(ok)
    out[_BAD] = ok.size - out[_N]
    if x.size == 0:
        return out, 0.0
    nb = -(-k // BLOCK)
    pad = ((0, 0), (0, nb * BLOCK - k))
    # Left-out and padding positions add +0.0: no change to a sum that starts at +0.0.
    x = np.pad(np.where(ok, x, 0.0), pad).reshape(rows, nb, BLOCK)
    y = np.pad(np.where(ok, y, 0.0), pad).reshape(rows, nb, BLOCK)
    e = y - x
    for i, t in ((_SXX, x * x), (_SYY, y * y), (_SEE, e * e), (_SE, e), (_SXY, x * y)):
        out[i] = _ordered_sums(_ordered_sums(t).reshape(-1))
    out[_MAXABS] = float(np.max(np.abs(e)))
    row_bias = np.abs(_ordered_sums(_ordered_sums(e)) / k)[ok.all(axis=1)]
    return out, float(row_bias.max()) if row_bias.size else 0.0


def _flat(a, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind not in "fiub" and not _is_ml_float(a.dtype):
        raise ShapeError(f"{what} must be a real numeric array, found dtype {a.dtype}")
    if a.dtype not in (np.float32, np.float64):
        # float16, bfloat16 / float8 (ml_dtypes), ints: every value is exact in float64.
        a = a.astype(np.float64)
    return _rows(np.ascontiguousarray(a))


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
    snr_db = snr_from_sums(sxx, see)
    if see == 0.0:  # exact match (also all-zero and empty inputs)
        rel_mse = 0.0
    elif sxx == 0.0:
        rel_mse = math.inf
    else:
        rel_mse = see / sxx
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
    return error_stats_rows(ref, approx, nonfinite=nonfinite)[0]


def error_stats_rows(ref, approx, *, nonfinite: str = "raise") -> tuple[ErrorStats, float]:
    """``error_stats(ref, approx)`` and the largest |mean(approx - ref)| of a row (last axis;
    rows with a non-finite pair left out), in one pass."""
    r, a = _prepare(ref, approx, nonfinite)
    sums, top = _kernels()[1](r, a)
    return _finish(sums, nonfinite), float(top)


def error_stats_reference(ref, approx, *, nonfinite: str = "raise") -> ErrorStats:
    """Plain-numpy twin of ``error_stats``; identical bits, much slower."""
    return error_stats_rows_reference(ref, approx, nonfinite=nonfinite)[0]


def error_stats_rows_reference(ref, approx, *, nonfinite: str = "raise") -> tuple[ErrorStats, float]:
    """Plain-numpy twin of ``error_stats_rows``; identical bits."""
    r, a = _prepare(ref, approx, nonfinite)
    sums, top = _accumulate_reference(r.astype(np.float64), a.astype(np.float64))
    return _finish(sums, nonfinite), top
