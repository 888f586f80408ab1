"""What the llama.cpp-family encoders (``requant.iq2xs``, ``grid_search`` for iq1s, iq2xxs and
iq2s, ``q2_k``) share.

Input checks, the importance matrix, fp16 rounding of a super-block's scales
(plain Python, compiled once more for the kernels), and the E8-grid search
pieces both i-quants run: the grid in norm-class order and the SIMD-lane pass
that finds each class's best point (``half_sums`` then ``class_argmax``).
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np

from .._numba import njit
from ..errors import NaNScaleError, ShapeError, UsageError

__all__ = ["QK", "TINY", "as_rows", "best_d", "bit_fields", "block_inputs", "check_imatrix", "check_rows",
           "class_argmax", "class_argmax_plain", "f16_bits", "grid_classes", "half_offsets", "half_sums",
           "pattern_mins", "pattern_sums", "round_f16"]

QK = 256                     # weights per super-block
F16_MAX = 65504.0
TINY = 2.0 ** -24            # smallest fp16 subnormal: below it nothing is representable
_jit = functools.partial(njit, error_model="numpy")  # no ZeroDivisionError branch: lets loops vectorise


# ------------------------------------------------------------------ checks
def check_rows(x, label: str, *, name: str | None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Encoder input: finite float32 ``[..., K]``, K a multiple of 256 -> rows ``[M, K]`` and its shape."""
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim < 1:
        raise ShapeError(f"{label} encoder input must be float32 [..., K], found {x.dtype} {list(x.shape)}",
                         tensor=name)
    k = x.shape[-1]
    if k % QK:
        raise ShapeError(
            f"{label} is not applicable: it stores super-blocks of {QK} weights along the last axis and "
            f"K = {k} is not a multiple of {QK} (gpt-oss's 2880 is not; K3's 3584 and 3072 are)",
            tensor=name,
        )
    x2 = np.ascontiguousarray(x).reshape(math.prod(x.shape[:-1]), k)
    if not np.isfinite(x2).all():
        flat = int(np.flatnonzero(~np.isfinite(x2.reshape(-1)))[0])
        where = list(map(int, np.unravel_index(flat, x.shape)))
        raise NaNScaleError(f"cannot encode non-finite value {x2.reshape(-1)[flat]} at {where} as {label}",
                            tensor=name)
    return x2, x.shape


def check_imatrix(imatrix, k: int, *, name: str | None = None) -> np.ndarray:
    """The importance per column as float32 ``[K]``, scaled by a power of two to a largest value
    in [0.5, 1) (the error weighs relative importance only); None -> all ones.

    Raises:
        UsageError: wrong length, negative or non-finite values.
    """
    if imatrix is None:
        return np.ones(k, np.float32)
    q = np.asarray(imatrix)
    if q.ndim != 1 or q.shape[0] != k or not (q.dtype.kind == "f" or q.dtype.kind in "iu"):
        raise UsageError(f"the importance matrix must be one number per column ({k}), "
                         f"found {q.dtype} {list(q.shape)}", tensor=name)
    q = q.astype(np.float32)
    if not np.isfinite(q).all() or (q < 0).any():
        bad = int(np.flatnonzero(~(np.isfinite(q) & (q >= 0)))[0])
        raise UsageError(f"importance values must be finite and >= 0, column {bad} is {q[bad]}", tensor=name)
    top = float(q.max()) if k else 0.0
    if top == 0.0:
        return np.ones(k, np.float32)
    return (q * np.float32(math.ldexp(1.0, -math.frexp(top)[1]))).astype(np.float32)


def block_inputs(x, imatrix, label: str, *, name: str | None) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """An encoder's input as super-blocks: ``x`` (``check_rows``) as float32 ``[M * K/256, 256]``,
    the importance (``check_imatrix``) as ``[K/256, 256]`` (super-block i reads row i % (K/256);
    a row of zeros is all ones: nothing in it would weigh), and ``x``'s shape."""
    x2, shape = check_rows(x, label, name=name)
    qw = check_imatrix(imatrix, x2.shape[1], name=name).reshape(-1, QK)
    qw[~(qw > np.float32(0.0)).any(axis=1)] = np.float32(1.0)
    return x2.reshape(-1, QK), qw, shape


def bit_fields(fields: np.ndarray, width: int) -> np.ndarray:
    """``fields[..., j]`` (j < 4, each below ``2 ** width``) packed as ``sum fields[..., j] << (width j)``
    into int64 ``[...]``: explicit shifts and ors (numpy's sum over a short last axis is several
    times slower, a noticeable part of a fast encoder's time)."""
    f = fields.astype(np.int64, copy=False)
    return f[..., 0] | (f[..., 1] << width) | (f[..., 2] << (2 * width)) | (f[..., 3] << (3 * width))


def as_rows(blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Bytes per super-block ``[n, B]`` of an input of ``shape`` ``[..., K]`` as ``[..., K/256*B]``."""
    return blocks.reshape(tuple(shape[:-1]) + (shape[-1] // QK * blocks.shape[-1],))


# ----------------------------------------------------------- fp16 rounding
def round_f16(v: float) -> float:
    """float64 ``v`` (finite, >= 0) rounded to the nearest fp16 value, ties to even;
    values above 65504 clamp to 65504 (no infinity)."""
    if v >= F16_MAX:
        return F16_MAX
    if v < 2.0 ** -14:                                  # subnormal fp16: a multiple of 2^-24
        return float(np.rint(v * 2.0 ** 24)) * 2.0 ** -24
    _, e = math.frexp(v)                                # v = m * 2^e, 0.5 <= m < 1
    ulp = math.ldexp(1.0, e - 11)                       # 11 significant bits
    return float(np.rint(v / ulp)) * ulp


def f16_bits(q: float) -> int:
    """Bits of an fp16-representable ``q >= 0`` (from ``round_f16``)."""
    if q == 0.0:
        return 0
    if q < 2.0 ** -14:
        return int(q * 2.0 ** 24)
    m, e = math.frexp(q)
    return ((e - 1 + 15) << 10) | int((2.0 * m - 1.0) * 1024.0)


_round_f16_nb = _jit(round_f16)    # the same plain functions, compiled: one definition
_f16_bits_nb = _jit(f16_bits)


def best_d(d0: float, unscale: float, d_mult, eval_d):
    """The references' fp16 ``d`` candidates ``d0 * m`` (normalised, ``unscale`` the block's power of
    two): the first with the least ``eval_d(dn)[0]``; returns ``(total, dn, eval_d(dn)[1])``,
    ``dn`` 0.0 when every candidate underflows fp16."""
    best_total, best_dn, s_sel = np.inf, 0.0, None
    for m in d_mult:
        dn = round_f16(d0 * m * unscale) / unscale
        if dn == 0.0:
            continue
        tot, sc = eval_d(dn)
        if tot < best_total:
            best_total, best_dn, s_sel = tot, dn, sc
    return best_total, best_dn, s_sel


# ------------------------------------------------------------- E8 grids
def grid_classes(grid: np.ndarray, levels=(8, 25, 43), *, by_sum: bool = False) -> types.SimpleNamespace:
    """An i-quant grid (integer [P, 8], each entry one of three ``levels``: 8 / 25 / 43, or
    IQ1's -1 / 0 / 1) in class order: classes of equal ``|g|^2`` (and, ``by_sum``, equal
    ``sum g``: with a shift ``delta`` added to every entry, ``|g + delta|^2`` is equal within
    such a class).

    ``order[i]``: grid index of sorted point i; ``gt`` float32 [8, P] the sorted points
    transposed; ``cls_start`` int64 [C+1] class boundaries; ``cls_norm`` float64 [C]
    ``|g|^2``, ascending.  Halves: each point's elements 0-3 and 4-7 as one of 81 patterns
    ``u = d0 + 3 d1 + 9 d2 + 27 d3`` (``d_j`` element j's index into ``lev`` = the levels),
    ``lo[i]`` / ``hi[i]``.  Arrays are writable: the caller adds its own and freezes them all
    (``freeze``).
    """
    grid = grid.astype(np.int64)
    norm = (grid * grid).sum(axis=1)
    key = norm * (32 * len(grid[0]) + 1) + (grid.sum(axis=1) + 16 * len(grid[0])) if by_sum else norm
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    starts = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]])
    digit = np.searchsorted(np.asarray(levels), grid[order])   # [P, 8] in 0..2
    assert np.array_equal(np.asarray(levels)[digit], grid[order]), "grid entries outside its levels"
    weights = 3 ** np.arange(4)
    return types.SimpleNamespace(
        order=order.astype(np.int64),
        gt=np.ascontiguousarray(grid[order].T.astype(np.float32)),
        cls_start=np.r_[starts, len(order)].astype(np.int64),
        cls_norm=norm[order][starts].astype(np.float64),
        lo=(digit[:, :4] @ weights).astype(np.int64),
        hi=(digit[:, 4:] @ weights).astype(np.int64),
        lev=np.asarray(levels, np.float32),
    )


def freeze(t: types.SimpleNamespace) -> types.SimpleNamespace:
    for arr in vars(t).values():
        arr.flags.writeable = False
    return t


@_jit
def half_offsets(lo, hi, nl, ou, ow):
    """Row offsets into ``half_sums``' flat ``hh`` of each point's two halves (uint64: no
    wraparound checks in the hot loop)."""
    for i in range(lo.shape[0]):
        ou[i] = np.uint64(lo[i] * 2 * nl)
        ow[i] = np.uint64((81 + hi[i]) * 2 * nl)


@_jit
def pattern_sums(src, p2, p3, h4, slot):
    """Per half h and pattern u = d0 + 3 d1 + 9 d2 + 27 d3, ``h4[h, u, slot, k]`` =
    ((s0 + s1) + s2) + s3 of ``src[4 h + j, d_j, k]`` (element j at level d_j, lane k).  Built
    up element by element (``p2`` [9, L], ``p3`` [27, L] scratch), one store per loop: few alias
    checks, so it vectorises."""
    nl = src.shape[2]
    for h in range(2):
        j = 4 * h
        for d1 in range(3):
            for d0 in range(3):
                r = d0 + 3 * d1
                for k in range(nl):
                    p2[r, k] = src[j, d0, k] + src[j + 1, d1, k]
        for d2 in range(3):
            for r in range(9):
                for k in range(nl):
                    p3[r + 9 * d2, k] = p2[r, k] + src[j + 2, d2, k]
        for d3 in range(3):
            for r in range(27):
                u = r + 27 * d3
                for k in range(nl):
                    h4[h, u, slot, k] = p3[r, k] + src[j + 3, d3, k]


@_jit
def pattern_mins(src, hpf, m2, m3, h4, slot):
    """``pattern_sums`` with the least element instead of the sum, times ``hpf[k]``."""
    nl = src.shape[2]
    for h in range(2):
        j = 4 * h
        for d1 in range(3):
            for d0 in range(3):
                r = d0 + 3 * d1
                for k in range(nl):
                    q0 = src[j, d0, k]
                    q1 = src[j + 1, d1, k]
                    m2[r, k] = q0 if q0 < q1 else q1
        for d2 in range(3):
            for r in range(9):
                for k in range(nl):
                    q = src[j + 2, d2, k]
                    mq = m2[r, k]
                    m3[r + 9 * d2, k] = mq if mq < q else q
        for d3 in range(3):
            for r in range(27):
                u = r + 27 * d3
                for k in range(nl):
                    q = src[j + 3, d3, k]
                    mq = m3[r, k]
                    h4[h, u, slot, k] = hpf[k] * (mq if mq < q else q)


@_jit
def half_sums(prods, prodm, hpf, p2, m2, p3, m3, hh):
    """Per half h and pattern u, ``hh`` (flat [2, 81, 2, L]) gets ``hs`` = ((p0 + p1) + p2) + p3
    of ``prods`` (``pattern_sums``) then ``hq`` = hpf * min p_j of ``prodm`` (``pattern_mins``;
    ``prod*[j, v, k]``: element j at level v for lane k; times 2 or 0 is exact, so the smaller hq
    of the two halves is hpf * the least of all 8)."""
    h4 = hh.reshape((2, 81, 2, hpf.shape[0]))     # multi-dimensional indexing in the build loops
    pattern_sums(prods, p2, p3, h4, 0)
    pattern_mins(prodm, hpf, m2, m3, h4, 1)


@_jit
def _keep(v, best, arg, f):
    """A lane's running maximum and its point after point ``f`` scores ``v``: strict, so the
    first maximum stays, as numpy's argmax keeps it."""
    take = v > best
    return (v if take else best), (f if take else arg)


@_jit
def _score(hh, o1, o2, unl, uk, flip):
    """``hs lo + hs hi`` of the point whose halves' rows start at o1, o2, less ``min(hq lo, hq hi)``
    when ``flip`` (a branch on an argument: the compiled loops split on it)."""
    v = hh[o1 + uk] + hh[o2 + uk]
    if flip:
        m = hh[o1 + unl + uk]
        mm = hh[o2 + unl + uk]
        v = v - (m if m < mm else mm)
    return v


@_jit
def _argmax_pass(hh, ou, ow, cls_start, init, acc, flip):
    """The pass of ``class_argmax`` (``flip``) and ``class_argmax_plain``."""
    nl = acc.shape[1] // 2
    unl = np.uint64(nl)
    for c in range(acc.shape[0]):
        for k in range(nl):
            acc[c, k] = init
            acc[c, nl + k] = 0.0
        i = cls_start[c]
        end = cls_start[c + 1]
        while i + 4 <= end:
            a0, a1, a2, a3 = ou[i], ou[i + 1], ou[i + 2], ou[i + 3]
            b0, b1, b2, b3 = ow[i], ow[i + 1], ow[i + 2], ow[i + 3]
            f0 = np.float32(i)
            for k in range(nl):
                uk = np.uint64(k)
                best, arg = _keep(_score(hh, a0, b0, unl, uk, flip), acc[c, k], acc[c, nl + k], f0)
                best, arg = _keep(_score(hh, a1, b1, unl, uk, flip), best, arg, f0 + np.float32(1.0))
                best, arg = _keep(_score(hh, a2, b2, unl, uk, flip), best, arg, f0 + np.float32(2.0))
                best, arg = _keep(_score(hh, a3, b3, unl, uk, flip), best, arg, f0 + np.float32(3.0))
                acc[c, k] = best
                acc[c, nl + k] = arg
            i += 4
        for i in range(i, end):
            o1 = ou[i]
            o2 = ow[i]
            fi = np.float32(i)
            for k in range(nl):
                acc[c, k], acc[c, nl + k] = _keep(_score(hh, o1, o2, unl, np.uint64(k), flip), acc[c, k],
                                                  acc[c, nl + k], fi)


@_jit
def class_argmax(hh, ou, ow, cls_start, init, acc):
    """``acc[c, k]``: the largest ``(hs lo + hs hi) - min(hq lo, hq hi)`` over class c's points
    for lane k (from ``init``), and ``acc[c, L + k]`` the first point reaching it (its index, as
    float32: exact).  Four points at a time, in order, so a lane's running maximum stays in a
    register between them (12-16% faster than one at a time); the lane loop vectorises with the
    argmax in it."""
    _argmax_pass(hh, ou, ow, cls_start, init, acc, True)


@_jit
def class_argmax_plain(hh, ou, ow, cls_start, init, acc):
    """``class_argmax`` for lanes that force no flip (no parity rule: every ``hq`` is a zero):
    ``(hs lo + hs hi)`` alone, the same decisions with half the loads."""
    _argmax_pass(hh, ou, ow, cls_start, init, acc, False)

