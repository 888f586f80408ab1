"""The weighted grid search that the IQ2_XXS, IQ2_S, IQ1_S and IQ1_M encoders share, numba.

The IQ2 types decode a super-block of 256 weights as ``d * (0.5 + s) / 4 * g * sign``:
``d`` one fp16, ``s`` a 4-bit scale per sub-block of ``G`` groups of 8 weights, ``g`` an
8-vector of a grid with entries 8, 25, 43 per group and ``sign`` an 8-bit pattern.  IQ1_S
decodes as ``d * (2 s + 1) * (g + delta)``: ``s`` 3 bits, ``g`` from a grid of -1, 0, 1 (the
signs are in the grid) and ``delta`` = +-1/8 per sub-block; IQ1_M the same with ``s`` per 16
weights and ``delta`` per group of 8.  What differs is a ``Grid`` row:
the grid (IQ2_XXS: 256 points, IQ2_S: 1024, IQ1_S: 2048), ``G`` (4: a scale per 32 weights;
2: per 16), the parity rule (IQ2_XXS stores 7 sign bits, so a pattern has an even number of
minus signs; IQ2_S stores all 8), a signed grid, the shifts (per sub-block or per group) and the scale's step and range.
The search returns codes (``Codes``: d, per group its grid index and sign pattern, per
sub-block its scale and shift); each format module packs them into its bytes.

The error minimised is ``sum w_i (value_i - x_i)^2`` with llama.cpp's weights
``w_i = imatrix_i * sqrt(sigma^2 + x_i^2)`` (``sigma^2`` the super-block's mean
square, all-ones importance when none is given).  Per super-block:

1. Per group of 8 (magnitudes ``a``, or the values themselves on a signed grid; weights
   ``w``), for every point ``g`` (at shift ``delta``, IQ1: ``g + delta``),
   ``B_g = sum w a g``, minus ``2 min_j w_j a_j g_j`` when the parity rule holds
   and the group has an odd number of negative inputs (one sign flip is forced,
   cheapest where ``w a g`` is least); the error at step ``t`` is
   ``sum w a^2 + t (t N_g - 2 B_g)``, ``N_g = sum w g^2``.  The grid's points
   fall into classes of equal ``|g|^2`` (IQ2_XXS 12, IQ2_S 16; IQ1_S 39, of equal
   ``|g|^2`` and ``sum g``, so that ``|g + delta|^2`` is equal too); per class one
   point is kept with its own ``B`` and ``N``: the one with the largest
   ``B - t0 N / 2`` at an expected step ``t0 = tau * sqrt(sum w a^2 / sum w)``
   of its sub-block (the largest ``B`` when a group's weights are equal).  The
   pass over the points (``_class_scores``) has the SIMD-lane layout of
   ``requant.iq2xs._class_maxima``.  The points are scored once, unshifted; each shift takes
   the same points, ``B`` and ``N`` there from the point's unshifted sums (``B + delta sum w a``,
   ``N + 2 delta sum w g + delta^2 sum w``), and ``B`` itself is the score plus ``t0 N / 2``,
   so only ``N`` (and ``sum w g``) is summed again (``_class_values``).
2. Per sub-block of ``G`` groups: a free step ``t*``: classes by their best gain
   ``B^2 / N`` (``B > 0``), then ``ALT`` rounds of the least-squares ``t`` for the chosen
   classes and the best classes at that ``t``; with two shifts, the step of the shift
   that errs less there.  With a shift per group (IQ1_M) the two shifts' classes stand side
   by side as one list, so each group picks a (shift, class) pair and there is one pass.
3. Per super-block: fp16 ``d`` candidates ``max t* / (unit * (scale_max + 0.5)) * m``, m in ``Grid.d_mult``
   (IQ2: ``4 max t* / 15.5``); for each, every sub-block takes the best of the two scales
   around ``t* / (d unit) - 0.5`` at each shift (the class minimum per group); then up to ``Grid.ls_steps``
   least-squares refinements of ``d`` (classes and scales fixed), rounded to
   fp16, kept only when the error drops.
4. Codes: the winning class (first of equal errors) and its point; signs are
   the inputs' sign bits, with the cheapest element flipped when the parity
   rule holds and the group is odd.

On the IQ2 grids the choice depends on magnitudes only and zero inputs keep their sign bit,
so ``encode(-x)`` decodes to exactly ``-decode(encode(x))``.  Inputs are scaled per
super-block by a power of two (exact); super-blocks with ``max|x| < 2^-24``
encode as zeros and ``d`` is clamped to 65504.

A class's B and N are float32 sums, and its error ``t (t N - 2 B)`` is taken in float32 too
(``t`` rounded to float32): twice the SIMD lanes of float64 in the passes of steps 2-4; the
sums over classes and sub-blocks (least-squares steps, totals) are float64.

``search`` (numba) and ``search_reference`` (numpy, the same float operations in
the same order, ties broken the same way) return identical codes.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import numpy as np

from ._ggml_encode import (QK, TINY, _f16_bits_nb, _jit, _round_f16_nb, best_d, block_inputs, class_argmax,
                           class_argmax_plain, freeze, grid_classes, half_offsets, half_sums, pattern_sums,
                           round_f16)

__all__ = ["ALT", "Codes", "D_MULT", "Grid", "LS_STEPS", "search", "search_reference", "search_tables"]

D_MULT = (1.0, 0.97, 0.94, 0.91)      # the d candidates' default multipliers (Grid.d_mult)
ALT = 2
LS_STEPS = 2                           # the default Grid.ls_steps
SB_CHUNK = 8                  # super-blocks per kernel pass: 256 groups as SIMD lanes (4: 2-6% slower)


@dataclass(frozen=True)
class Grid:
    """What one grid type searches.

    ``label`` ggml's name (for messages); ``group_count`` G groups of 8 per scale;
    ``parity``: a sign pattern must have an even number of minus signs; ``tau``: class points
    are scored as B - (t/2) N at the expected step t = tau * the sub-block's weighted RMS
    magnitude (the median of t* / RMS on Gaussian and Student-t data).  ``levels``: the grid's
    three entry values; ``signed``: the grid carries the signs (IQ1: -1, 0, 1), so the search
    runs on the values, not their magnitudes, and stores no sign bits; ``deltas``: the shifts
    added to every entry, one chosen per sub-block (IQ1_S: +-1/8) or, with ``shift_per_group``,
    per group of 8 (IQ1_M); a step is
    ``d * step_unit * (0.5 + s)``, ``s`` in 0 .. ``scale_max``.  ``d_mult``: the fp16 ``d``
    candidates' multipliers of step 3 (each costs a pass over the classes; the least-squares
    steps after them recover most of what more candidates would find); ``ls_steps``: at most
    that many least-squares refinements of ``d`` after them.
    """

    label: str
    group_count: int
    parity: bool
    tau: float
    levels: tuple[int, int, int] = (8, 25, 43)
    signed: bool = False
    deltas: tuple[float, ...] = (0.0,)
    step_unit: float = 0.25
    scale_max: int = 15
    shift_per_group: bool = False
    d_mult: tuple[float, ...] = D_MULT
    ls_steps: int = LS_STEPS

    @property
    def shift_slots(self) -> int:
        """Shifts stored per super-block: one per group, or one per sub-block."""
        return 32 if self.shift_per_group else self.sub_blocks

    @property
    def shifted(self) -> bool:
        """Whether a shift moves the levels (IQ1), so a point's B and N differ between shifts."""
        return any(d != 0.0 for d in self.deltas)

    @property
    def sub_blocks(self) -> int:
        return 32 // self.group_count


@dataclass(frozen=True)
class Codes:
    """A search's result per super-block: ``d`` uint16 [n] (fp16 bits), ``index`` int64 [n, 32]
    (grid index per group), ``signs`` int64 [n, 32] (bit j set: element j negative; the
    inputs' own for a signed grid), ``scales`` and ``delta`` int64 [n, 32 / G] (per sub-block its
    scale and its shift's index into ``Grid.deltas``; with ``Grid.shift_per_group``, ``delta`` is
    [n, 32], per group).  Zero blocks are all zeros."""

    d: np.ndarray
    index: np.ndarray
    signs: np.ndarray
    scales: np.ndarray
    delta: np.ndarray


def search_tables(grid: np.ndarray, g: Grid) -> types.SimpleNamespace:
    """``grid`` (integer [P, 8] of ``g.levels``) in class order (``_ggml_encode.grid_classes``:
    ``gt`` float32 [8, P] the points, ``lev`` [3] the levels) with ``gsq`` and ``lsq`` their
    squares; the callers cache it.  The points are scored unshifted; the shifts enter only
    through the chosen points' sums."""
    t = grid_classes(grid, g.levels, by_sum=g.signed)
    t.gsq = t.gt * t.gt
    t.lsq = t.lev * t.lev
    return freeze(t)


def _codes(n: int, g: Grid) -> Codes:
    return Codes(np.zeros(n, np.uint16), np.zeros((n, 32), np.int64), np.zeros((n, 32), np.int64),
                 np.zeros((n, g.sub_blocks), np.int64), np.zeros((n, g.shift_slots), np.int64))


# --------------------------------------------------------------- reference
def search_reference(x, g: Grid, t, *, imatrix=None, name: str | None = None) -> tuple[Codes, tuple[int, ...]]:
    """Numpy twin of ``search`` (same decisions, same float operations; slow)."""
    blocks, qw, shape = block_inputs(x, imatrix, g.label, name=name)
    codes = _codes(len(blocks), g)
    for i, b in enumerate(blocks):
        _ref_block(b, qw[i % len(qw)], g, t, codes, i)
    return codes, shape


def _seq(v) -> float:
    """Sum from +0.0, left to right (the kernel's order)."""
    acc = 0.0
    for e in v:
        acc += e
    return acc


def _ref_block(x: np.ndarray, q: np.ndarray, grid: Grid, t, codes: Codes, row: int) -> None:
    f0 = np.float32(0.0)
    gc, ns, nv = grid.group_count, grid.sub_blocks, len(grid.deltas)
    unit, inv_unit = grid.step_unit, 1.0 / grid.step_unit
    neg = (x.view(np.uint32) >> 31).astype(np.int64)
    amax = np.abs(x).max()
    if amax < TINY:
        return
    ex = math.frexp(float(amax))[1]
    x = x * np.float32(math.ldexp(1.0, -ex))
    a = x if grid.signed else np.abs(x)          # what the points' levels multiply
    unscale = math.ldexp(1.0, ex)
    # weights (float32): sigma^2 = sum x^2 / 256, group sums first, then the 32 groups in order
    sigma2 = _seq32(_rowsum32((x * x).reshape(32, 8))) / np.float32(QK)
    w = (q * np.sqrt(sigma2 + x * x)).astype(np.float32).reshape(32, 8)
    p = (w * a.reshape(32, 8)).astype(np.float32)                    # [32, 8]
    ncls = len(t.cls_norm)

    odd = (neg.reshape(32, 8).sum(axis=1) & 1).astype(bool) & grid.parity
    odd2 = np.where(odd, np.float32(2.0), f0).astype(np.float32)
    bounds = t.cls_start
    gwa = _rowsum32(p * a.reshape(32, 8)).reshape(ns, gc)           # sum w a^2 per group
    gw = _rowsum32(w).reshape(ns, gc)
    s1, s2 = _rowsum32(gwa), _rowsum32(gw)                          # per sub-block, groups in order
    rms = np.where(s2 > f0, np.sqrt(s1 / np.where(s2 > f0, s2, np.float32(1.0))), f0).astype(np.float32)
    htau = np.repeat(np.float32(0.5 * grid.tau) * rms, gc).astype(np.float32)

    # 1. per group and class the point of best score B - htau N at the unshifted levels (htau = t / 2
    #    at the group's expected step; with the parity rule less the forced flip's cost), then its
    #    B and N at each shift from its sums there: B = score + htau N, and with a shift delta
    #    B + delta sum w a, N + 2 delta sum w g + delta^2 sum w (float32, in this order)
    prod = p[:, :, None] * t.gt[None, :, :]                         # [32, 8, P]: w a g
    pen = odd2[:, None] * prod.min(axis=1)                           # the forced flip's cost
    ps = prod - (htau[:, None] * w)[:, :, None] * t.gsq[None, :, :]
    score = (_half(ps, 0) + _half(ps, 4)) - pen
    arg = np.stack([bounds[c] + np.argmax(score[:, bounds[c]:bounds[c + 1]], axis=1)
                    for c in range(ncls)], axis=1)                   # [32, C], first maximum

    def at_arg(v):                  # [32, C] float32: the chosen points' sums of v [32, 8, P]
        return np.take_along_axis(_half(v, 0) + _half(v, 4), arg, axis=1)

    n0 = at_arg(w[:, :, None] * t.gsq[None, :, :])
    b0 = np.take_along_axis(score, arg, axis=1) + htau[:, None] * n0
    bd, nn = [b0.astype(np.float64)], [n0.astype(np.float64)]
    if grid.shifted:
        w1 = at_arg(w[:, :, None] * t.gt[None, :, :])
        sat, sw = _rowsum32(p)[:, None], _rowsum32(w)[:, None]
        dl = np.asarray(grid.deltas, np.float32)
        bd = [(b0 + dl[v] * sat).astype(np.float64) for v in range(nv)]
        nn = [((n0 + (np.float32(2.0) * dl[v]) * w1) + (dl[v] * dl[v]) * sw).astype(np.float64)
              for v in range(nv)]
    barg = [arg] * nv
    if grid.shift_per_group:        # every group picks (shift, class): the shifts' classes side by side
        barg, bd, nn = ([np.concatenate(a, axis=1)] for a in (barg, bd, nn))
        nv = 1

    def errors(v, k, tt):           # [C]: each class's error (minus sum w a^2) for group k at step tt, float32
        t32 = np.float32(tt)
        return t32 * (t32 * nn[v][k].astype(np.float32) - np.float32(2.0) * bd[v][k].astype(np.float32))

    def best_class(v, k, tt):
        return int(np.argmin(errors(v, k, tt)))

    def sub_error(v, m, tt):
        return _seq(float(errors(v, gc * m + h, tt).min()) for h in range(gc))

    def lsq_t(v, m, cls):
        num = _seq(bd[v][gc * m + h, cls[h]] for h in range(gc))
        den = _seq(nn[v][gc * m + h, cls[h]] for h in range(gc))
        return num / den if den > 0.0 else 0.0

    # 2. the free step per sub-block by alternation, per shift; the shift whose step errs least
    def free_step(v, m):
        cls = []
        for h in range(gc):
            k = gc * m + h
            ok = (nn[v][k] > 0.0) & (bd[v][k] > 0.0)
            gain = np.where(ok, bd[v][k] * bd[v][k] / np.where(ok, nn[v][k], 1.0), 0.0)
            cls.append(int(np.argmax(gain)))
        tt = lsq_t(v, m, cls)
        for _ in range(ALT):
            tt = lsq_t(v, m, [best_class(v, gc * m + h, tt) for h in range(gc)])
        return tt

    tstar = np.zeros(ns)
    for m in range(ns):
        steps = [free_step(v, m) for v in range(nv)]
        vb = 0
        if nv > 1:
            errs = [sub_error(v, m, steps[v]) for v in range(nv)]
            vb = int(np.argmin(errs))
        tstar[m] = steps[vb]

    top = float(grid.scale_max - 1)

    def eval_d(dn):
        u = dn * unit
        total = 0.0
        sel = np.zeros(ns, np.int64)
        vsel = np.zeros(ns, np.int64)
        for m in range(ns):
            sc = min(tstar[m] / u - 0.5, top)
            s0 = int(math.floor(sc)) if sc > 0.0 else 0
            best = np.inf
            for v in range(nv):
                e0 = sub_error(v, m, u * (0.5 + s0))
                e1 = sub_error(v, m, u * (0.5 + (s0 + 1)))
                cand, sv = (e1, s0 + 1) if e1 < e0 else (e0, s0)
                if cand < best:
                    best, sel[m], vsel[m] = cand, sv, v
            total += best
        return total, (sel, vsel)

    # 3. d candidates, then least-squares refinement
    tmax = 0.0
    for v in tstar:
        tmax = v if v > tmax else tmax
    best_total, best_dn, picked = best_d(tmax / (unit * (grid.scale_max + 0.5)), unscale, grid.d_mult, eval_d)
    if best_dn == 0.0:
        return
    for _ in range(grid.ls_steps):
        s_sel, v_sel = picked
        num = 0.0
        den = 0.0
        for m in range(ns):
            h = 0.5 + s_sel[m]
            tt = best_dn * unit * h
            v = v_sel[m]
            cls = [best_class(v, gc * m + j, tt) for j in range(gc)]
            num += h * _seq(bd[v][gc * m + j, cls[j]] for j in range(gc))
            den += h * h * _seq(nn[v][gc * m + j, cls[j]] for j in range(gc))
        if not den > 0.0:
            break
        dn = round_f16(inv_unit * num / den * unscale) / unscale
        if not dn > 0.0 or dn == best_dn:
            break
        tot, sc = eval_d(dn)
        if not tot < best_total:
            break
        best_total, best_dn, picked = tot, dn, sc

    # 4. codes; d's bits via numpy's own fp16 conversion (an independent check of round_f16 / f16_bits)
    s_sel, v_sel = picked
    codes.d[row] = np.array([best_dn * unscale], np.float64).astype("<f2").view(np.uint16)[0]
    codes.scales[row] = s_sel
    if not grid.shift_per_group:
        codes.delta[row] = v_sel
    for m in range(ns):
        tt = best_dn * unit * (0.5 + s_sel[m])
        v = v_sel[m]
        for h in range(gc):
            k = gc * m + h
            c = best_class(v, k, tt)
            i = int(barg[v][k, c])
            pv = v
            if grid.shift_per_group:
                pv = c // ncls
                codes.delta[row, k] = pv
            bits = neg[8 * k:8 * k + 8].copy()
            if odd[k]:
                bits[int(np.argmin(prod[k, :, i]))] ^= 1
            codes.signs[row, k] = int((bits << np.arange(8)).sum())
            codes.index[row, k] = int(t.order[i])


def _half(prod: np.ndarray, j: int) -> np.ndarray:
    """((v_j + v_j+1) + v_j+2) + v_j+3 over axis 1 of ``prod`` [32, 8, P] (the kernel's order)."""
    return ((prod[:, j] + prod[:, j + 1]) + prod[:, j + 2]) + prod[:, j + 3]


def _rowsum32(v: np.ndarray) -> np.ndarray:
    """float32 row sums from +0.0, left to right."""
    acc = np.zeros(v.shape[0], np.float32)
    for j in range(v.shape[1]):
        acc = acc + v[:, j]
    return acc


def _seq32(v: np.ndarray) -> np.float32:
    """float32 sum of all of ``v`` (rows first, ``_rowsum32``, then the row sums in order)."""
    rows = _rowsum32(v) if v.ndim == 2 else v
    acc = np.float32(0.0)
    for e in rows:
        acc = np.float32(acc + e)
    return acc


# ------------------------------------------------------------ numba kernel
# Lanes: the 32 * SB_CHUNK groups of a chunk; group h of sub-block m (m = S' b + ib for
# sub-block ib of super-block b, S' = 32 / G sub-blocks a super-block) is lane h * S + m,
# S = S' * SB_CHUNK, so a sub-block's G groups are lanes m, S + m, ... and the class maxima
# run over all lanes.
@_jit
def _lane_min(bd, nn, tl, emin, cmin):
    """Every lane k's least class error t (t N - 2 B) at its own step ``tl[k]`` and its first class:
    ``emin[k]`` and ``cmin[k]`` (``bd`` / ``nn`` [C, L]: class-major, so the lanes vectorise)."""
    nl = tl.shape[0]
    for k in range(nl):
        emin[k] = np.inf
        cmin[k] = 0
    for c in range(bd.shape[0]):
        for k in range(nl):
            tt = tl[k]
            v = tt * (tt * nn[c, k] - np.float32(2.0) * bd[c, k])
            take = v < emin[k]
            emin[k] = v if take else emin[k]
            cmin[k] = c if take else cmin[k]


@_jit
def _spread(per_sub, tl):
    """``tl[k] = per_sub[k % S]`` (S = ``per_sub``'s length): lane k = h S + m is group h of
    sub-block lane m; written as whole rows, without a division per lane."""
    ns = per_sub.shape[0]
    for k0 in range(0, tl.shape[0], ns):
        for m in range(ns):
            tl[k0 + m] = per_sub[m]


@_jit
def _chosen_classes(bd, nn, best_dn, s_sel, unit, nsub, tm, tl, emin, cmin):
    """Per shift v, every lane's least class error and its first class (``emin[v]``, ``cmin[v]``)
    at its sub-block's chosen step ``best_dn * unit * (0.5 + s_sel)`` (1.0 where the super-block
    has no ``d``: its lanes are not read); ``tm`` [S] scratch for the sub-blocks' steps."""
    for b in range(best_dn.shape[0]):
        dn = best_dn[b]
        for m in range(nsub * b, nsub * b + nsub):
            tm[m] = dn * unit * (0.5 + s_sel[m]) if dn != 0.0 else 1.0
    _spread(tm, tl)
    for v in range(bd.shape[0]):
        _lane_min(bd[v], nn[v], tl, emin[v], cmin[v])


@_jit
def _class_scores(at, wl, htau, hpf, parity, lev, lsq, ou, ow, cls_start, prods, prodm, p2, m2, p3, m3, hh, acc):
    """``acc[c, k]``: the best score B - htau N over class c's points for lane k, ``acc[c, L + k]``
    the first point reaching it (as float32: exact).  ``requant.iq2xs._class_maxima``'s pass
    (``_ggml_encode.half_sums``, ``class_argmax``), with the sums taken over ``w a g - (htau w) g^2`` and the
    flip's minimum over ``w a g`` (``at`` = w a, ``wl`` = w, ``lsq`` = the levels squared)."""
    nl = at.shape[1]
    for j in range(8):
        for v in range(3):
            for k in range(nl):
                pm = at[j, k] * lev[v]
                prodm[j, v, k] = pm
                prods[j, v, k] = pm - (htau[k] * wl[j, k]) * lsq[v]
    if parity:                                                       # scores may be negative
        half_sums(prods, prodm, hpf, p2, m2, p3, m3, hh)
        class_argmax(hh, ou, ow, cls_start, np.float32(-np.inf), acc)
    else:                                                            # no flip: no minima to build
        pattern_sums(prods, p2, p3, hh.reshape((2, 81, 2, nl)), 0)
        class_argmax_plain(hh, ou, ow, cls_start, np.float32(-np.inf), acc)


@_jit
def _class_values(acc, at, wl, sw, htau, lev, lsq, dl, shifted, ou, ow, wq, p2, p3, sat, w1, hv, bd, nn):
    """For each class's chosen point (``acc[c, L + k]``, scored at the unshifted levels ``lev``):
    its B and N at each shift v (``dl[v]``) into ``bd[v]`` / ``nn[v]`` [C, L], float32, as the
    reference writes them: N = sum w g^2 (each half's sum, then the two added), B = score + htau N
    (the score less the forced flip's cost, so B is too); with ``shifted`` levels, B + delta sum w a
    and (N + 2 delta sum w g) + delta^2 sum w (``sw``).  The halves' sums of all 81 patterns come
    first (``_ggml_encode.pattern_sums`` into ``hv``: [2, 81, 2, L], N's then sum w g's), so a
    point costs two loads a sum."""
    nl = at.shape[1]
    h4 = hv.reshape((2, 81, 2, nl))
    for j in range(8):
        for u in range(3):
            for k in range(nl):
                wq[j, u, k] = wl[j, k] * lsq[u]
    pattern_sums(wq, p2, p3, h4, 0)
    if shifted:
        for j in range(8):
            for u in range(3):
                for k in range(nl):
                    wq[j, u, k] = wl[j, k] * lev[u]
        pattern_sums(wq, p2, p3, h4, 1)
        for k in range(nl):
            sat[k] = np.float32(0.0)
        for j in range(8):
            for k in range(nl):
                sat[k] += at[j, k]
    unl = np.uint64(nl)
    for c in range(bd.shape[1]):                 # the gathers: unshifted sums
        for k in range(nl):
            i = np.int64(acc[c, nl + k])
            uk = np.uint64(k)
            o1 = ou[i]
            o2 = ow[i]
            n0 = hv[o1 + uk] + hv[o2 + uk]
            nn[0, c, k] = n0
            bd[0, c, k] = acc[c, k] + htau[k] * n0
            if shifted:
                w1[c, k] = hv[o1 + unl + uk] + hv[o2 + unl + uk]
    if shifted:                                  # the shifts, over the lanes (the last shift first:
        for v in range(dl.shape[0] - 1, -1, -1):     # shift 0 overwrites the unshifted sums)
            d = dl[v]
            d2 = np.float32(2.0) * d
            dd = d * d
            for c in range(bd.shape[1]):
                for k in range(nl):
                    bd[v, c, k] = bd[0, c, k] + d * sat[k]
                    nn[v, c, k] = (nn[0, c, k] + d2 * w1[c, k]) + dd * sw[k]


@_jit
def _free_steps(bd, nn, gc, ns, tstar, tl, gain, emin, cmin):
    """Per sub-block lane m the free step by alternation (as the reference's ``free_step``): each
    group's class of largest gain B^2 / N, the least-squares step of those classes, then ``ALT``
    rounds of the best classes at that step and their least-squares step.  The class searches run
    over all lanes at once (``tl``, ``gain`` float64, ``emin``, ``cmin``: scratch [L])."""
    nl = tl.shape[0]
    for k in range(nl):
        gain[k] = -1.0
        cmin[k] = 0
    for c in range(bd.shape[0]):
        for k in range(nl):
            b = np.float64(bd[c, k])
            n = np.float64(nn[c, k])
            gv = b * b / n if n > 0.0 and b > 0.0 else 0.0
            take = gv > gain[k]
            gain[k] = gv if take else gain[k]
            cmin[k] = c if take else cmin[k]
    for r in range(ALT + 1):
        for m in range(ns):
            num = 0.0
            den = 0.0
            for h in range(gc):
                k = h * ns + m
                num += bd[cmin[k], k]
                den += nn[cmin[k], k]
            tstar[m] = num / den if den > 0.0 else 0.0
        if r < ALT:
            _spread(tstar, tl)
            _lane_min(bd, nn, tl, emin, cmin)


@_jit
def _sub_errs(emin, out):
    """Per sub-block lane m, ``out[m]`` (float64) = the sum of its groups' least class errors
    ``emin[h S + m]`` [L], groups in order (S = ``out``'s length); the sub-blocks run as lanes."""
    ns = out.shape[0]
    for m in range(ns):
        out[m] = 0.0
    for k0 in range(0, emin.shape[0], ns):
        for m in range(ns):
            out[m] += emin[k0 + m]


@_jit
def _search_kernel(xb, sbits, qb, gc, parity, signed, group_shift, half_tau, unit, smax, gt, order, lev, lsq,
                   dl, shifted, lo, hi, cls_start, norm, d_mult, ls_steps, out_d, out_idx, out_sg, out_sc, out_dv):
    # xb [n, 256] float32 super-blocks, sbits their bits (for the sign of zeros), qb [nq, 256]
    # importance (block i uses row i % nq); gt [8, P] and lev / lsq [3] unshifted; dl [V] the
    # shifts (``shifted``: they move the levels);
    # codes out (zero-filled, as ``Codes``).  ``group_shift``: each group picks (shift, class), so
    # the later steps see one "shift" whose classes are the shifts' classes side by side.
    nblk = xb.shape[0]
    nq = qb.shape[0]
    nv = dl.shape[0]
    nsb = SB_CHUNK
    nsub = 32 // gc
    nl = 32 * nsb
    ns = nsub * nsb
    ncls = norm.shape[0]
    f0 = np.float32(0.0)
    inv_unit = 1.0 / unit
    npts = lo.shape[0]
    ou = np.empty(npts, np.uint64)
    ow = np.empty(npts, np.uint64)
    half_offsets(lo, hi, nl, ou, ow)
    xs = np.zeros((nsb, 256), np.float32)
    ws = np.zeros((nsb, 256), np.float32)
    at = np.empty((8, nl), np.float32)
    hpf = np.empty(nl, np.float32)
    sgn = np.zeros(nl, np.int64)
    wl = np.zeros((8, nl), np.float32)
    live = np.zeros(nsb, np.bool_)
    unscale = np.ones(nsb)
    prod = np.empty((8, 3, nl), np.float32)
    prods = np.empty((8, 3, nl), np.float32)
    htau = np.zeros(nl, np.float32)
    gwa = np.zeros(nl, np.float32)
    gws = np.zeros(nl, np.float32)
    p2 = np.empty((9, nl), np.float32)
    m2 = np.empty((9, nl), np.float32)
    p3 = np.empty((27, nl), np.float32)
    m3 = np.empty((27, nl), np.float32)
    hh = np.empty(162 * 2 * nl, np.float32)
    halves = np.empty(162 * 2 * nl, np.float32)    # the half patterns' N and sum w g
    wq = np.empty((8, 3, nl), np.float32)
    acc = np.empty((ncls, 2 * nl), np.float32)
    sat = np.empty(nl, np.float32)                # what the shifts add: per lane sum w a,
    w1 = np.empty((ncls, nl), np.float32)         # per class and lane sum w g
    bd = np.empty((nv, ncls, nl), np.float32)     # class-major: the class searches run over the lanes
    nn = np.empty((nv, ncls, nl), np.float32)
    nvs = 1 if group_shift else nv        # shift choices per sub-block
    ncs = nv * ncls if group_shift else ncls
    # with a shift per group, the shifts' classes side by side
    bdg = np.empty((nvs if group_shift else 0, ncs, nl), np.float32)
    nng = np.empty((nvs if group_shift else 0, ncs, nl), np.float32)
    tsv = np.zeros((nvs, ns))
    tl = np.empty(nl, np.float32)         # each lane's step, float32 as its class errors
    gain = np.empty(nl)
    cmin = np.empty(nl, np.int32)
    em = np.empty((nvs, nl), np.float32)
    em1 = np.empty((nvs, nl), np.float32)
    cmv = np.empty((nvs, nl), np.int32)
    s_lo = np.empty(ns, np.int64)
    sub0 = np.empty((nvs, ns))             # per shift, the sub-blocks' errors (sums of their groups')
    sub1 = np.empty((nvs, ns))
    t0m = np.empty(ns)
    t1m = np.empty(ns)
    d0b = np.zeros(nsb)
    dnb = np.zeros(nsb)
    totals = np.zeros(nsb)
    lsact = np.zeros(nsb, np.bool_)
    tstar = np.zeros(ns)
    s_try = np.zeros(ns, np.int64)
    v_try = np.zeros(ns, np.int64)
    s_sel = np.zeros(ns, np.int64)
    v_sel = np.zeros(ns, np.int64)
    best_total = np.zeros(nsb)
    best_dn = np.zeros(nsb)
    for b0 in range(0, nblk, nsb):
        # 0. scaled values (magnitudes for an unsigned grid), weights, signs and parity as lanes;
        #    padding / tiny blocks are zero lanes
        for b in range(nsb):
            blk = b0 + b
            amax = np.float32(0.0)
            if blk < nblk:
                for j in range(256):
                    v = abs(xb[blk, j])
                    amax = v if v > amax else amax
            live[b] = amax >= TINY
            f = np.float32(0.0)
            unscale[b] = 1.0
            if live[b]:
                _, ex = math.frexp(amax)
                f = np.float32(math.ldexp(1.0, -ex))
                unscale[b] = math.ldexp(1.0, ex)
            qr = blk % nq if blk < nblk else 0
            s2 = f0
            for g in range(32):
                gx = f0
                for j in range(8):
                    v = xb[blk, 8 * g + j] * f if live[b] else f0
                    xs[b, 8 * g + j] = v
                    ws[b, 8 * g + j] = qb[qr, 8 * g + j]
                    gx += v * v
                s2 += gx
            sigma2 = s2 / np.float32(QK)
            for ib in range(nsub):
                for h in range(gc):
                    g = gc * ib + h
                    k = h * ns + nsub * b + ib
                    bits = 0
                    par = 0
                    swa = f0
                    sw = f0
                    for j in range(8):
                        v = xs[b, 8 * g + j]
                        av = v if signed else abs(v)
                        wv = ws[b, 8 * g + j] * np.sqrt(sigma2 + v * v)
                        wl[j, k] = wv
                        pv = wv * av
                        at[j, k] = pv
                        swa += pv * av
                        sw += wv
                        ng = np.int64(sbits[blk, 8 * g + j] >> 31) if live[b] else np.int64(0)
                        bits |= ng << j
                        par += ng
                    sgn[k] = bits
                    hpf[k] = 2.0 if parity and par & 1 else 0.0
                    gwa[k] = swa
                    gws[k] = sw
        # 1. class points scored at each sub-block's expected step, per shift; 2. free steps by
        #    alternation, per shift, and the shift whose step errs least
        for m in range(ns):
            s1 = f0
            s2 = f0
            for h in range(gc):
                s1 += gwa[h * ns + m]
                s2 += gws[h * ns + m]
            rms = np.sqrt(s1 / (s2 if s2 > f0 else np.float32(1.0))) if s2 > f0 else f0
            for h in range(gc):
                htau[h * ns + m] = half_tau * rms
        _class_scores(at, wl, htau, hpf, parity, lev, lsq, ou, ow, cls_start, prods, prod, p2, m2, p3, m3, hh, acc)
        _class_values(acc, at, wl, gws, htau, lev, lsq, dl, shifted, ou, ow, wq, p2, p3, sat, w1, halves, bd, nn)
        if group_shift:
            for v in range(nv):
                for c in range(ncls):
                    for k in range(nl):
                        bdg[0, v * ncls + c, k] = bd[v, c, k]
                        nng[0, v * ncls + c, k] = nn[v, c, k]
        bdc = bdg if group_shift else bd      # what steps 2-4 choose from: [nvs, classes, lanes]
        nnc = nng if group_shift else nn
        for v in range(nvs):
            _free_steps(bdc[v], nnc[v], gc, ns, tsv[v], tl, gain, em[v], cmin)
        if nvs > 1:
            for v in range(nvs):
                _spread(tsv[v], tl)
                _lane_min(bdc[v], nnc[v], tl, em[v], cmin)
                _sub_errs(em[v], sub0[v])
        for m in range(ns):
            vb = 0
            if nvs > 1:
                be = np.inf
                for v in range(nvs):
                    e = sub0[v, m]
                    if e < be:
                        be = e
                        vb = v
            tstar[m] = tsv[vb, m]
        # 3. d candidates per super-block (the q-th of every super-block at once), then
        #    least-squares refinement
        for b in range(nsb):
            tmax = 0.0
            for m in range(nsub * b, nsub * b + nsub):
                tmax = tstar[m] if tstar[m] > tmax else tmax
            d0b[b] = tmax / (unit * (smax + 0.5))
            best_total[b] = np.inf
            best_dn[b] = 0.0
        for q in range(d_mult.shape[0]):
            some = False
            for b in range(nsb):
                dnb[b] = _round_f16_nb(d0b[b] * d_mult[q] * unscale[b]) / unscale[b] if live[b] else 0.0
                some = some or dnb[b] != 0.0
            if not some:
                continue
            _eval_blocks(dnb, tstar, bdc, nnc, gc, unit, smax, tl, em, em1, cmin, sub0, sub1, s_lo, t0m, t1m,
                         s_try, v_try, totals)
            for b in range(nsb):
                if dnb[b] != 0.0 and totals[b] < best_total[b]:
                    best_total[b] = totals[b]
                    best_dn[b] = dnb[b]
                    for m in range(nsub * b, nsub * b + nsub):
                        s_sel[m] = s_try[m]
                        v_sel[m] = v_try[m]
        for b in range(nsb):
            lsact[b] = best_dn[b] != 0.0
        for _ in range(ls_steps):
            _chosen_classes(bdc, nnc, best_dn, s_sel, unit, nsub, t0m, tl, em, cmv)
            some = False
            for b in range(nsb):
                dnb[b] = 0.0
                if not lsact[b]:
                    continue
                num = 0.0
                den = 0.0
                for m in range(nsub * b, nsub * b + nsub):
                    hv = 0.5 + s_sel[m]
                    vm = v_sel[m]
                    sb = 0.0
                    sn = 0.0
                    for h in range(gc):
                        k = h * ns + m
                        bc = cmv[vm, k]
                        sb += bdc[vm, bc, k]
                        sn += nnc[vm, bc, k]
                    num += hv * sb
                    den += hv * hv * sn
                dn = _round_f16_nb(inv_unit * num / den * unscale[b]) / unscale[b] if den > 0.0 else 0.0
                if not dn > 0.0 or dn == best_dn[b]:
                    lsact[b] = False
                    continue
                dnb[b] = dn
                some = True
            if not some:
                break
            _eval_blocks(dnb, tstar, bdc, nnc, gc, unit, smax, tl, em, em1, cmin, sub0, sub1, s_lo, t0m, t1m,
                         s_try, v_try, totals)
            for b in range(nsb):
                if dnb[b] == 0.0:
                    continue
                if not totals[b] < best_total[b]:
                    lsact[b] = False
                    continue
                best_total[b] = totals[b]
                best_dn[b] = dnb[b]
                for m in range(nsub * b, nsub * b + nsub):
                    s_sel[m] = s_try[m]
                    v_sel[m] = v_try[m]
        # 4. codes: each group's class at its sub-block's chosen step and shift
        _chosen_classes(bdc, nnc, best_dn, s_sel, unit, nsub, t0m, tl, em, cmv)
        for b in range(nsb):
            blk = b0 + b
            if blk >= nblk or best_dn[b] == 0.0:
                continue
            out_d[blk] = _f16_bits_nb(best_dn[b] * unscale[b])
            for ib in range(nsub):
                m = nsub * b + ib
                vm = v_sel[m]
                out_sc[blk, ib] = s_sel[m]
                if not group_shift:
                    out_dv[blk, ib] = vm
                for h in range(gc):
                    k = h * ns + m
                    bc = cmv[vm, k]
                    pvi = vm
                    if group_shift:
                        pvi = bc // ncls
                        bc = bc % ncls
                        out_dv[blk, gc * ib + h] = pvi
                    i = np.int64(acc[bc, nl + k])            # the class's first point reaching its maximum
                    sg = sgn[k]
                    if hpf[k] != 0.0:                        # odd: flip the cheapest element
                        jm = 0
                        pm = at[0, k] * gt[0, i]
                        for j in range(1, 8):
                            pv = at[j, k] * gt[j, i]
                            if pv < pm:
                                pm = pv
                                jm = j
                        sg ^= 1 << jm
                    out_idx[blk, gc * ib + h] = order[i]
                    out_sg[blk, gc * ib + h] = sg


@_jit
def _eval_blocks(dnb, tstar, bd, nn, gc, unit, smax, tl, e0, e1, cmin, sub0, sub1, s_lo, t0m, t1m, s_out, v_out,
                 totals):
    """Total error of every super-block b of the chunk with ``dnb[b]`` != 0 at normalised d
    ``dnb[b]`` -> ``totals[b]``; per sub-block the better of the two scales around its t*, at its
    best shift -> ``s_out`` / ``v_out``.  The class minima of both steps run over all lanes at once,
    their sums per sub-block (``sub0`` / ``sub1`` [V, S]) over all sub-blocks."""
    nsub = 32 // gc
    top = smax - 1.0
    for b in range(dnb.shape[0]):
        dn = dnb[b]
        u = (dn if dn != 0.0 else 1.0) * unit
        for m in range(nsub * b, nsub * b + nsub):
            sc = min(tstar[m] / u - 0.5, top)
            s0 = int(math.floor(sc)) if sc > 0.0 else 0
            s_lo[m] = s0
            t0m[m] = u * (0.5 + s0)
            t1m[m] = u * (0.5 + (s0 + 1))
    _spread(t0m, tl)
    for v in range(bd.shape[0]):
        _lane_min(bd[v], nn[v], tl, e0[v], cmin)
        _sub_errs(e0[v], sub0[v])
    _spread(t1m, tl)
    for v in range(bd.shape[0]):
        _lane_min(bd[v], nn[v], tl, e1[v], cmin)
        _sub_errs(e1[v], sub1[v])
    for b in range(dnb.shape[0]):
        if dnb[b] == 0.0:
            continue
        total = 0.0
        for m in range(nsub * b, nsub * b + nsub):
            best = np.inf
            for v in range(bd.shape[0]):
                a0 = sub0[v, m]
                a1 = sub1[v, m]
                cand = a1 if a1 < a0 else a0
                if cand < best:
                    best = cand
                    s_out[m] = s_lo[m] + 1 if a1 < a0 else s_lo[m]
                    v_out[m] = v
            total += best
        totals[b] = total


def search(x, g: Grid, t, *, imatrix=None, name: str | None = None) -> tuple[Codes, tuple[int, ...]]:
    """float32 ``[..., K]`` (K a multiple of 256, finite) -> the codes of its super-blocks and
    ``x``'s shape (numba, one thread); ``t`` is ``search_tables(grid, g)``.

    ``imatrix``: importance per column, float ``[K]`` (None: all ones; ``_ggml_encode.check_imatrix``)."""
    xb, qw, shape = block_inputs(x, imatrix, g.label, name=name)
    c = _codes(len(xb), g)
    _search_kernel(xb, xb.view(np.uint32), qw, g.group_count, g.parity, g.signed, g.shift_per_group,
                   np.float32(0.5 * g.tau), g.step_unit, float(g.scale_max), t.gt, t.order, t.lev, t.lsq,
                   np.asarray(g.deltas, np.float32), g.shifted, t.lo, t.hi, t.cls_start, t.cls_norm,
                   np.asarray(g.d_mult, np.float64), g.ls_steps, c.d, c.index, c.signs, c.scales, c.delta)
    return c, shape
