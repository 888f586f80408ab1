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
nibble histogram, exact in int64; the levels are powers of two, so each
candidate's error takes shifts, not multiplies (``_fused_loop``).  The metric
adds exact block sums in block order (``metrics`` module doc), so the sums
are the same float64 bits as summing decoded floats element by element.  Blocks whose
values overflow float32 (E8M0 bytes >= 253, not seen in real weights) go
through the metric's own per-element block step instead.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import numpy as np

from ..formats.e2m1 import E8M0_F32, NIBBLE_HI_F32, NIBBLE_LO_F32
from ..formats.moet_w2 import LEVELS
from . import metrics
from .moet import _MAG_UNITS, _REFIT_TABLES, KEEP_LUT, NIBBLE_TO_CODE, UNIT_EXP, check_mxfp4, level_codes

METHODS = ("refit", "keep-scales")
_FAST_MAX_SCALE = 252   # above this a value can overflow float32 (6 * 2^(253 - 127) > float32 max)
_POW2_LO = -300         # _POW2[i] = 2^(i + _POW2_LO), wide enough for squares of every unit


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


# The candidates' exponent offsets (moet.REFIT_WINDOW order) and, per candidate, the first
# magnitude index that rounds to the outer level b.  Literals here, checked against moet at
# import: numba compiles module globals into the kernel as constants (which lets it unroll the
# search into shifts) and its cache only notices edits to this file.
_CAND_D = np.array([0, -1, 1, -2, 2, -3, -4, -5], np.int64)
_CAND_SPLIT = np.array([5, 3, 7, 2, 8, 1, 1, 1], np.int64)
_UNIT_SHIFT = 9   # -UNIT_EXP: a magnitude of 1 is 2^9 units


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


def _max_errors() -> np.ndarray:
    """int64 [candidates, 256]: the largest |level - magnitude| (units) over the E2M1 magnitudes
    whose bits are set in the column index, per candidate (0 for none)."""
    err = np.abs(_candidate_levels() - _MAG_UNITS)
    present = (np.arange(256)[:, None] >> np.arange(8)) & 1
    return np.ascontiguousarray((err[:, None, :] * present[None]).max(axis=2))


def _nibble_lanes() -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 byte -> its two nibbles counted in byte lanes: lane m of the first word counts
    nibble m (sign clear), of the second nibble 8 + m (sign set).  A block's 32 nibbles keep
    every lane below 256."""
    b = np.arange(256)
    words = []
    for sign in (0, 8):
        w = np.zeros(256, np.uint64)
        for nib in (b & 15, b >> 4):
            w += np.where((nib & 8) == sign, np.left_shift(np.uint64(1), (8 * (nib & 7)).astype(np.uint64)),
                          np.uint64(0))
        words.append(w)
    return words[0], words[1]


_BYTES = np.uint64(0x0101010101010101)   # times a byte-lane word: lane m becomes the sum of lanes 0..m
_LANE_TOP = np.uint64(0x8080808080808080)        # bit 7 of every lane
_LANE_NONZERO = np.uint64(0x7F7F7F7F7F7F7F7F)   # added to lanes below 129: bit 7 set iff the lane is nonzero
_GATHER_BITS = np.uint64(0x0102040810204080)  # times bits 0, 8, .., 56: bit 8m lands at bit 56 + m


def _lane(w, m):
    return np.int64((w >> np.uint64(8 * m)) & np.uint64(255))


def _level_sums(c, below, sprefix, stot):
    """(sum y^2, sum x y) of a block under candidate ``c``, in units^2 (``_fused_loop``'s doc):
    a^2 n_t + b^2 (32 - n_t) and a S_t + b (S - S_t), with a = 2^k, b = 4a and S in halves."""
    kk = _UNIT_SHIFT + _CAND_D[c]
    nt = _lane(below, _CAND_SPLIT[c] - 1)
    st = sprefix[_CAND_SPLIT[c]]
    return (nt << (2 * kk)) + ((32 - nt) << (2 * kk + 4)), (st << (kk + 8)) + ((stot - st) << (kk + 10))


def _candidate_error(c, below, sprefix, stot):
    """Candidate ``c``'s squared error minus sxx: sum y^2 - 2 sum x y."""
    syy, sxy = _level_sums(c, below, sprefix, stot)
    return syy - 2 * sxy


def _fused_loop(packed, scale, refit, lanes_pos, lanes_neg, cand_lut, max_err, code16, pow2, f32_lo, f32_hi,
                levels, e8m0, out64, out_scale, acc, counts, xbuf, ybuf):
    """Encode every block (as moet._refit_kernel, or keep-scales), add its metric sums to
    ``acc`` in the metric's order and its counts to ``counts`` (source zeros, then codes 0..3);
    return the max row bias.

    Per block, h_m counts magnitude m (M_m units), n_t = h_0 + .. + h_(t-1) and
    S_t = sum over m < t of h_m M_m.  Candidate c puts magnitudes below its split t on
    a = 2^k units and the rest on b = 4a, so its squared error is
    sxx + a^2 n_t + b^2 (32 - n_t) - 2a S_t - 2b (S - S_t): shifts only, and every n_t comes
    from one multiply of the byte-lane counts."""
    sprefix = np.zeros(9, np.int64)
    top = 0.0
    k = scale.shape[1] * 32
    sxx_acc, syy_acc, see_acc, se_acc, sxy_acc, maxabs, n = acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6]
    zeros = np.int64(0)
    pos = np.int64(0)
    code0 = np.int64(0)
    code3 = np.int64(0)
    for r in range(packed.shape[0]):
        row = 0.0
        row_bad = False
        for blk in range(scale.shape[1]):
            s = np.int64(scale[r, blk])
            p0 = blk * 16
            wa = np.uint64(0)
            wb = np.uint64(0)
            for j in range(16):
                b = packed[r, p0 + j]
                wa += lanes_pos[b]
                wb += lanes_neg[b]
            w = wa + wb
            below = w * _BYTES       # lane m: n_(m+1)
            pos_below = wa * _BYTES  # the same for the positive nibbles
            h = (_lane(w, 0), _lane(w, 1), _lane(w, 2), _lane(w, 3), _lane(w, 4), _lane(w, 5), _lane(w, 6),
                 _lane(w, 7))
            # S_t in half-magnitude units (magnitudes 0, 1, 2, 3, 4, 6, 8, 12 halves)
            sprefix[2] = h[1]
            sprefix[3] = sprefix[2] + 2 * h[2]
            sprefix[4] = sprefix[3] + 3 * h[3]
            sprefix[5] = sprefix[4] + 4 * h[4]
            sprefix[6] = sprefix[5] + 6 * h[5]
            sprefix[7] = sprefix[6] + 8 * h[6]
            stot = sprefix[7] + 12 * h[7]
            sprefix[8] = stot
            # Candidate 0 (d = 0) is keep-scales; an all-zero block keeps its codes (+-1 by the
            # zeros' sign bits) and, in refit, takes the smallest exponent.  Errors below leave
            # out sxx, common to all candidates.
            best = 0
            new_s = s
            if refit and s != 255 and h[0] == 32:
                new_s = 0
                best_g = np.int64(32) << (2 * _UNIT_SHIFT)   # 32 zeros on a = 1
            else:
                best_g = _candidate_error(0, below, sprefix, stot)
                if refit and s != 255:
                    for c in range(1, _CAND_D.shape[0]):
                        e = s + _CAND_D[c]
                        if e < 0 or e > 254:
                            continue
                        g = _candidate_error(c, below, sprefix, stot)
                        if g < best_g:   # strict: earlier candidates win ties
                            best = c
                            best_g = g
                    new_s = s + _CAND_D[best]
            out_scale[r, blk] = new_s
            lut = cand_lut[best]
            word = np.uint64(0)
            for j in range(8):
                q = lut[packed[r, p0 + 2 * j]] | (lut[packed[r, p0 + 2 * j + 1]] << 4)
                word |= np.uint64(q) << np.uint64(8 * j)
            out64[r, blk] = word
            split = _CAND_SPLIT[best]
            nt = _lane(below, split - 1)
            pt = _lane(pos_below, split - 1)
            ptot = _lane(pos_below, 7)
            zeros += h[0]
            pos += ptot
            code3 += ptot - pt
            code0 += (32 - nt) - (ptot - pt)
            if s > _FAST_MAX_SCALE or new_s > _FAST_MAX_SCALE:
                # Values may overflow float32: the metric's own per-element step on the decoded block.
                f = e8m0[s]
                g = e8m0[new_s]
                for j in range(16):
                    b = packed[r, p0 + j]
                    xbuf[0, 2 * j] = f32_lo[b] * f
                    xbuf[0, 2 * j + 1] = f32_hi[b] * f
                    ybuf[0, 2 * j] = levels[code16[best, b & 15]] * g
                    ybuf[0, 2 * j + 1] = levels[code16[best, b >> 4]] * g
                acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6] = (sxx_acc, syy_acc, see_acc, se_acc, sxy_acc,
                                                                          maxabs, n)
                be, bad = _block_into(xbuf, ybuf, 0, 0, 32, acc)
                sxx_acc, syy_acc, see_acc, se_acc, sxy_acc, maxabs, n = (acc[0], acc[1], acc[2], acc[3], acc[4],
                                                                         acc[5], acc[6])
                row += be
                row_bad = row_bad or bad
                continue
            # Exact block sums in units of 2^(u + UNIT_EXP - 127): u is the source exponent, or the
            # output's for an all-zero block (every x is 0 there and the levels are +-1 at d = 0).
            # With y the level and e = y - x: sum y^2 = a^2 n_t + b^2 (32 - n_t), sum x y =
            # a S_t + b (S - S_t), sum e^2 = sxx + the search's error, and sum e (signed) takes the
            # per-magnitude count differences d_m (positive minus negative nibbles).
            sxx = (h[1] + 4 * h[2] + 9 * h[3] + 16 * h[4] + 36 * h[5] + 64 * h[6] + 144 * h[7]) << 16
            syy, sxy = _level_sums(best, below, sprefix, stot)
            kk = _UNIT_SHIFT + _CAND_D[best]
            diff = (wa | _LANE_TOP) - wb   # lane m: 128 + d_m
            sdx = (_lane(diff, 1) + 2 * _lane(diff, 2) + 3 * _lane(diff, 3) + 4 * _lane(diff, 4)
                   + 6 * _lane(diff, 5) + 8 * _lane(diff, 6) + 12 * _lane(diff, 7) - 128 * 36)
            dt = 2 * pt - nt
            se = (dt << kk) + ((2 * ptot - 32 - dt) << (kk + 2)) - (sdx << 8)
            # The largest |error| among the magnitudes present: one load from a table indexed by the
            # candidate and the presence mask (lane m nonzero -> bit m), not eight mispredicted branches.
            present = ((((w + _LANE_NONZERO) & _LANE_TOP) >> np.uint64(7)) * _GATHER_BITS) >> np.uint64(56)
            emax = max_err[best, present]
            u = (new_s if h[0] == 32 else s) - 127 + UNIT_EXP - _POW2_LO
            one = pow2[u]
            two = pow2[2 * u + _POW2_LO]
            be = np.float64(se) * one
            sxx_acc += np.float64(sxx) * two
            syy_acc += np.float64(syy) * two
            see_acc += np.float64(sxx + best_g) * two
            se_acc += be
            sxy_acc += np.float64(sxy) * two
            maxabs = max(maxabs, np.float64(emax) * one)
            n += 32
            row += be
        if k and not row_bad:
            mb = abs(row / k)
            if mb > top:
                top = mb
    acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6] = sxx_acc, syy_acc, see_acc, se_acc, sxy_acc, maxabs, n
    blocks = packed.shape[0] * scale.shape[1]
    counts[0] = zeros
    counts[1] = code0
    counts[2] = 32 * blocks - pos - code0
    counts[3] = pos - code3
    counts[4] = code3
    return top


@functools.cache
def _kernel():
    from .._numba import njit, njit_with

    lane = njit(inline="always")(_lane)
    sums = njit_with(_level_sums, _lane=lane, inline="always")
    cand = njit_with(_candidate_error, _level_sums=sums, inline="always")
    return njit_with(_fused_loop, _block_into=metrics._kernels()[0], _lane=lane, _level_sums=sums,
                     _candidate_error=cand)


assert tuple(range(8)) == (metrics._SXX, metrics._SYY, metrics._SEE, metrics._SE, metrics._SXY,
                           metrics._MAXABS, metrics._N, metrics._BAD)   # the kernel's acc[] indices


def requant_moet(packed, scale, method: str = "refit", *, name: str | None = None,
                 nonfinite: str = "raise") -> MoetPass:
    """MXFP4 pair layout -> moet-w2 parts and their report numbers (numba, one pass).

    Positions whose decoded value is NaN or inf (E8M0 0xFF, or overflow at bytes
    >= 253) are handled as ``metrics.error_stats`` does under ``nonfinite``;
    ``requant_weight`` refuses NaN scales before this."""
    if method not in METHODS:
        from ..errors import UsageError

        raise UsageError(f"moet-w2 method must be one of {list(METHODS)}, found {method!r}", tensor=name)
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
    top = _kernel()(p, s, method == "refit", *_LANES, t.lut, _MAX_ERR, _CODE16, _POW2, NIBBLE_LO_F32,
                    NIBBLE_HI_F32, LEVELS, E8M0_F32, out64, out_scale, acc, counts, xbuf, ybuf)
    if sys.byteorder == "big":
        out64.byteswap(inplace=True)   # the kernel puts column byte j in the word's bits 8j..8j+7
    return MoetPass(out.reshape(shape[:-1] + (out.shape[1],)), out_scale.reshape(np.shape(scale)),
                    metrics._finish(acc, nonfinite), float(top), int(counts[0]), tuple(int(c) for c in counts[1:]),
                    int(np.count_nonzero(out_scale != s)))


def requant_moet_reference(packed, scale, method: str = "refit", *, name: str | None = None,
                           nonfinite: str = "raise") -> MoetPass:
    """Numpy twin of ``requant_moet``: encode, decode both sides, then the metric's reference."""
    from ..formats import get_format
    from . import tensor_stats
    from .moet import encode_keep_scales_reference, encode_refit_reference

    enc = {"refit": encode_refit_reference, "keep-scales": encode_keep_scales_reference}[method]
    codes, new_scale = enc(packed, scale, name=name)
    src = get_format("mxfp4-pack-quantized").reference_decode({"packed": np.asarray(packed),
                                                               "scale": np.asarray(scale)}, name=name)
    out = get_format("moet-w2").reference_decode({"packed": codes, "scale": new_scale})
    stats, top = metrics.error_stats_rows_reference(src, out.reshape(src.shape), nonfinite=nonfinite)
    return MoetPass(codes, new_scale, stats, top, tensor_stats.zero_codes(packed, reference=True),
                    tensor_stats.code_histogram(codes, reference=True),
                    int(np.count_nonzero(np.asarray(new_scale) != np.asarray(scale))))


_CODE16 = np.stack([level_codes(_REFIT_TABLES.a, _REFIT_TABLES.b, int(d)) for d in _CAND_D]).astype(np.int64)
_check_candidates()
_MAX_ERR = _max_errors()
_POW2 = np.ldexp(1.0, np.arange(_POW2_LO, -_POW2_LO + 1))
_LANES = _nibble_lanes()
