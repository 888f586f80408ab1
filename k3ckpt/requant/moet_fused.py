"""MXFP4 -> moet-w2 and the report's numbers in one pass over the source.

``requant_moet(packed, scale, method)`` returns what ``moet.encode_refit`` /
``moet.encode_keep_scales`` return, bit for bit, and beside it everything
``worker.requant_weight`` reports for the weight: the shared metric's sums and
max row bias (the bits ``metrics.error_stats_rows`` gives on the decoded
source and output), the source's E2M1 zero count, the 2-bit code histogram
and the count of changed scales.  ``requant_moet_reference`` computes the same
by decoding both tensors to float32 with the numpy references; tests hold the
two equal.

Why one pass: decoding both tensors to float32 and measuring them took three
times as long as the encode itself.  Here a block's 32 source values are
E2M1 magnitudes under one exponent and its 32 outputs are levels under
another, so every per-block sum is a small integer sum over the block's
nibble histogram, exact in int32; the levels are powers of two, so each
candidate's error takes shifts, not multiplies (``_search``).  The metric
adds exact block sums in block order (``metrics`` module doc), so the sums
are the same float64 bits as summing decoded floats element by element.

Why stages: the candidate search and the sums are the same straight-line
arithmetic for every block, so ``_search`` and ``_block_sums`` are written
for LLVM's loop vectorizer (int32, no table loads, selects instead of
branches) and take 8 and 4 blocks per step; table lookups stay in the
scalar stages around them (the nibble counts before, the output codes
after).  On one 3072 x 3584 weight this took the pass from 14.1 to 10.5 ms,
and counting two nibbles per table load in stage 1 to 9.6 ms (one core, best
of 40 and of 150; ``tools/bench_requant.py``'s ``refit+report`` row measures
the same pass).  Blocks whose values overflow float32 (E8M0 bytes
>= 253, not seen in real weights) go through the metric's own per-element
block step instead.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import numpy as np

from ..formats import get_format, ids
from ..formats.e2m1 import E8M0_F32, NIBBLE_HI_F32, NIBBLE_LO_F32
from ..formats.moet_w2 import LEVELS
from . import metrics
from .moet import _MAG_UNITS, _REFIT_TABLES, KEEP_LUT, NIBBLE_TO_CODE, UNIT_EXP, check_mxfp4, level_codes

_FAST_MAX_SCALE = 252   # above this a value can overflow float32 (6 * 2^(253 - 127) > float32 max)


@dataclass(frozen=True)
class MoetPass:
    """One weight's moet-w2 parts and the numbers its report row needs."""

    codes: np.ndarray            # U8 [..., K/4]
    scale: np.ndarray            # U8 [..., K/32]
    stats: metrics.ErrorStats    # vs the decoded MXFP4 source
    max_row_bias: float          # max |mean(out - src)| of a row (not divided by the RMS)
    source_zeros: int            # E2M1 zero codes (+0 and -0) in the source
    code_histogram: tuple[int, int, int, int]
    scale_changes: int           # blocks whose E8M0 byte differs from the source's


# The candidates in moet.REFIT_WINDOW order: exponent offset d, the first magnitude index that
# rounds to the outer level b (the split t), and the inner level a = 2^(9 + d) units.  The search
# (``_search``) spells each candidate out with these numbers as literals, so that LLVM sees a
# straight-line loop body it can vectorize; ``_check_candidates`` holds them to moet's tables.
_CAND_D = np.array([0, -1, 1, -2, 2, -3, -4, -5], np.int64)
_CAND_SPLIT = np.array([5, 3, 7, 2, 8, 1, 1, 1], np.int64)
_UNIT_SHIFT = 9   # -UNIT_EXP: a magnitude of 1 is 2^9 units
_block_into = None   # the metric's per-element block step, bound by _kernel()
_LOW_HALF = 0 if sys.byteorder == "little" else 1   # which u32 of a u64 word holds lanes 0..3
_CHUNK_BLOCKS = 1024   # blocks per search call: rows enough to spread the call's set-up, few enough for L1/L2


def _candidate_levels() -> np.ndarray:
    """int64 [candidates, 8]: the level (units) each E2M1 magnitude rounds to, per candidate:
    a = 2^(9 + d) below the split, b = 4a from it on."""
    a = np.left_shift(1, _UNIT_SHIFT + _CAND_D)[:, None]
    return np.where(np.arange(8) < _CAND_SPLIT[:, None], a, 4 * a)


def _check_candidates() -> None:
    t = _REFIT_TABLES
    assert UNIT_EXP == -_UNIT_SHIFT and np.array_equal(t.d, _CAND_D)
    assert np.array_equal((_candidate_levels() - _MAG_UNITS) ** 2, t.err)
    for c in range(len(_CAND_D)):
        assert np.array_equal(_CODE16[c, :8], np.where(np.arange(8) < _CAND_SPLIT[c], 2, 3))
    assert np.array_equal(_CODE16[0], NIBBLE_TO_CODE)   # candidate 0: keep-scales
    assert np.array_equal(t.lut[0], KEEP_LUT)
    assert np.array_equal(_MAG_UNITS, np.array([0, 1, 2, 3, 4, 6, 8, 12]) << 8)   # _search's literals


def _nibble_lanes() -> np.ndarray:
    """MXFP4 byte -> its two nibbles counted in 4-bit lanes: a nibble of sign bit ``sign`` and
    magnitude index m adds 1 to lane 2m + sign (bits 4 (2m + sign) and up)."""
    b = np.arange(256)
    w = np.zeros(256, np.uint64)
    for nib in (b & 15, b >> 4):
        w += np.left_shift(np.uint64(1), (4 * (2 * (nib & 7) + (nib >> 3))).astype(np.uint64))
    return w


def _lane_counts(packed, r0, r1, nibble_lanes, both, pos):
    """Stage 1, rows r0..r1: per block, the counts of all nibbles by magnitude (byte lane m:
    magnitude m) and of the positive ones, as u64 words.  One table load per source byte adds
    its two nibbles into 4-bit lanes (``_nibble_lanes``); seven bytes (14 nibbles) at most per
    word keep every lane below 16, then the even lanes (positive) and odd lanes (negative) are
    spread into byte lanes."""
    nb = packed.shape[1] // 16
    low = np.uint64(0x0F0F0F0F0F0F0F0F)
    four = np.uint64(4)
    for r in range(r0, r1):
        i0 = (r - r0) * nb
        for blk in range(nb):
            p0 = blk * 16
            x = np.uint64(0)
            y = np.uint64(0)
            for j in range(7):
                x += nibble_lanes[packed[r, p0 + j]]
                y += nibble_lanes[packed[r, p0 + 7 + j]]
            z = nibble_lanes[packed[r, p0 + 14]] + nibble_lanes[packed[r, p0 + 15]]
            wa = (x & low) + (y & low) + (z & low)
            wb = ((x >> four) & low) + ((y >> four) & low) + ((z >> four) & low)
            both[i0 + blk] = wa + wb
            pos[i0 + blk] = wa


def _search(both32, pos32, scale, refit, best_out, scale_out, q_sxx, q_syy, q_see, q_se, q_sxy, q_max,
            q_exp, slow, counts):
    """Stage 2, one block per iteration: choose the candidate and compute the block's exact
    metric sums as integers.

    Everything is int32, every table is a literal and every choice a select, so that LLVM
    vectorizes the loop 8 blocks wide (numba widens int32 arithmetic to int64; the ``I(...)``
    around each result lets LLVM narrow it back).  With h_m the count of magnitude m
    (M_m halves: 0, 1, 2, 3, 4, 6, 8, 12), n_t = h_0 + .. + h_(t-1), S_t = sum over m < t of
    h_m M_m and S = S_8, candidate (d, t) puts magnitudes below t on a = 2^k units (k = 9 + d)
    and the rest on b = 4a; its squared error minus sum x^2 is
    g = 2^(2k) (512 - 15 n_t) - 2^(k+9) (4 S - 3 S_t).  Units: a magnitude of 1 is 2^9, so
    sums of squares are in 2^(2 (e - 136)) and plain sums in 2^(e - 136), e the source's E8M0
    byte (the output's for an all-zero block).  ``q_syy`` is sum y^2 / 2^8 (it can reach 2^31).
    Adds this call's source zeros, positive nibbles, code-0 and code-3 counts to ``counts``."""
    I = np.int32
    zeros = I(0)
    npos = I(0)
    code0 = I(0)
    code3 = I(0)
    for i in range(scale.shape[0]):
        wl = I(both32[2 * i + _LOW_HALF])
        wh = I(both32[2 * i + 1 - _LOW_HALF])
        al = I(pos32[2 * i + _LOW_HALF])
        ah = I(pos32[2 * i + 1 - _LOW_HALF])
        s = I(scale[i])
        h0, h1, h2, h3 = I(wl & 255), I((wl >> 8) & 255), I((wl >> 16) & 255), I((wl >> 24) & 255)
        h4, h5, h6, h7 = I(wh & 255), I((wh >> 8) & 255), I((wh >> 16) & 255), I((wh >> 24) & 255)
        a0, a1, a2, a3 = I(al & 255), I((al >> 8) & 255), I((al >> 16) & 255), I((al >> 24) & 255)
        a4, a5, a6, a7 = I(ah & 255), I((ah >> 8) & 255), I((ah >> 16) & 255), I((ah >> 24) & 255)
        n1 = h0
        n2 = I(n1 + h1)
        n3 = I(n2 + h2)
        n5 = I(n3 + h3 + h4)
        n7 = I(n5 + h5 + h6)
        p1 = a0
        p2 = I(p1 + a1)
        p3 = I(p2 + a2)
        p5 = I(p3 + a3 + a4)
        p7 = I(p5 + a5 + a6)
        ptot = I(p7 + a7)
        s2 = h1
        s3 = I(s2 + 2 * h2)
        s5 = I(s3 + 3 * h3 + 4 * h4)
        s7 = I(s5 + 6 * h5 + 8 * h6)
        st = I(s7 + 12 * h7)
        spos = I(a1 + 2 * a2 + 3 * a3 + 4 * a4 + 6 * a5 + 8 * a6 + 12 * a7)
        # Candidate 0 (d = 0, t = 5) is keep-scales; the rest in moet.REFIT_WINDOW order, each
        # taken only if strictly better (earlier candidates win ties) and its exponent in 0..254.
        # An all-zero block keeps candidate 0's codes (+-1 by the zeros' sign bits) and, in
        # refit, takes the exponent 0.
        refit_ok = refit & (s != I(255))
        all_zero = n1 == I(32)
        search = refit_ok & (~all_zero)
        # c: (candidate, d, g, n_t, S_t, positive count below t, a, t) of the best so far
        c = (I(0), I(0), I(I(512 - 15 * n5 - 4 * st + 3 * s5) << 18), n5, s5, p5, I(512), I(5))
        g = I(I(I(512 - 15 * n3) << 16) - I(I(4 * st - 3 * s3) << 17))
        c = (I(1), I(-1), g, n3, s3, p3, I(256), I(3)) if search & (s >= I(1)) & (g < c[2]) else c
        g = I(I(I(512 - 15 * n7) << 20) - I(I(4 * st - 3 * s7) << 19))
        c = (I(2), I(1), g, n7, s7, p7, I(1024), I(7)) if search & (s <= I(253)) & (g < c[2]) else c
        g = I(I(I(512 - 15 * n2) << 14) - I(I(4 * st - 3 * s2) << 16))
        c = (I(3), I(-2), g, n2, s2, p2, I(128), I(2)) if search & (s >= I(2)) & (g < c[2]) else c
        g = I(I(32 << 22) - I(st << 20))
        c = (I(4), I(2), g, I(32), st, ptot, I(2048), I(8)) if search & (s <= I(252)) & (g < c[2]) else c
        g = I(I(I(512 - 15 * n1) << 12) - I(st << 17))
        c = (I(5), I(-3), g, n1, I(0), p1, I(64), I(1)) if search & (s >= I(3)) & (g < c[2]) else c
        g = I(I(I(512 - 15 * n1) << 10) - I(st << 16))
        c = (I(6), I(-4), g, n1, I(0), p1, I(32), I(1)) if search & (s >= I(4)) & (g < c[2]) else c
        g = I(I(I(512 - 15 * n1) << 8) - I(st << 15))
        c = (I(7), I(-5), g, n1, I(0), p1, I(16), I(1)) if search & (s >= I(5)) & (g < c[2]) else c
        best, d, g, nt, sum_t, pt, a, t = c
        new_s = (I(0) if all_zero else I(s + d)) if refit_ok else s
        best_out[i] = best
        scale_out[i] = new_s
        zeros = I(zeros + h0)
        npos = I(npos + ptot)
        code3 = I(code3 + ptot - pt)
        code0 = I(code0 + (32 - nt) - (ptot - pt))
        # sum y^2 = a^2 n_t + b^2 (32 - n_t); sum x y = a S_t + b (S - S_t) (S in halves: 2^8 units);
        # sum e = sum y - sum x, the signs from the positive counts (dt: inner levels' net sign).
        sxx = I(I(h1 + 4 * h2 + 9 * h3 + 16 * h4 + 36 * h5 + 64 * h6 + 144 * h7) << 16)
        dt = I(2 * pt - nt)
        q_sxx[i] = sxx
        q_syy[i] = I(I(512 - 15 * nt) * I(I(a * a) >> 8))
        q_see[i] = I(sxx + g)
        q_se[i] = I(I(I(8 * ptot - 128 - 3 * dt) * a) - I(I(2 * spos - st) << 8))
        q_sxy[i] = I(I(4 * st - 3 * sum_t) * I(a << 8))
        # The largest |y - x| over the magnitudes present in the block.
        b = I(a << 2)
        e = a if h0 > I(0) else I(0)
        e = max(e, I(abs((a if t > I(1) else b) - 256)) if h1 > I(0) else I(0))
        e = max(e, I(abs((a if t > I(2) else b) - 512)) if h2 > I(0) else I(0))
        e = max(e, I(abs((a if t > I(3) else b) - 768)) if h3 > I(0) else I(0))
        e = max(e, I(abs((a if t > I(4) else b) - 1024)) if h4 > I(0) else I(0))
        e = max(e, I(abs((a if t > I(5) else b) - 1536)) if h5 > I(0) else I(0))
        e = max(e, I(abs((a if t > I(6) else b) - 2048)) if h6 > I(0) else I(0))
        e = max(e, I(abs(b - 3072)) if h7 > I(0) else I(0))
        q_max[i] = e
        q_exp[i] = new_s if all_zero else s
        slow[i] = (s > I(_FAST_MAX_SCALE)) | (new_s > I(_FAST_MAX_SCALE))
    counts[0] += zeros
    counts[1] += npos
    counts[2] += code0
    counts[3] += code3


def _block_sums(q_sxx, q_syy, q_see, q_se, q_sxy, q_max, q_exp, f_sxx, f_syy, f_see, f_se, f_sxy, f_max):
    """Stage 3: the integer sums as float64, scaled by the block's unit (exact: powers of two
    in the normal range).  2^(e - 136) is built from five exact factors, not a table, since a
    table load inside the loop stops LLVM from vectorizing it."""
    for i in range(q_exp.shape[0]):
        e = q_exp[i]
        one = np.float64(np.int32(1) << (e & 15)) * 2.0 ** (UNIT_EXP - 127)
        one = one * 2.0 ** 16 if e & 16 else one
        one = one * 2.0 ** 32 if e & 32 else one
        one = one * 2.0 ** 64 if e & 64 else one
        one = one * 2.0 ** 128 if e & 128 else one
        two = one * one
        f_sxx[i] = np.float64(q_sxx[i]) * two
        f_syy[i] = np.float64(q_syy[i]) * (two * 256.0)
        f_see[i] = np.float64(q_see[i]) * two
        f_se[i] = np.float64(q_se[i]) * one
        f_sxy[i] = np.float64(q_sxy[i]) * two
        f_max[i] = np.float64(q_max[i]) * one


def _fused_loop(packed, scale, refit, nibble_lanes, cand_lut, code16, f32_lo, f32_hi, levels, e8m0,
                out64, out_scale, acc, counts, xbuf, ybuf):
    """Encode every block (as moet._refit_kernel, or keep-scales), add its metric sums to
    ``acc`` in the metric's order and its counts to ``counts`` (source zeros, then codes 0..3);
    return the max row bias.

    Rows go in chunks through three stages (``_lane_counts``, scalar; ``_search`` and
    ``_block_sums``, which LLVM vectorizes); then, block by block in order, the codes are
    written from the chosen candidate's nibble table and the sums are added (in block order:
    the metric's floats depend on it)."""
    n_rows = packed.shape[0]
    nb = scale.shape[1]
    k = nb * 32
    rows = max(1, _CHUNK_BLOCKS // max(nb, 1))
    m = rows * nb
    both = np.empty(m, np.uint64)
    pos = np.empty(m, np.uint64)
    best = np.empty(m, np.int32)
    new_scale = np.empty(m, np.int32)
    q = np.empty((7, m), np.int32)
    f = np.empty((6, m), np.float64)
    slow = np.empty(m, np.bool_)
    cnt = np.zeros(4, np.int64)
    top = 0.0
    sxx_acc, syy_acc, see_acc, se_acc, sxy_acc, maxabs, n = acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6]
    for r0 in range(0, n_rows, rows):
        r1 = min(n_rows, r0 + rows)
        mm = (r1 - r0) * nb
        _lane_counts(packed, r0, r1, nibble_lanes, both, pos)
        _search(both[:mm].view(np.uint32), pos[:mm].view(np.uint32), scale[r0:r1].reshape(mm), refit, best,
                new_scale, q[0], q[1], q[2], q[3], q[4], q[5], q[6], slow, cnt)
        _block_sums(q[0, :mm], q[1, :mm], q[2, :mm], q[3, :mm], q[4, :mm], q[5, :mm], q[6, :mm],
                    f[0], f[1], f[2], f[3], f[4], f[5])
        for r in range(r0, r1):
            row = 0.0
            row_bad = False
            i0 = (r - r0) * nb
            for blk in range(nb):
                i = i0 + blk
                c = best[i]
                out_scale[r, blk] = new_scale[i]
                lut = cand_lut[c]
                p0 = blk * 16
                word = np.uint64(0)
                for j in range(8):
                    code = lut[packed[r, p0 + 2 * j]] | (lut[packed[r, p0 + 2 * j + 1]] << 4)
                    word |= np.uint64(code) << np.uint64(8 * j)
                out64[r, blk] = word
                if slow[i]:
                    # Values may overflow float32: the metric's own per-element step on the decoded block.
                    fs = e8m0[scale[r, blk]]
                    gs = e8m0[new_scale[i]]
                    for j in range(16):
                        b = packed[r, p0 + j]
                        xbuf[0, 2 * j] = f32_lo[b] * fs
                        xbuf[0, 2 * j + 1] = f32_hi[b] * fs
                        ybuf[0, 2 * j] = levels[code16[c, b & 15]] * gs
                        ybuf[0, 2 * j + 1] = levels[code16[c, b >> 4]] * gs
                    acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6] = (sxx_acc, syy_acc, see_acc, se_acc,
                                                                              sxy_acc, maxabs, n)
                    be, bad = _block_into(xbuf, ybuf, 0, 0, 32, acc)
                    sxx_acc, syy_acc, see_acc, se_acc, sxy_acc, maxabs, n = (acc[0], acc[1], acc[2], acc[3],
                                                                             acc[4], acc[5], acc[6])
                    row += be
                    row_bad = row_bad or bad
                    continue
                be = f[3, i]
                sxx_acc += f[0, i]
                syy_acc += f[1, i]
                see_acc += f[2, i]
                se_acc += be
                sxy_acc += f[4, i]
                maxabs = max(maxabs, f[5, i])
                n += 32
                row += be
            if k and not row_bad:
                mb = abs(row / k)
                if mb > top:
                    top = mb
    acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6] = sxx_acc, syy_acc, see_acc, se_acc, sxy_acc, maxabs, n
    blocks = n_rows * nb
    zeros, npos, code0, code3 = cnt[0], cnt[1], cnt[2], cnt[3]
    counts[0] = zeros
    counts[1] = code0
    counts[2] = 32 * blocks - npos - code0
    counts[3] = npos - code3
    counts[4] = code3
    return top


@functools.cache
def _kernel():
    from .._numba import njit, njit_with

    return njit_with(_fused_loop, _block_into=metrics._kernels()[0], _lane_counts=njit(_lane_counts),
                     _search=njit(_search), _block_sums=njit(_block_sums))


assert tuple(range(8)) == (metrics._SXX, metrics._SYY, metrics._SEE, metrics._SE, metrics._SXY,
                           metrics._MAXABS, metrics._N, metrics._BAD)   # the kernel's acc[] indices


def requant_moet(packed, scale, method: str = "refit", *, name: str | None = None,
                 nonfinite: str = "raise") -> MoetPass:
    """MXFP4 pair layout -> moet-w2 parts and their report numbers (numba, one pass).

    Positions whose decoded value is NaN or inf (E8M0 0xFF, or overflow at bytes
    >= 253) are handled as ``metrics.error_stats`` does under ``nonfinite``;
    ``requant_weight`` refuses NaN scales before this."""
    method = get_format(ids.MOET_W2).check_method(method, name=name)   # the registry lists the methods
    shape = np.shape(packed)
    p, s = check_mxfp4(packed, scale, name=name)
    t = _REFIT_TABLES
    out = np.empty((p.shape[0], p.shape[1] // 2), np.uint8)
    out_scale = np.empty_like(s)
    acc = np.zeros(8, np.float64)
    counts = np.zeros(5, np.int64)
    xbuf = np.empty((1, 32), np.float32)
    ybuf = np.empty((1, 32), np.float32)
    out64 = out.view(np.uint64)   # one word per block (K/4 bytes a row, a multiple of 8): one store, not 8
    top = _kernel()(p, s, method == "refit", _LANES, t.lut, _CODE16, NIBBLE_LO_F32, NIBBLE_HI_F32, LEVELS,
                    E8M0_F32, out64, out_scale, acc, counts, xbuf, ybuf)
    if sys.byteorder == "big":
        out64.byteswap(inplace=True)   # the kernel puts column byte j in the word's bits 8j..8j+7
    return MoetPass(out.reshape(shape[:-1] + (out.shape[1],)), out_scale.reshape(np.shape(scale)),
                    metrics._finish(acc, nonfinite), float(top), int(counts[0]), tuple(int(c) for c in counts[1:]),
                    int(np.count_nonzero(out_scale != s)))


def requant_moet_reference(packed, scale, method: str = "refit", *, name: str | None = None,
                           nonfinite: str = "raise") -> MoetPass:
    """Numpy twin of ``requant_moet``: encode, decode both sides, then the metric's reference."""
    from . import tensor_stats
    from .moet import encode_keep_scales_reference, encode_refit_reference

    enc = {"refit": encode_refit_reference, "keep-scales": encode_keep_scales_reference}[method]
    codes, new_scale = enc(packed, scale, name=name)
    src = get_format(ids.MXFP4_PACK).reference_decode({"packed": np.asarray(packed),
                                                       "scale": np.asarray(scale)}, name=name)
    out = get_format(ids.MOET_W2).reference_decode({"packed": codes, "scale": new_scale})
    stats, top = metrics.error_stats_rows_reference(src, out.reshape(src.shape), nonfinite=nonfinite)
    return MoetPass(codes, new_scale, stats, top, tensor_stats.zero_codes(packed, reference=True),
                    tensor_stats.code_histogram(codes, reference=True),
                    int(np.count_nonzero(np.asarray(new_scale) != np.asarray(scale))))


_CODE16 = np.stack([level_codes(_REFIT_TABLES.a, _REFIT_TABLES.b, int(d)) for d in _CAND_D]).astype(np.int64)
_check_candidates()
_LANES = _nibble_lanes()
