"""MXFP4 -> Moet-compatible 2.25 bpw: codes {-4, -1, +1, +4} (E2M1 units) x E8M0 per 32.

The stored format (decoder, spec) is ``k3ckpt.formats.moet_w2``: ``codes``
U8 [..., K/4], lowest column in the lowest two bits; ``scale`` U8 [..., K/32]
E8M0; value = LEVELS[code] * 2^(scale - 127), codes 0..3 = -4, -1, +1, +4.

Two encoders read MXFP4 directly (``packed`` U8 [..., K/2], low nibble = even
column; ``scale`` U8 [..., K/32]) and never go through floats:

- ``encode_keep_scales``: the runtime's own map ``NIBBLE_TO_CODE`` applied to
  each nibble, scales copied verbatim.  One table lookup per MXFP4 byte.
- ``encode_refit``: per block the E8M0 exponent and codes with the least
  squared error against the decoded MXFP4 values (exact; see ``fit_window``).

The level-set fitting helpers at the bottom (exponent windows, integer error
tables, code tables) are shared with ``mx2``: refit is MX2's search for the
single set {1, 4}.

Each numba kernel has a numpy twin with the same signature (``*_reference``);
tests hold them bit-identical.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from .._numba import njit
from ..formats.e2m1 import block_rows

NIBBLE_TO_CODE = np.array([2, 2, 2, 2, 2, 3, 3, 3, 1, 1, 1, 1, 1, 0, 0, 0], dtype=np.uint8)
"""The runtime's ``_NIBBLE_TO_CODE``: |v| <= 2 -> +-1, |v| >= 3 -> +-4, sign bit kept (also for -0)."""

MOET_SET = (1.0, 4.0)
"""Magnitudes (a, b) of the Moet level set {-b, -a, a, b}."""

NIBBLE_TO_CODE.flags.writeable = False


def _byte_lut(nibble_to_code: np.ndarray) -> np.ndarray:
    """MXFP4 byte (two nibbles) -> 4 bits: code(low nibble) | code(high nibble) << 2."""
    b = np.arange(256)
    return (nibble_to_code[b & 15] | (nibble_to_code[b >> 4] << 2)).astype(np.uint8)


KEEP_LUT = _byte_lut(NIBBLE_TO_CODE)
KEEP_LUT.flags.writeable = False


# ---------------------------------------------------------------- shape checks

def check_mxfp4(packed, scale, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Validate MXFP4 pair-layout arrays (packed U8 [..., K/2], scale U8 [..., K/32]);
    return them as C-contiguous [M, K/2], [M, K/32] rows."""
    return block_rows(packed, scale, per_byte=2, what="MXFP4 packed codes", name=name)


# ------------------------------------------------------------ keep-scales encoder

@njit
def _keep_kernel(packed, lut, out):
    for r in range(packed.shape[0]):
        for j in range(out.shape[1]):
            out[r, j] = lut[packed[r, 2 * j]] | (lut[packed[r, 2 * j + 1]] << 4)


def encode_keep_scales(packed, scale, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 -> (codes U8 [..., K/4], scale U8 [..., K/32]) with the runtime's nibble map.

    Scales are copied byte for byte (0xFF stays NaN).
    """
    shape = np.shape(packed)
    p, s = check_mxfp4(packed, scale, name=name)
    out = np.empty((p.shape[0], p.shape[1] // 2), np.uint8)
    _keep_kernel(p, KEEP_LUT, out)
    return out.reshape(shape[:-1] + (out.shape[1],)), s.copy().reshape(np.shape(scale))


def encode_keep_scales_reference(packed, scale, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Numpy twin of ``encode_keep_scales``."""
    shape = np.shape(packed)
    p, s = check_mxfp4(packed, scale, name=name)
    out = KEEP_LUT[p[:, 0::2]] | (KEEP_LUT[p[:, 1::2]] << 4)
    return out.reshape(shape[:-1] + (out.shape[1],)), s.copy().reshape(np.shape(scale))


# ------------------------------------------------------------------ refit encoder

@njit(inline="always")
def best_candidate(h8, s, cand_d, cand_err):
    """(index, squared error) of the refit candidate with the least error for a block with
    E2M1 magnitude counts ``h8`` and E8M0 byte ``s``; exponents outside 0..254 are skipped.
    Strict "<": candidates come in preference order, so ties keep the earlier one."""
    best = -1
    best_err = np.int64(0)
    for c in range(cand_d.shape[0]):
        e = s + cand_d[c]
        if e < 0 or e > 254:
            continue
        err = np.int64(0)
        for m in range(8):
            err += h8[m] * cand_err[c, m]
        if best < 0 or err < best_err:
            best = c
            best_err = err
    return best, best_err


@njit
def _refit_kernel(packed, scale, cand_d, cand_err, cand_lut, keep_lut, out, out_scale):
    h = np.zeros(8, np.int64)
    for r in range(packed.shape[0]):
        for blk in range(scale.shape[1]):
            s = np.int64(scale[r, blk])
            p0 = blk * 16
            q0 = blk * 8
            for m in range(8):
                h[m] = 0
            for j in range(16):
                b = packed[r, p0 + j]
                h[b & 7] += 1
                h[(b >> 4) & 7] += 1
            if s == 255 or h[0] == 32:
                # NaN block: stays NaN.  All-zero block: the least error is at
                # the smallest exponent (byte 0); codes +-1 by the zeros' sign bits.
                out_scale[r, blk] = 255 if s == 255 else 0
                for j in range(8):
                    out[r, q0 + j] = keep_lut[packed[r, p0 + 2 * j]] | (keep_lut[packed[r, p0 + 2 * j + 1]] << 4)
                continue
            best = best_candidate(h, s, cand_d, cand_err)[0]
            out_scale[r, blk] = s + cand_d[best]
            for j in range(8):
                lo = cand_lut[best, packed[r, p0 + 2 * j]]
                out[r, q0 + j] = lo | (cand_lut[best, packed[r, p0 + 2 * j + 1]] << 4)


def encode_refit(packed, scale, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 -> Moet codes and refitted E8M0 scales with the least squared error per block.

    Per 32-block: the exponent byte in 0..254 and the codes that minimise
    sum (x - x')^2 against the decoded MXFP4 block, ties broken by
    ``fit_window`` order (nearest the source exponent first) and element ties
    by sign-symmetric rounding (see ``level_codes``).  NaN blocks (0xFF) stay
    NaN with keep-scales codes; all-zero blocks get byte 0.
    """
    shape = np.shape(packed)
    p, s = check_mxfp4(packed, scale, name=name)
    t = _REFIT_TABLES
    out = np.empty((p.shape[0], p.shape[1] // 2), np.uint8)
    out_scale = np.empty_like(s)
    _refit_kernel(p, s, t.d, t.err, t.lut, KEEP_LUT, out, out_scale)
    return out.reshape(shape[:-1] + (out.shape[1],)), out_scale.reshape(np.shape(scale))


def encode_refit_reference(packed, scale, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Numpy twin of ``encode_refit``."""
    shape = np.shape(packed)
    p, s = check_mxfp4(packed, scale, name=name)
    t = _REFIT_TABLES
    blocks = p.reshape(-1, 16)
    sb = s.reshape(-1).astype(np.int64)
    h = magnitude_histogram(blocks)
    err = h @ t.err.T                                   # [blocks, candidates]
    e = sb[:, None] + t.d[None, :]
    err = np.where((e >= 0) & (e <= 254), err, np.iinfo(np.int64).max)
    best = np.argmin(err, axis=1)                       # first minimum = preferred candidate
    new_scale = (sb + t.d[best])
    four = t.lut[best[:, None], blocks]                 # [blocks, 16] 4-bit pairs
    keep = (sb == 255) | (h[:, 0] == 32)
    four[keep] = KEEP_LUT[blocks[keep]]
    new_scale[sb == 255] = 255
    new_scale[(sb != 255) & (h[:, 0] == 32)] = 0
    out = (four[:, 0::2] | (four[:, 1::2] << 4)).astype(np.uint8)
    return (out.reshape(shape[:-1] + (p.shape[1] // 2,)),
            new_scale.astype(np.uint8).reshape(np.shape(scale)))


# --------------------------------------------- level-set fitting (shared with mx2)
#
# A source block is x_i = v_i * 2^s with v_i on the E2M1 grid (s = scale - 127).
# For a sign-symmetric set {-b, -a, a, b} at exponent s + d, each element's error
# depends only on |v_i| (8 magnitudes) and d, so a block's squared error is a
# dot product of its magnitude histogram with a table row.  In units of
# 2^(s + UNIT_EXP) every |v| and every level a * 2^d with d >= UNIT_EXP + 1 is an
# integer, so errors are exact int64 and ties are real ties.

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
UNIT_EXP = -9
_MAG_UNITS = np.array([Fraction(m) * 2 ** -UNIT_EXP for m in E2M1_MAGNITUDES], dtype=np.int64)


def fit_window(a: float, b: float) -> tuple[int, ...]:
    """Exponent offsets d that can be optimal for levels {+-a, +-b} * 2^(s + d), in preference order.

    For a block with at least one nonzero element, every d outside
    [d_lo, d_hi] is no better than a d inside, so searching the window is exact:

    - Above: once (a+b)/2 * 2^d >= 6 every |v| <= 6 rounds to a * 2^d, and
      |v| <= 1.5 * a * 2^d makes d+1 no better than d.  d_hi is the smallest d
      meeting both, and d_hi >= 0, so the tie rule (smaller |d| first) keeps d_hi.
    - Below: once b * 2^d <= 0.5 every nonzero |v| rounds to b * 2^d, and with
      t = 2^d the error sum(|v| - b t)^2 + n0 (a t)^2 is a convex quadratic with
      its minimum at t* = b S1 / (b^2 n + a^2 n0) >= 0.5 b / (b^2 + 31 a^2)
      (n nonzero, S1 = sum |v| >= 0.5 n, n0 = 32 - n; worst case n = 1).  Every
      d with 2^d below the largest power of two <= that bound is strictly worse.

    Returned order: |d| ascending, then d ascending; ties between exponents go
    to the earlier one (the source exponent when it is among the best).
    """
    fa, fb = Fraction(a), Fraction(b)
    assert 0 < fa < fb <= 6
    t_min = Fraction(1, 2) * fb / (fb * fb + 31 * fa * fa)
    d_lo = 0
    while Fraction(2) ** d_lo > t_min:
        d_lo -= 1
    assert fb * Fraction(2) ** d_lo <= Fraction(1, 2)  # in the all-to-b region
    d_hi = 0
    while not (Fraction(3, 2) * fa * 2 ** d_hi >= 6 and (fa + fb) / 2 * 2 ** d_hi >= 6):
        d_hi += 1
    assert 2 * fa * Fraction(2) ** d_lo * 2 ** -UNIT_EXP >= 1  # levels stay integers in table units
    return tuple(sorted(range(d_lo, d_hi + 1), key=lambda d: (abs(d), d)))


def level_codes(a: float, b: float, d: int) -> np.ndarray:
    """E2M1 nibble -> 2-bit code for levels {-b, -a, a, b} * 2^d (codes 0..3 = -b, -a, +a, +b).

    Nearest level in value; ties are sign-symmetric: +-0 go to +-a by their sign
    bit, and |v| exactly between a and b goes to a (the smaller magnitude).
    """
    au, bu = _level_units(a, d), _level_units(b, d)
    codes = np.empty(16, np.uint8)
    for nib in range(16):
        small = 2 * _MAG_UNITS[nib & 7] <= au + bu
        codes[nib] = (1 if small else 0) if nib & 8 else (2 if small else 3)
    return codes


def level_errors(a: float, b: float, d: int) -> np.ndarray:
    """Squared error per E2M1 magnitude (int64 [8], units 2^(2*(s + UNIT_EXP))) for the rounding of ``level_codes``."""
    au, bu = _level_units(a, d), _level_units(b, d)
    m = _MAG_UNITS
    q = np.where(2 * m <= au + bu, au, bu)
    return ((m - q) ** 2).astype(np.int64)


def _level_units(x: float, d: int) -> int:
    v = Fraction(x) * Fraction(2) ** d * 2 ** -UNIT_EXP
    assert v.denominator == 1
    return int(v)


def magnitude_histogram(blocks: np.ndarray) -> np.ndarray:
    """MXFP4 blocks U8 [n, 16] -> int64 [n, 8] counts of each E2M1 magnitude (sign ignored)."""
    mags = np.concatenate([blocks & 7, (blocks >> 4) & 7], axis=1)
    return (mags[:, :, None] == np.arange(8, dtype=np.uint8)).sum(axis=1, dtype=np.int64)


class _SetTables:
    """Per-candidate tables for one level set: offsets d, error rows, byte -> 4-bit code LUTs."""

    def __init__(self, a: float, b: float):
        ds = fit_window(a, b)
        self.a, self.b = a, b
        self.d = np.array(ds, dtype=np.int64)
        self.err = np.stack([level_errors(a, b, d) for d in ds])
        self.lut = np.stack([_byte_lut(level_codes(a, b, d)) for d in ds])
        for t in (self.d, self.err, self.lut):
            t.flags.writeable = False


_REFIT_TABLES = _SetTables(*MOET_SET)
REFIT_WINDOW = tuple(int(d) for d in _REFIT_TABLES.d)
"""Exponent offsets refit searches, in preference order (-5..2 for {1, 4})."""

assert np.array_equal(level_codes(*MOET_SET, 0), NIBBLE_TO_CODE)  # refit at d = 0 is keep-scales
