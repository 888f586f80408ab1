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
another, so every per-block sum is a small integer dot product with the
block's nibble histogram (16 counts), exact in int64.  The metric adds exact
block sums in block order (``metrics`` module doc), so the sums are the same
float64 bits as summing decoded floats element by element.  Blocks whose
values overflow float32 (E8M0 bytes >= 253, not seen in real weights) go
through the metric's own per-element block step instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..formats.e2m1 import E8M0_F32, NIBBLE_HI_F32, NIBBLE_LO_F32
from ..formats.moet_w2 import LEVELS
from . import metrics
from .moet import (_MAG_UNITS, _REFIT_TABLES, KEEP_LUT, NIBBLE_TO_CODE, UNIT_EXP, _level_units, best_candidate,
                   check_mxfp4, level_codes)

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


def _tables() -> np.ndarray:
    """int64 [candidates, 6, 16]: per refit candidate (window order) and nibble, in units of
    2^(s + UNIT_EXP) (s the source exponent): x^2, y^2, e^2, e, x*y and |e|, where x is the
    nibble's source value, y its level and e = y - x.  The kernel reads nibbles 0..7 and
    negates e for 8..15 (checked here)."""
    t = _REFIT_TABLES
    x = np.where(np.arange(16) & 8, -1, 1) * _MAG_UNITS[np.arange(16) & 7]
    out = []
    for d in t.d:
        codes = level_codes(t.a, t.b, int(d))
        units = [_level_units(v, int(d)) for v in (-t.b, -t.a, t.a, t.b)]
        y = np.array(units, np.int64)[codes]
        e = y - x
        t16 = np.stack([x * x, y * y, e * e, e, x * y, np.abs(e)])
        assert np.array_equal(t16[:, 8:] * np.array([1, 1, 1, -1, 1, 1])[:, None], t16[:, :8])
        assert np.array_equal(t16[2, :8], t.err[len(out)])     # e^2 is the search's error table
        out.append(t16)
    assert np.array_equal(level_codes(t.a, t.b, int(t.d[0])), NIBBLE_TO_CODE)   # candidate 0: keep-scales
    assert np.array_equal(t.lut[0], KEEP_LUT)
    return np.ascontiguousarray(np.stack(out).astype(np.int64))


def _nibble_lanes() -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 byte -> its two nibbles counted in byte lanes: lane m of the first word counts
    nibble m (sign clear), of the second nibble 8 + m (sign set).  32 nibbles a block keep
    every lane below 256 and the top one (<= 32 << 56) inside int64."""
    b = np.arange(256)
    words = []
    for sign in (0, 8):
        w = np.zeros(256, np.int64)
        for nib in (b & 15, b >> 4):
            hit = (nib & 8) == sign
            w += np.where(hit, np.left_shift(1, 8 * (nib & 7)), 0)
        words.append(w)
    return words[0], words[1]


def _code_tables() -> np.ndarray:
    """int64 [candidates, 16]: the 2-bit code of each nibble."""
    t = _REFIT_TABLES
    return np.stack([level_codes(t.a, t.b, int(d)) for d in t.d]).astype(np.int64)


def _fused_loop(packed, scale, refit, cand_d, cand_err, cand_lut, stats16, code16, pow2, lanes_pos, lanes_neg,
                f32_lo, f32_hi, levels, e8m0, out, out_scale, acc, used, xbuf, ybuf):
    """Encode every block (as moet._refit_kernel, or keep-scales), add its metric sums to
    ``acc`` in the metric's order and its nibble counts to ``used[candidate]``; return the
    max row bias."""
    h = np.zeros(16, np.int64)
    h8 = np.zeros(8, np.int64)
    top = 0.0
    k = scale.shape[1] * 32
    for r in range(packed.shape[0]):
        row = 0.0
        row_bad = False
        for blk in range(scale.shape[1]):
            s = np.int64(scale[r, blk])
            p0 = blk * 16
            # Nibble counts in byte lanes of two registers (nibbles 0-7, 8-15): no memory
            # round trip per element, and a lane never passes 32.
            wa = np.int64(0)
            wb = np.int64(0)
            for j in range(16):
                b = packed[r, p0 + j]
                wa += lanes_pos[b]
                wb += lanes_neg[b]
            for m in range(8):
                h[m] = (wa >> (8 * m)) & 255
                h[m + 8] = (wb >> (8 * m)) & 255
            for m in range(8):
                h8[m] = h[m] + h[m + 8]
            zeros = h8[0]
            # Candidate 0 (d = 0) is keep-scales; an all-zero block keeps its codes (+-1 by the
            # zeros' sign bits) and, in refit, takes the smallest exponent.
            best = 0
            new_s = s
            best_err = np.int64(0)
            for m in range(8):
                best_err += h8[m] * cand_err[0, m]
            if refit and s != 255 and zeros == 32:
                new_s = 0
            elif refit and s != 255:
                best, best_err = best_candidate(h8, s, cand_d, cand_err)
                new_s = s + cand_d[best]
            out_scale[r, blk] = new_s
            lut = cand_lut[best]
            for j in range(8):
                out[r, blk * 8 + j] = lut[packed[r, p0 + 2 * j]] | (lut[packed[r, p0 + 2 * j + 1]] << 4)
            for m in range(16):
                used[best, m] += h[m]
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
                be, bad = _block_into(xbuf, ybuf, 0, 0, 32, acc)
                row += be
                row_bad = row_bad or bad
                continue
            # Exact block sums in units of 2^(u + UNIT_EXP - 127): u is the source exponent, or the
            # output's for an all-zero block (every x is 0 there and the levels are +-1 at d = 0).
            # e^2 summed is the search's own error; sign-symmetric levels make every term but
            # e depend on the magnitude alone.
            see = best_err
            sxx = np.int64(0)
            syy = np.int64(0)
            se = np.int64(0)
            sxy = np.int64(0)
            emax = np.int64(0)
            for m in range(8):
                n = h8[m]
                sxx += n * stats16[best, 0, m]
                syy += n * stats16[best, 1, m]
                se += (h[m] - h[m + 8]) * stats16[best, 3, m]
                sxy += n * stats16[best, 4, m]
                emax = max(emax, stats16[best, 5, m] * min(n, 1))
            u = (new_s if zeros == 32 else s) - 127 + UNIT_EXP - _POW2_LO
            one = pow2[u]
            two = pow2[2 * u + _POW2_LO]
            be = np.float64(se) * one
            acc[0] += np.float64(sxx) * two
            acc[1] += np.float64(syy) * two
            acc[2] += np.float64(see) * two
            acc[3] += be
            acc[4] += np.float64(sxy) * two
            a = np.float64(emax) * one
            if a > acc[5]:
                acc[5] = a
            acc[6] += 32
            row += be
        if k and not row_bad:
            mb = abs(row / k)
            if mb > top:
                top = mb
    return top


@functools.cache
def _kernel():
    from .._numba import njit_with

    return njit_with(_fused_loop, _block_into=metrics._kernels()[0])


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
    used = np.zeros((len(t.d), 16), np.int64)
    xbuf = np.empty((1, 32), np.float32)
    ybuf = np.empty((1, 32), np.float32)
    top = _kernel()(p, s, method == "refit", t.d, t.err, t.lut, _STATS16, _CODE16, _POW2, *_LANES,
                    NIBBLE_LO_F32, NIBBLE_HI_F32, LEVELS, E8M0_F32, out, out_scale, acc, used, xbuf, ybuf)
    nibbles = used.sum(axis=0)
    codes = [int(used[_CODE16 == c].sum()) for c in range(4)]
    return MoetPass(out.reshape(shape[:-1] + (out.shape[1],)), out_scale.reshape(np.shape(scale)),
                    metrics._finish(acc, nonfinite), float(top), int(nibbles[0] + nibbles[8]), tuple(codes),
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


_STATS16 = _tables()
_CODE16 = _code_tables()
_POW2 = np.ldexp(1.0, np.arange(_POW2_LO, -_POW2_LO + 1))
_LANES = _nibble_lanes()
