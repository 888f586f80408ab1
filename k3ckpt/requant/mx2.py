"""MXFP4 -> k3ckpt MX2 (``k3ckpt.formats.mx2`` holds the format and its decoder).

MX2 stores 2-bit codes, one block byte (selector << 6 | exponent offset) per
32, and per tensor four level sets {-b, -a, a, b} (E2M1 magnitudes) and an
exponent base.  Encoding from MXFP4 is exact least squares against the
decoded source, in integer arithmetic on the MXFP4 codes (the kernels hold
the integers in float64, exactly):

1. ``plan``: one pass over the blocks.  The 21 sign-symmetric sets from
   {0.5, 1, 1.5, 2, 3, 4, 6} fall into eleven classes (``SHAPES``) whose
   members differ only by a power of two, which the block exponent absorbs
   (e.g. {1, 2} ~ {2, 4}, but {1.5, 3} is its own class).  For each block and
   class: the least error over the class's exponent window
   (``moet.fit_window``).  Summed per source scale byte for every 4-subset of
   classes (330 of them); the subset with the least total (exact integers)
   gives the four sets.  ``exp_base`` is chosen so every block reaches its
   whole window (when the tensor's scale spread allows).
2. ``encode``: per block the (selector, exponent) with the least error, codes
   by sign-symmetric nearest rounding (``moet.level_codes``).

Tie-breaks (documented in docs/formats/mx2.md): among exponents, the one
nearest the source exponent, then the lower; among selectors, the lower;
among 4-subsets, the first in lexicographic order of ``SHAPES``.

Each numba kernel has a numpy twin (``*_reference``); tests hold them equal.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .._numba import njit
from ..errors import UnsupportedError, UsageError
from ..formats.mx2 import E2M1_CODE, OFFSET_NAN
from .moet import KEEP_LUT, UNIT_EXP, _SetTables, check_mxfp4, fit_window, magnitude_histogram

ALL_SETS = tuple(itertools.combinations(sorted(E2M1_CODE), 2))
"""The 21 sign-symmetric sets {-b, -a, a, b}, as (a, b) with a < b."""


def _canonical_shapes() -> tuple[tuple[float, float], ...]:
    # Sets that differ by a power of two are one class: the block exponent turns
    # one into the other.  Keep the member with the smallest a (it reaches the
    # lowest values from exp_base, where all-zero blocks sit).  Order: b/a, then a.
    def key(a, b):
        a_norm = Fraction(a)
        while a_norm >= 2:
            a_norm /= 2
        while a_norm < 1:
            a_norm *= 2
        return Fraction(b) / Fraction(a), a_norm

    best: dict[tuple[Fraction, Fraction], tuple[float, float]] = {}
    for a, b in ALL_SETS:
        k = key(a, b)
        if k not in best or a < best[k][0]:
            best[k] = (a, b)
    return tuple(best[k] for k in sorted(best))


SHAPES = _canonical_shapes()
"""The eleven power-of-two classes searched by ``plan`` (one member each), in b/a order:
(1.5,2) (1,1.5) (0.5,1) (1.5,3) (1.5,4) (0.5,1.5) (0.5,2) (1.5,6) (0.5,3) (0.5,4) (0.5,6)."""

COMBOS = np.array(list(itertools.combinations(range(len(SHAPES)), 4)), dtype=np.int64)
"""All 330 4-subsets of ``SHAPES`` (lexicographic: the tie-break order)."""
COMBOS.flags.writeable = False

MAX_OFFSET = OFFSET_NAN - 1

D_MIN = min(min(fit_window(a, b)) for a, b in SHAPES)
D_MAX = max(max(fit_window(a, b)) for a, b in SHAPES)
MAX_SPREAD = MAX_OFFSET - D_MAX
"""Largest max - min of the scale bytes of a tensor's nonzero blocks that MX2 accepts."""
FULL_SPREAD = MAX_OFFSET - (D_MAX - D_MIN)
"""Up to this spread every block can use its whole exponent window."""


@dataclass(frozen=True)
class MX2Plan:
    """The per-tensor choices: exponent base and the four level sets (selector order)."""

    exp_base: int
    sets: tuple[tuple[float, float], ...]
    sse: float = math.nan          # total squared error of the search's choice (NaN if not searched)
    blocks: int = 0                # non-NaN blocks searched
    zero_blocks: int = 0
    nan_blocks: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.exp_base <= 254):
            raise UsageError(f"MX2 exp_base must be an E8M0 byte 0..254, found {self.exp_base}")
        if len(self.sets) != 4 or any(tuple(s) not in ALL_SETS for s in self.sets):
            raise UsageError(f"MX2 needs 4 level sets (a, b), a < b from {sorted(E2M1_CODE)}; found {self.sets}")

    @property
    def levels(self) -> np.ndarray:
        """The ``levels`` part: U8 [4, 2] E2M1 codes of (a, b) per selector."""
        return np.array([[E2M1_CODE[a], E2M1_CODE[b]] for a, b in self.sets], dtype=np.uint8)

    def to_dict(self) -> dict:
        return {"exp_base": self.exp_base, "sets": [list(s) for s in self.sets], "sse": self.sse,
                "blocks": self.blocks, "zero_blocks": self.zero_blocks, "nan_blocks": self.nan_blocks}


# ------------------------------------------------------------------------ tables

@functools.cache
def _tables(sets: tuple[tuple[float, float], ...]) -> _Tables:
    return _Tables(sets)


_NO_CANDIDATE = 2.0 ** 60   # key of a padding candidate or one whose exponent byte cannot be stored
_LANES = 11   # sets per search: the eleven SHAPES (a plan's four are padded with empty lanes)
_SLOTS = 10   # the longest fit_window over all 21 sets
_PREFIXES = _LANES - 4   # sorted prefixes P_1..P_7 that a 4-subset of the eleven sets can miss
# Module-level ints are compile-time constants in numba: fixed trip counts let
# LLVM unroll and vectorise the kernels' inner loops.


class _Tables:
    """The candidates (set, exponent offset) of up to ``_LANES`` level sets, slot-major.

    Candidate c = slot * _LANES + lane: slot w of lane k is the w-th offset of
    its set's window (``fit_window`` order); shorter windows and unused lanes
    are padding that can never win.  ``key_t`` [8, n] is the error table
    transposed, times 16, in float64, and ``key0`` [n] is the slot (2^60 for
    padding): ``key = key0 + sum_m h[m] * key_t[m]`` is 16 * error + slot, and
    a minimum over a lane's slots gives the set's least error and the first
    slot reaching it.  The kernel uses h[0] = 32 - (h[1] + .. + h[7]) to drop
    a term: ``key = key0_h + sum_{m>=1} h[m] * key_h[m-1]`` (``key0_h = key0 +
    32 key_t[0]``, ``key_h = key_t[1:] - key_t[0]``), vectorised over the first
    ``n_used`` candidates (those past the last real one are padding).  Every
    value is an integer below 2^53, so float64 holds it exactly in any order.
    """

    def __init__(self, sets):
        ts = [_SetTables(a, b) for a, b in sets]
        assert len(ts) <= _LANES and max(len(t.d) for t in ts) <= _SLOTS
        self.nsets = len(ts)
        n = _SLOTS * _LANES
        self.valid = np.zeros(n, bool)
        self.d = np.zeros(n, np.int64)
        self.err = np.zeros((n, 8), np.int64)
        self.lut = np.zeros((n, 256), np.uint8)
        self.key0 = np.full(n, _NO_CANDIDATE)
        for k, t in enumerate(ts):
            for slot in range(len(t.d)):
                c = slot * _LANES + k
                self.valid[c] = True
                self.d[c], self.err[c], self.lut[c], self.key0[c] = t.d[slot], t.err[slot], t.lut[slot], slot
        self.key_t = np.ascontiguousarray(16.0 * self.err.T)                   # [8, n]
        self.key0_h = self.key0 + 32.0 * self.key_t[0]
        self.key_h = np.ascontiguousarray(self.key_t[1:] - self.key_t[0])      # [7, n]
        self.n_used = int(np.flatnonzero(self.valid).max()) + 1 if self.valid.any() else 0
        assert int(self.err.max()) * 32 * 16 < 2 ** 53
        for t in (self.valid, self.d, self.err, self.lut, self.key0, self.key_t, self.key0_h, self.key_h):
            t.flags.writeable = False


def _zero_block_error(a: float) -> int:
    # 32 zeros at offset 0 -> 32 * (a * 2^-UNIT_EXP)^2 in units of the base exponent.
    return 32 * int(Fraction(a) * 2 ** -UNIT_EXP) ** 2


# ------------------------------------------------------------------------ search

def _hist_lut() -> np.ndarray:
    # MXFP4 byte -> its two magnitudes as counts in 8-bit lanes of a uint64: summing
    # 16 of these gives a block's histogram (counts <= 32 never carry).
    b = np.arange(256, dtype=np.uint64)
    one = np.uint64(1)
    return (one << (np.uint64(8) * (b & np.uint64(7)))) + (one << (np.uint64(8) * ((b >> np.uint64(4)) & np.uint64(7))))


HIST_LUT = _hist_lut()
HIST_LUT.flags.writeable = False


@njit(inline="always")
def _ce(a, b):
    return min(a, b), max(a, b)


@njit(inline="always")
def _sort11(k):
    """Sort 11 values in place: a 37-comparator sorting network, straight-line and branch-free.

    Batcher's odd-even merge sort for 16 inputs restricted to lines 0..10 (the
    padding lines would hold +inf and never move), less one redundant
    comparator; tests check it on all 2^11 0-1 inputs (0-1 principle).
    """
    k0, k1, k2, k3, k4, k5, k6, k7, k8, k9, k10 = k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7], k[8], k[9], k[10]
    k0, k1 = _ce(k0, k1)
    k2, k3 = _ce(k2, k3)
    k0, k2 = _ce(k0, k2)
    k1, k3 = _ce(k1, k3)
    k1, k2 = _ce(k1, k2)
    k4, k5 = _ce(k4, k5)
    k6, k7 = _ce(k6, k7)
    k4, k6 = _ce(k4, k6)
    k5, k7 = _ce(k5, k7)
    k5, k6 = _ce(k5, k6)
    k0, k4 = _ce(k0, k4)
    k2, k6 = _ce(k2, k6)
    k2, k4 = _ce(k2, k4)
    k1, k5 = _ce(k1, k5)
    k3, k7 = _ce(k3, k7)
    k3, k5 = _ce(k3, k5)
    k1, k2 = _ce(k1, k2)
    k3, k4 = _ce(k3, k4)
    k5, k6 = _ce(k5, k6)
    k8, k9 = _ce(k8, k9)
    k8, k10 = _ce(k8, k10)
    k9, k10 = _ce(k9, k10)
    k0, k8 = _ce(k0, k8)
    k4, k8 = _ce(k4, k8)
    k2, k10 = _ce(k2, k10)
    k6, k10 = _ce(k6, k10)
    k2, k4 = _ce(k2, k4)
    k6, k8 = _ce(k6, k8)
    k1, k9 = _ce(k1, k9)
    k5, k9 = _ce(k5, k9)
    k3, k5 = _ce(k3, k5)
    k7, k9 = _ce(k7, k9)
    k1, k2 = _ce(k1, k2)
    k3, k4 = _ce(k3, k4)
    k5, k6 = _ce(k5, k6)
    k7, k8 = _ce(k7, k8)
    k9, k10 = _ce(k9, k10)
    k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7], k[8], k[9], k[10] = k0, k1, k2, k3, k4, k5, k6, k7, k8, k9, k10


@njit(fastmath=True)
def _search_kernel(packed, scale, lo_e, hi_e, hist_lut, key0_h, cand_d, key_h, n_used,
                   order, slots, ranks, acc1, fmask, nblk, info):
    """Per nonzero block and per level set (lane): least error over the set's window.

    For block q: slots[q] nibble k <- the first window slot reaching set k's
    least error; order[q] nibble j <- the set with the j-th smallest least
    error (ties: lower set first).  NaN and all-zero blocks are skipped (left
    0).  With ``ranks`` (all eleven sets), also the data
    for the 4-subset search (see ``_combo_totals``): acc1[s] += least error
    over the sets; for j = 1..7, fmask[s, P_j] += e_(j+1) - e_(j), where
    e_(1) <= e_(2) <= ... are the block's per-set errors and P_j the bit mask
    of the sets holding the j smallest.  nblk[s] counts nonzero blocks per
    scale byte.  info <- [min, max] scale byte of nonzero blocks, zero
    blocks, NaN blocks.

    fastmath is safe here: every float is an exact integer below 2^53 (no
    NaN, no inf), so contraction and reordering cannot change a result.
    """
    nc = _SLOTS * _LANES
    nb = scale.shape[1]
    dmin = cand_d.min()
    dmax = cand_d.max()
    k1, k2, k3, k4, k5, k6, k7 = key_h[0], key_h[1], key_h[2], key_h[3], key_h[4], key_h[5], key_h[6]
    key = np.full(nc, _NO_CANDIDATE)            # candidates from n_used on stay padding
    keys = np.empty(_LANES, np.int64)
    sh = np.uint64(4)
    smin = 256
    smax = -1
    nzero = 0
    nnan = 0
    for r in range(packed.shape[0]):
        for blk in range(nb):
            s = np.int64(scale[r, blk])
            if s == 255:
                nnan += 1
                continue
            hp = np.uint64(0)
            for j in range(16):
                hp += hist_lut[packed[r, blk * 16 + j]]
            if hp & np.uint64(0xFF) == 32:
                nzero += 1
                continue
            h1 = np.float64((hp >> np.uint64(8)) & np.uint64(0xFF))
            h2 = np.float64((hp >> np.uint64(16)) & np.uint64(0xFF))
            h3 = np.float64((hp >> np.uint64(24)) & np.uint64(0xFF))
            h4 = np.float64((hp >> np.uint64(32)) & np.uint64(0xFF))
            h5 = np.float64((hp >> np.uint64(40)) & np.uint64(0xFF))
            h6 = np.float64((hp >> np.uint64(48)) & np.uint64(0xFF))
            h7 = np.float64(hp >> np.uint64(56))
            smin = min(smin, s)
            smax = max(smax, s)
            for c in range(n_used):
                key[c] = key0_h[c] + (((h1 * k1[c] + h2 * k2[c]) + (h3 * k3[c] + h4 * k4[c]))
                                     + ((h5 * k5[c] + h6 * k6[c]) + h7 * k7[c]))
            if s + dmin < lo_e or s + dmax > hi_e:
                for c in range(nc):
                    e = s + cand_d[c]
                    if e < lo_e or e > hi_e:
                        key[c] = _NO_CANDIDATE
            q = r * nb + blk
            sc = np.uint64(0)
            for k in range(_LANES):
                m = key[k]
                for w in range(1, _SLOTS):
                    v = key[w * _LANES + k]
                    m = v if v < m else m
                mk = np.int64(m)                          # 16 * error + slot
                sc |= np.uint64(mk & 15) << (sh * np.uint64(k))
                keys[k] = (mk & ~np.int64(15)) | k       # 16 * error + set: sorts by error, then set
            slots[q] = sc
            nblk[s] += 1
            _sort11(keys)
            oc = np.uint64(0)
            for j in range(_LANES):
                oc |= np.uint64(keys[j] & 15) << (sh * np.uint64(j))
            order[q] = oc
            if not ranks:
                continue
            e_prev = keys[0] >> 4
            acc1[s] += e_prev
            mask = 0
            for j in range(_PREFIXES):
                mask |= 1 << (keys[j] & 15)
                e_next = keys[j + 1] >> 4
                fmask[s, mask] += e_next - e_prev
                e_prev = e_next
    info[0] = smin
    info[1] = smax
    info[2] = nzero
    info[3] = nnan


def _combo_totals(acc1, fmask, nblk) -> dict[int, list[int]]:
    """Per scale byte s with nonzero blocks: total least error of each 4-subset (``COMBOS`` order).

    With a block's per-set errors sorted, e_(1) <= e_(2) <= ..., and P_j the
    sets holding the j smallest: min over C of e_k = e_(1) + sum_j
    (e_(j+1) - e_(j)) [P_j and C disjoint], because the first member of C in
    sorted order comes right after the longest prefix disjoint from C.  With
    |C| = 4 of 11 only P_1..P_7 can be disjoint.  So a subset's total is
    acc1 + the sum of fmask over masks inside its complement: a subset-sum
    (zeta) transform over the 11 bits, then one lookup per subset.
    """
    rows = np.nonzero(nblk)[0]
    if not len(rows):
        return {}
    g = fmask[rows].copy()                                  # [rows, 2^11]
    for bit in range(_LANES):                               # g[S] <- sum over P subset of S of fmask[P]
        v = g.reshape(len(rows), -1, 2, 1 << bit)
        v[:, :, 1, :] += v[:, :, 0, :]
    full = (1 << _LANES) - 1
    comp = full ^ (np.int64(1) << COMBOS).sum(axis=1)       # complement mask of each subset
    tot = acc1[rows, None] + g[:, comp]
    return {int(r): [int(v) for v in row] for r, row in zip(rows, tot)}


_REF_CHUNK = 4096  # blocks per numpy step (bounds the reference's temporaries)


def _search_reference(packed, scale, lo_e, hi_e, t: _Tables, order, slots, combos):
    """Numpy twin of ``_search_kernel`` + ``_combo_totals``: int64 errors, combos by direct minimum.

    Returns (totals per scale byte as in ``_combo_totals`` or {}, info).
    """
    blocks = packed.reshape(-1, 16)
    sb = scale.reshape(-1).astype(np.int64)
    acc = np.zeros((256, len(COMBOS)), np.int64)
    nblk = np.zeros(256, np.int64)
    info = np.array([256, -1, 0, 0], np.int64)
    big = int(_NO_CANDIDATE) >> 4
    for i in range(0, len(sb), _REF_CHUNK):
        bl, s = blocks[i:i + _REF_CHUNK], sb[i:i + _REF_CHUNK]
        h = magnitude_histogram(bl)
        nan = s == 255
        zero = ~nan & (h[:, 0] == 32)
        keep = ~nan & ~zero
        info[2] += int(zero.sum())
        info[3] += int(nan.sum())
        if not keep.any():
            continue
        q = i + np.nonzero(keep)[0]
        h, s = h[keep], s[keep]
        info[0] = min(info[0], int(s.min()))
        info[1] = max(info[1], int(s.max()))
        err = h @ t.err.T                                  # [blocks, candidates]
        e = s[:, None] + t.d[None, :]
        err = np.where(t.valid[None, :] & (e >= lo_e) & (e <= hi_e), err, big)
        lane_err = np.empty((len(q), _LANES), np.int64)
        lane_slot = np.empty((len(q), _LANES), np.uint64)
        for k in range(_LANES):
            w = err[:, k::_LANES]                           # the set's window, slot order
            arg = np.argmin(w, axis=1)                      # first minimum
            lane_slot[:, k] = arg
            lane_err[:, k] = w[np.arange(len(q)), arg]
        nib = np.uint64(4) * np.arange(_LANES, dtype=np.uint64)
        slots[q] = np.bitwise_or.reduce(lane_slot << nib, axis=1)
        ranked = np.argsort(lane_err, axis=1, kind="stable").astype(np.uint64)   # ties: lower set first
        order[q] = np.bitwise_or.reduce(ranked << nib, axis=1)
        np.add.at(nblk, s, 1)
        if combos:
            np.add.at(acc, s, lane_err[:, COMBOS].min(axis=2))
    rows = np.nonzero(nblk)[0]
    totals = {int(r): [int(v) for v in acc[r]] for r in rows} if combos else {}
    return totals, info


def _search(p, s, lo_e, hi_e, t: _Tables, *, combos: bool, reference: bool):
    """Run the per-block search; returns (order, slots, totals per scale byte, info)."""
    assert t.nsets == _LANES or not combos
    nq = p.shape[0] * s.shape[1]
    order = np.zeros(nq, np.uint64)
    slots = np.zeros(nq, np.uint64)
    if reference:
        totals, info = _search_reference(p, s, lo_e, hi_e, t, order, slots, combos)
        return order, slots, totals, info
    acc1 = np.zeros(256, np.int64)
    fmask = np.zeros((256, 1 << _LANES) if combos else (1, 1), np.int64)
    nblk = np.zeros(256, np.int64)
    info = np.zeros(4, np.int64)
    _search_kernel(p, s, lo_e, hi_e, HIST_LUT, t.key0_h, t.d, t.key_h, t.n_used,
                   order, slots, combos, acc1, fmask, nblk, info)
    return order, slots, (_combo_totals(acc1, fmask, nblk) if combos else {}), info


def _exp_base(smin: int, smax: int, name: str | None) -> int:
    if smax < 0:                       # no nonzero block: any base works
        return 0
    if smax - smin > MAX_SPREAD:
        raise UnsupportedError(
            f"MX2 reaches {MAX_OFFSET + 1} exponents from one base; this tensor's nonzero blocks span "
            f"scale bytes {smin}..{smax} (spread {smax - smin}, at most {MAX_SPREAD} fits)",
            tensor=name,
        )
    # Lowest useful exponent of the smallest block, unless the largest blocks would
    # then lose the top of their window (spread > FULL_SPREAD): the big blocks win.
    return max(0, smin + D_MIN, smax + D_MAX - MAX_OFFSET)


def _plan_search(p, s, name, reference):
    """The plan and the per-block search results over ``SHAPES`` it was chosen from."""
    t = _tables(SHAPES)
    # Unclipped exponents first: equal to the clipped search whenever the spread
    # is <= FULL_SPREAD (every window then fits); otherwise search again.
    res = _search(p, s, 0, 254, t, combos=True, reference=reference)
    smin, smax, nzero, nnan = (int(v) for v in res[3])
    base = _exp_base(smin, smax, name)
    if smax >= 0 and smax - smin > FULL_SPREAD:
        res = _search(p, s, base, min(base + MAX_OFFSET, 254), t, combos=True, reference=reference)
    totals = res[2]
    if nzero:   # all-zero blocks sit at offset 0 with the set of least a
        row = totals.setdefault(base, [0] * len(COMBOS))
        for c, combo in enumerate(COMBOS):
            row[c] += nzero * min(_zero_block_error(SHAPES[k][0]) for k in combo)
    best_c, total, s0 = _least_total(totals)
    pl = MX2Plan(
        exp_base=base,
        sets=tuple(SHAPES[k] for k in COMBOS[best_c]),
        sse=math.ldexp(float(total), 2 * (s0 - 127 + UNIT_EXP)) if totals else 0.0,
        blocks=p.shape[0] * s.shape[1] - nnan,
        zero_blocks=nzero,
        nan_blocks=nnan,
    )
    return pl, res, COMBOS[best_c]


def _least_total(rows: dict[int, list[int]]) -> tuple[int, int, int]:
    """Exact argmin over combos of sum_s rows[s][c] * 4^s (Python ints); ties -> lowest c."""
    if not rows:
        return 0, 0, 0
    s0 = min(rows)
    totals = [0] * len(COMBOS)
    for s, row in rows.items():
        sh = 2 * (s - s0)
        for c, v in enumerate(row):
            totals[c] += v << sh
    best = min(range(len(totals)), key=lambda c: (totals[c], c))
    return best, totals[best], s0


def plan(packed, scale, *, name: str | None = None) -> MX2Plan:
    """Choose exp_base and the four level sets with the least total squared error (numba)."""
    p, s = check_mxfp4(packed, scale, name=name)
    return _plan_search(p, s, name, reference=False)[0]


def plan_reference(packed, scale, *, name: str | None = None) -> MX2Plan:
    """Numpy twin of ``plan``."""
    p, s = check_mxfp4(packed, scale, name=name)
    return _plan_search(p, s, name, reference=True)[0]


# ------------------------------------------------------------------------ encode

@njit
def _encode_kernel(packed, scale, base, sel_of_lane, cand_d, cand_lut, order, slots, zero_sel, keep_lut,
                   out, out_block):
    """Codes and block bytes from the search: per block the first chosen set in
    the block's error order (least error; ties: lowest selector) at its slot."""
    nb = scale.shape[1]
    for r in range(packed.shape[0]):
        for blk in range(nb):
            s = np.int64(scale[r, blk])
            p0 = blk * 16
            q0 = blk * 8
            anyv = 0
            for j in range(16):
                anyv |= packed[r, p0 + j] & 0x77
            if s == 255 or anyv == 0:
                # NaN block -> byte 0xFF.  All-zero block -> offset 0 with the set
                # of least a.  Codes: sign bits (+-a) / the Moet map; never decoded for NaN.
                out_block[r, blk] = 255 if s == 255 else zero_sel << 6
                for j in range(8):
                    out[r, q0 + j] = keep_lut[packed[r, p0 + 2 * j]] | (keep_lut[packed[r, p0 + 2 * j + 1]] << 4)
                continue
            q = r * nb + blk
            oc = order[q]
            lane = 0
            for j in range(_LANES):
                lane = np.int64((oc >> np.uint64(4 * j)) & np.uint64(15))
                if sel_of_lane[lane] >= 0:
                    break
            c = np.int64((slots[q] >> np.uint64(4 * lane)) & np.uint64(15)) * _LANES + lane
            out_block[r, blk] = (sel_of_lane[lane] << 6) | (s + cand_d[c] - base)
            for j in range(8):
                out[r, q0 + j] = cand_lut[c, packed[r, p0 + 2 * j]] | (cand_lut[c, packed[r, p0 + 2 * j + 1]] << 4)


def _encode_reference(packed, scale, base, sel_of_lane, cand_d, cand_lut, order, slots, zero_sel, keep_lut,
                      out, out_block):
    """Numpy twin of ``_encode_kernel`` (same arguments, same outputs)."""
    blocks = packed.reshape(-1, 16)
    sb = scale.reshape(-1).astype(np.int64)
    nib = np.uint64(4) * np.arange(_LANES, dtype=np.uint64)
    ranked = ((order[:, None] >> nib) & np.uint64(15)).astype(np.int64)     # [blocks, 11] sets by error
    first = np.argmax(sel_of_lane[ranked] >= 0, axis=1)
    lane = ranked[np.arange(len(sb)), first]
    slot = ((slots >> (np.uint64(4) * lane.astype(np.uint64))) & np.uint64(15)).astype(np.int64)
    c = slot * _LANES + lane
    four = cand_lut[c[:, None], blocks]
    byte = (sel_of_lane[lane] << 6) | (sb + cand_d[c] - base)
    nan = sb == 255
    zero = ~nan & ~((blocks & 0x77) != 0).any(axis=1)
    special = nan | zero
    four[special] = keep_lut[blocks[special]]
    byte[zero] = zero_sel << 6
    byte[nan] = 255
    out.reshape(-1, 8)[:] = four[:, 0::2] | (four[:, 1::2] << 4)
    out_block.reshape(-1)[:] = byte.astype(np.uint8)


def _write(p, s, shape, the_plan: MX2Plan, t: _Tables, lanes, order, slots, reference):
    """Encode with the searched ``order`` / ``slots``; ``lanes`` = the table lane of each selector."""
    zero_sel = min(range(4), key=lambda i: (the_plan.sets[i][0], i))
    sel_of_lane = np.full(_LANES, -1, np.int64)
    sel_of_lane[np.asarray(lanes)] = np.arange(4)
    assert (np.diff(np.asarray(lanes)) > 0).all()       # selector order = lane order (tie-break)
    out = np.empty((p.shape[0], p.shape[1] // 2), np.uint8)
    block = np.empty_like(s)
    (_encode_reference if reference else _encode_kernel)(
        p, s, the_plan.exp_base, sel_of_lane, t.d, t.lut, order, slots, zero_sel, KEEP_LUT, out, block)
    lead = shape[:-1]
    return {
        "packed": out.reshape(lead + (out.shape[1],)),
        "scale": block.reshape(lead + (block.shape[1],)),
        "levels": the_plan.levels,
        "exp_base": np.array([the_plan.exp_base], dtype=np.uint8),
    }


def _encode_with_plan(packed, scale, the_plan: MX2Plan, name, reference):
    shape = np.shape(packed)
    p, s = check_mxfp4(packed, scale, name=name)
    base = the_plan.exp_base
    hi = min(base + MAX_OFFSET, 254)
    nz = (s != 255) & ((p.reshape(p.shape[0], -1, 16) & 0x77) != 0).any(axis=2)
    if nz.any():
        # d = 0 must be storable for every nonzero block, so each has a candidate.
        lo_s, hi_s = int(s[nz].min()), int(s[nz].max())
        if lo_s < base or hi_s > hi:
            raise UnsupportedError(
                f"MX2 exp_base {base} reaches scale bytes {base}..{hi}; this tensor's nonzero blocks "
                f"use {lo_s}..{hi_s}", tensor=name)
    t = _tables(tuple(tuple(x) for x in the_plan.sets))
    order, slots, _, _ = _search(p, s, base, hi, t, combos=False, reference=reference)
    return _write(p, s, shape, the_plan, t, range(4), order, slots, reference)


def encode_with_plan(packed, scale, the_plan: MX2Plan, *, name: str | None = None) -> dict[str, np.ndarray]:
    """Encode MXFP4 with a given plan (numba); parts keyed packed / scale / levels / exp_base."""
    return _encode_with_plan(packed, scale, the_plan, name, reference=False)


def encode_with_plan_reference(packed, scale, the_plan: MX2Plan, *, name: str | None = None) -> dict[str, np.ndarray]:
    """Numpy twin of ``encode_with_plan``."""
    return _encode_with_plan(packed, scale, the_plan, name, reference=True)


def _encode_searched(packed, scale, name, reference):
    shape = np.shape(packed)
    p, s = check_mxfp4(packed, scale, name=name)
    pl, (order, slots, _, _), chosen = _plan_search(p, s, name, reference)
    return _write(p, s, shape, pl, _tables(SHAPES), chosen, order, slots, reference), pl


def encode(packed, scale, *, name: str | None = None) -> tuple[dict[str, np.ndarray], MX2Plan]:
    """MXFP4 -> MX2 parts and the plan chosen for this tensor (numba).

    Same bytes as ``encode_with_plan(packed, scale, plan(packed, scale))``, with one search pass.
    """
    return _encode_searched(packed, scale, name, reference=False)


def encode_reference(packed, scale, *, name: str | None = None) -> tuple[dict[str, np.ndarray], MX2Plan]:
    """Numpy twin of ``encode``."""
    return _encode_searched(packed, scale, name, reference=True)
