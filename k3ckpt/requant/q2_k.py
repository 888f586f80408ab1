"""float32 -> llama.cpp Q2_K (2.625 bpw): weighted least squares per sub-block, numba.

The stored format (decoder, byte layout) is ``k3ckpt.formats.q2_k``.  A
super-block of 256 weights is 16 sub-blocks of 16; sub-block j decodes as
``a_j * q - b_j`` with ``q`` in 0..3, ``a_j = d * sc_j``, ``b_j = dmin * mc_j``,
``sc_j, mc_j`` 4-bit and ``d, dmin`` one fp16 each.

The error minimised is ``sum w_i (value_i - x_i)^2`` with, as llama.cpp's
``quantize_row_q2_K_impl`` weighs it, ``w_i = imatrix_i * sqrt(sigma^2 + x_i^2)``
(``sigma^2`` the super-block's mean square; an all-ones importance matrix when
none is given).  How hard each step searches is an ``Effort``: ``WEIGHTED``
with an importance matrix, ``PLAIN`` (a third of the time) without one.  Per
super-block (inputs scaled by a power of two first, exact, so every product
stays in float32 range):

1. Per sub-block, a free affine fit ``a q + o`` (``o = -b <= 0``: the lowest
   level is at most 0, as ggml's positive ``dmin`` allows): codes from the
   trial steps ``(3 + r) / (max - min(min, 0))`` on the range (``r`` in
   ``r_cand``), each followed by the weighted least-squares ``(a, o)`` for its
   codes (clamped to ``o <= 0``) and ``lloyd`` rounds of re-coding at the fit
   and refitting; then ``final_lloyd`` rounds on the best.  The best fit's sums
   (``sum w``, ``w x``, ``w x^2``, ``w q``, ``w q^2``, ``w q x``) give every
   later error in closed form.
2. Per super-block, fp16 ``d`` / ``dmin`` candidates ``max a / 15 * d_mult``
   by ``max b / 15 * M_MULT``; for each pair, each sub-block takes the best
   integer ``(sc, mc)`` (``sc`` one of the three around ``a / d``, ``mc`` the
   two around the best real min for that ``sc``) by the closed-form error at
   its codes; the pair with the least total wins.
3. Codes: nearest level at the chosen ``(sc, mc)`` (exact error pass); then up
   to ``ls_steps`` times the least-squares ``(d, dmin)`` for those codes and
   nibbles, rounded to fp16, re-chosen nibbles, re-coded, kept only when the
   exact error drops.

All of it in float32 in one written order (the 2x2 solve of step 3 in
float64), so ``encode`` (numba) and ``encode_reference`` (numpy) return
identical bytes; tests hold them to it.

Super-blocks with ``max|x| < 2^-24`` (below fp16's reach) and all-zero ones
encode as zeros; ``d`` and ``dmin`` are clamped to fp16's largest finite value.
A super-block whose importance values are all zero is weighed as all ones (``_ggml_encode.block_inputs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._ggml_encode import QK, TINY, _f16_bits_nb, _jit, _round_f16_nb, as_rows, block_inputs, check_imatrix, round_f16

__all__ = ["M_MULT", "PLAIN", "WEIGHTED", "Effort", "check_imatrix", "effort_for", "encode",
           "encode_reference"]

BLOCK_BYTES = 16 + 64 + 2 + 2


@dataclass(frozen=True)
class Effort:
    """How hard the search tries.  ``r_cand``: step 1's trial steps ``(3 + r) / range``;
    ``lloyd``: Lloyd rounds after each trial; ``final_lloyd``: after the best trial;
    ``d_mult``: step 2's ``d`` candidates, relative to ``max a / 15``; ``ls_steps``: step 3's
    least-squares refinements at most."""

    r_cand: tuple[float, ...]
    lloyd: int
    final_lloyd: int
    d_mult: tuple[float, ...]
    ls_steps: int


# With an importance matrix the starts matter (3 or 4 of the 5 lost 0.02-0.11 dB of SNR, where the
# margin over ggml's quantizer is 0.1-0.2 dB), and so does the second d candidate; the Lloyd round
# after the best start and a second refinement each won under 0.01 dB (together 0.012 dB for 13%
# of the time), so there are none and one.  Without a matrix ggml runs a simpler rule than with
# one and our full search is 1.0-1.2 dB above it; two starts without Lloyd rounds, one d and no
# refinement keep 0.9-1.05 dB of that (0.16 dB less than the full search) in a third of the time,
# the Lloyd round after the best start mattering more there.  A third d candidate (0.86) moved no
# SNR of tools/bench_llamacpp_quants.py by more than 0.001 dB and cost 6-10% of the time.  A single
# d = 0.93 max a / 15 without refinement would clamp the largest sub-block's scale (sc <= 15).
WEIGHTED = Effort(r_cand=(-0.8, -0.4, 0.0, 0.4, 0.8), lloyd=1, final_lloyd=0, d_mult=(1.0, 0.93), ls_steps=1)
PLAIN = Effort(r_cand=(-0.4, 0.4), lloyd=0, final_lloyd=1, d_mult=(1.0,), ls_steps=0)
M_MULT = np.array([1.0], np.float64)
M_MULT.flags.writeable = False


def effort_for(imatrix) -> Effort:
    """``PLAIN`` without an importance matrix, else ``WEIGHTED`` (all ones included: ggml's Q2_K,
    too, runs its simpler rule only when it is given none)."""
    return PLAIN if imatrix is None else WEIGHTED


F0 = np.float32(0.0)
F2 = np.float32(2.0)
F3 = np.float32(3.0)
F15 = np.float32(15.0)
F1 = np.float32(1.0)


# ------------------------------------------------------------------ checks
def _prepare(x, imatrix, name):
    return block_inputs(x, imatrix, "Q2_K", name=name)


# --------------------------------------------------------------- reference
# The reference works on all super-blocks at once: per sub-block values are [n, 16],
# elements [n, 16, 16] (block, sub-block, element).  Every min / max / clamp is written
# as a comparison and a select (never np.minimum / np.maximum, whose choice between
# -0 and +0 is unspecified), exactly as the kernel writes it.
def encode_reference(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """Numpy twin of ``encode`` (same decisions, same float operations)."""
    xb, qw, shape = _prepare(x, imatrix, name)
    qb = np.broadcast_to(qw[None], (math.prod(shape[:-1]),) + qw.shape).reshape(-1, QK)
    out = _ref_blocks(xb, qb, effort_for(imatrix)) if len(xb) else np.zeros((0, BLOCK_BYTES), np.uint8)
    return as_rows(out, shape)


def _seq(t: np.ndarray) -> np.ndarray:
    """Sum over the last axis from +0.0, left to right (the kernel's order)."""
    acc = np.zeros(t.shape[:-1], t.dtype)
    for i in range(t.shape[-1]):
        acc = acc + t[..., i]
    return acc


def _lt(v, hi):
    return np.where(v < hi, v, hi)


def _gt(v, lo):
    return np.where(v > lo, v, lo)


def _quad(a, o, s):
    """Closed-form sum w (a q + o - x)^2 from the sums ``s`` = (sw, sx, sxx, sl, sl2, sxl), float32."""
    sw, sx, sxx, sl, sl2, sxl = s
    e = a * (a * sl2 - F2 * sxl)
    e = e + o * (o * sw - F2 * sx)
    e = e + ((F2 * a) * o) * sl
    return e + sxx


def _code_sums(w, x, lv):
    wl = w * lv
    return _seq(wl), _seq(wl * lv), _seq(wl * x)


def _ls_fit(sw, sx, sl, sl2, sxl):
    """Weighted least-squares (a, o) for fixed codes; o clamped to <= 0; ok where solvable."""
    det = sw * sl2 - sl * sl
    ok = det > F0
    dd = np.where(ok, det, F1)
    a = (sw * sxl - sx * sl) / dd
    o = (sl2 * sx - sl * sxl) / dd
    pos = o > F0
    a = np.where(pos, sxl / np.where(ok, sl2, F1), a)
    o = np.where(pos, F0, o)
    return a, o, ok


def _recode_ref(x, a, o):
    """Nearest codes 0..3 of ``x`` at levels a q + o (all zero where a <= 0)."""
    az = a > F0
    ia = np.where(az, F1 / np.where(az, a, F1), F0)                 # one reciprocal per sub-block
    v = np.rint((x - o[..., None]) * ia[..., None])
    return np.where(az[..., None], _lt(_gt(v, F0), F3), F0)


def _lloyd_ref(x, w, base, a, o, e, cs, rounds):
    """``rounds`` Lloyd rounds: codes at the current fit, their least-squares fit, kept where it
    is solvable and better."""
    for _ in range(rounds):
        cs2 = _code_sums(w, x, _recode_ref(x, a, o))
        a2, o2, ok2 = _ls_fit(base[0], base[1], *cs2)
        e2 = _quad(a2, o2, base + cs2)
        t = ok2 & (a > F0) & (e2 < e)
        a, o, e = np.where(t, a2, a), np.where(t, o2, o), np.where(t, e2, e)
        cs = tuple(np.where(t, v, b) for v, b in zip(cs2, cs))
    return a, o, e, cs


def _ref_blocks(xb: np.ndarray, qb: np.ndarray, effort: Effort) -> np.ndarray:
    n = xb.shape[0]
    amax = np.abs(xb).max(axis=1)
    live = amax >= TINY
    ex = np.array([math.frexp(float(v))[1] if ok else 0 for v, ok in zip(amax, live)], np.int64)
    f = np.array([math.ldexp(1.0, -int(e)) for e in ex], np.float32)[:, None]
    unscale = np.array([math.ldexp(1.0, int(e)) for e in ex], np.float64)
    x = np.where(live[:, None], xb * f, F0).astype(np.float32).reshape(n, 16, 16)
    q = qb.reshape(n, 16, 16).astype(np.float32)

    # weights: w = q * sqrt(sigma^2 + x^2), sigma^2 = sum x^2 / 256 (per sub-block, then blocks)
    sigma2 = _seq(_seq(x * x)) / np.float32(QK)
    w = q * np.sqrt(sigma2[:, None, None] + x * x)
    base = (_seq(w), _seq(w * x), _seq((w * x) * x))
    sw, sx, _ = base

    # 1. per sub-block: each trial start with its Lloyd rounds, then Lloyd rounds on the best
    xmin, xmax = x[..., 0], x[..., 0]
    for i in range(1, 16):
        xmin, xmax = np.where(x[..., i] < xmin, x[..., i], xmin), np.where(x[..., i] > xmax, x[..., i], xmax)
    lo = np.where(xmin < F0, xmin, F0)
    rng = xmax - lo
    flat = rng > F0
    rr = np.where(flat, rng, F1)
    best_e = np.full(lo.shape, np.inf, np.float32)
    best_a, best_o = best_e, best_e
    best_s = (best_e,) * 3
    for idx, r in enumerate(np.array(effort.r_cand, np.float32)):
        iscale = (F3 + r) / rr
        cs = _code_sums(w, x, _lt(np.rint(iscale[..., None] * (x - lo[..., None])), F3))
        a, o, ok = _ls_fit(sw, sx, *cs)
        ok &= flat
        if idx == 0:   # where no fit is solvable (flat, zero weights): the min-max levels, these codes
            a, o, ok = np.where(ok, a, np.where(flat, rr / F3, F0)), np.where(ok, o, lo), ok | True
        e = np.where(ok, _quad(a, o, base + cs), np.float32(np.inf))
        a, o, e, cs = _lloyd_ref(x, w, base, a, o, e, cs, effort.lloyd)
        t = e < best_e
        best_a, best_o, best_e = np.where(t, a, best_a), np.where(t, o, best_o), np.where(t, e, best_e)
        best_s = tuple(np.where(t, v, b) for v, b in zip(cs, best_s))
    best_a, best_o, best_e, best_s = _lloyd_ref(x, w, base, best_a, best_o, best_e, best_s, effort.final_lloyd)

    # 2. d / dmin candidates: each sub-block's best nibbles by the closed-form error at its codes
    amx = np.zeros(n, np.float32)
    bmx = np.zeros(n, np.float32)
    for j in range(16):
        amx = np.where(best_a[:, j] > amx, best_a[:, j], amx)
        bmx = np.where(-best_o[:, j] > bmx, -best_o[:, j], bmx)
    best_tot = np.full(n, np.inf, np.float32)
    d_sel, m_sel = np.zeros(n, np.float32), np.zeros(n, np.float32)
    sc_sel, mc_sel = np.zeros((n, 16), np.float32), np.zeros((n, 16), np.float32)
    for fd in effort.d_mult:
        dn = np.array([_f16n(float(v) * fd / 15.0, u) for v, u in zip(amx, unscale)], np.float32)
        for fm in M_MULT:
            mn = np.array([_f16n(float(v) * fm / 15.0, u) for v, u in zip(bmx, unscale)], np.float32)
            sc, mc, e = _nibbles_ref(dn, mn, best_a, base + best_s)
            tot = _seq(e)
            t = tot < best_tot
            best_tot = np.where(t, tot, best_tot)
            d_sel, m_sel = np.where(t, dn, d_sel), np.where(t, mn, m_sel)
            sc_sel, mc_sel = np.where(t[:, None], sc, sc_sel), np.where(t[:, None], mc, mc_sel)

    # 3. codes at the chosen nibbles, then least-squares d / dmin refinement
    lv, err, cs = _levels_ref(x, w, d_sel, m_sel, sc_sel, mc_sel)
    act = live.copy()
    for _ in range(effort.ls_steps):
        dn, mn = _ls_dm_ref(sc_sel, mc_sel, base + cs, unscale)
        act &= (dn > F0) & ((dn != d_sel) | (mn != m_sel))
        if not act.any():
            break
        sc, mc, _ = _nibbles_ref(dn, mn, best_a, base + cs)
        lv2, err2, cs2 = _levels_ref(x, w, dn, mn, sc, mc)
        act &= err2 < err
        d_sel, m_sel = np.where(act, dn, d_sel), np.where(act, mn, m_sel)
        sc_sel, mc_sel = np.where(act[:, None], sc, sc_sel), np.where(act[:, None], mc, mc_sel)
        lv, err = np.where(act[:, None, None], lv2, lv), np.where(act, err2, err)
        cs = tuple(np.where(act[:, None], v, b) for v, b in zip(cs2, cs))

    # bytes: d via numpy's own fp16 conversion (an independent check of round_f16 / f16_bits)
    from ..formats.q2_k import code_order

    out = np.zeros((n, BLOCK_BYTES), np.uint8)
    out[:, 80:82] = np.where(live, d_sel * unscale, 0.0).astype("<f2").view(np.uint8).reshape(n, 2)
    out[:, 82:84] = np.where(live, m_sel * unscale, 0.0).astype("<f2").view(np.uint8).reshape(n, 2)
    out[:, 0:16] = np.where(live[:, None], sc_sel.astype(np.uint8) | (mc_sel.astype(np.uint8) << 4), 0)
    codes = np.where(live[:, None], lv.reshape(n, QK), F0).astype(np.uint8)
    byte, shift = code_order()
    for i in range(QK):
        out[:, 16 + byte[i]] |= codes[:, i] << np.uint8(shift[i])
    return out


def _f16n(v: float, unscale: float) -> float:
    """Normalised ``v`` (>= 0) rounded as an fp16 of the real scale ``v * unscale``, normalised back."""
    return round_f16(v * unscale) / unscale


def _nibbles_ref(dn, mn, a_fit, s):
    """Per sub-block the best (sc, mc) for d = ``dn``, dmin = ``mn`` [n] by ``_quad`` at the codes
    whose sums are ``s``: sc one of the three around a / d (nearest first), mc the two around the
    best real min for that sc (lower first); the first of equal errors wins."""
    sw, sx, sxx, sl, sl2, sxl = s
    d, m = dn[:, None], mn[:, None]
    dz = d > F0
    c = np.where(dz, _lt(np.rint(a_fit / np.where(dz, d, F1)), F15), F0)
    isw = np.where(sw > F0, F1 / np.where(sw > F0, sw, F1), F0)
    im = np.where(m > F0, F1 / np.where(m > F0, m, F1), F0)
    best_e = np.full(a_fit.shape, np.inf, np.float32)
    best_sc, best_mc = np.zeros(a_fit.shape, np.float32), np.zeros(a_fit.shape, np.float32)
    for dc in (F0, -F1, F1):
        sc = _lt(_gt(c + dc, F0), F15)
        a = d * sc
        m0 = np.floor(_lt(_gt(((a * sl - sx) * isw) * im, F0), F15))   # the best real min, in dmin steps
        for mc in (m0, _lt(m0 + F1, F15)):
            e = _quad(a, -(m * mc), s)
            t = e < best_e
            best_e, best_sc, best_mc = np.where(t, e, best_e), np.where(t, sc, best_sc), np.where(t, mc, best_mc)
    return best_sc, best_mc, best_e


def _levels_ref(x, w, dn, mn, sc, mc):
    """Nearest codes at levels a q - b, the exact weighted error per block, the codes' sums."""
    a = dn[:, None] * sc
    b = mn[:, None] * mc
    lv = _recode_ref(x, a, -b)
    r = (a[..., None] * lv - b[..., None]) - x
    return lv, _seq(_seq((w * r) * r)), _code_sums(w, x, lv)


def _ls_dm_ref(sc, mc, s, unscale):
    """Least-squares (d, dmin) in float64 for fixed codes and nibbles (dmin clamped >= 0), fp16-rounded."""
    sw, sx, _, sl, sl2, sxl = (v.astype(np.float64) for v in s)
    sc, mc = sc.astype(np.float64), mc.astype(np.float64)
    aa, bb, cc = _seq(sc * sc * sl2), _seq(sc * mc * sl), _seq(mc * mc * sw)
    u, v = _seq(sc * sxl), _seq(mc * sx)
    det = aa * cc - bb * bb
    okd = det > 0.0
    dd = np.where(okd, det, 1.0)
    d = (u * cc - v * bb) / dd
    m = (u * bb - v * aa) / dd
    neg = ~okd | (m < 0.0)
    d = np.where(neg, u / np.where(aa > 0.0, aa, 1.0), d)
    m = np.where(neg, 0.0, m)
    dn = np.array([_f16n(float(a) if a > 0.0 else 0.0, us) for a, us in zip(d, unscale)], np.float32)
    mn = np.array([_f16n(float(a) if a > 0.0 else 0.0, us) for a, us in zip(m, unscale)], np.float32)
    return dn, mn


# ------------------------------------------------------------ numba kernel
# SB_CHUNK super-blocks at a time, their 16 * SB_CHUNK sub-blocks as SIMD lanes (lane
# k = 16 b + j for sub-block j of super-block b; element arrays are [16, lanes]): every
# inner loop runs over the lanes, so numba vectorises it.  Each lane gets exactly the
# reference's decisions; the per-block steps (fp16 rounding, the d candidates) are scalar.
# 16 super-blocks (256 lanes) ran 10-13% faster than 4 (64 lanes): the per-lane steps' loop
# overheads are spread over more lanes; 32 gained no more.
SB_CHUNK = 16


@_jit
def _k_quad(a, o, sw, sx, sxx, sl, sl2, sxl):
    e = a * (a * sl2 - F2 * sxl)
    e = e + o * (o * sw - F2 * sx)
    e = e + ((F2 * a) * o) * sl
    return e + sxx


@_jit
def _k_code_sums(x, w, a, o, acc, ia):
    """``acc[0..2]`` = sum w q, w q^2, w q x at the nearest codes for levels a q + o (q = 0 where
    a <= 0; ``ia`` scratch for 1 / a).  Codes and sums in one pass over the lanes: it vectorises."""
    nl = x.shape[1]
    for k in range(nl):
        acc[0, k] = F0
        acc[1, k] = F0
        acc[2, k] = F0
        ia[k] = F1 / a[k] if a[k] > F0 else F0
    for i in range(16):
        for k in range(nl):
            v = np.rint((x[i, k] - o[k]) * ia[k])
            v = v if v > F0 else F0
            v = v if v < F3 else F3
            wl = w[i, k] * v
            acc[0, k] += wl
            acc[1, k] += wl * v
            acc[2, k] += wl * x[i, k]


@_jit
def _k_trial_sums(x, w, iscale, lo, acc):
    """``_k_code_sums`` for the trial codes min(rint(iscale (x - lo)), 3)."""
    nl = x.shape[1]
    for k in range(nl):
        acc[0, k] = F0
        acc[1, k] = F0
        acc[2, k] = F0
    for i in range(16):
        for k in range(nl):
            v = np.rint(iscale[k] * (x[i, k] - lo[k]))
            v = v if v < F3 else F3
            wl = w[i, k] * v
            acc[0, k] += wl
            acc[1, k] += wl * v
            acc[2, k] += wl * x[i, k]


@_jit
def _k_fit(base, s, a, o, e, ok):
    """Per lane the least-squares (a, o) for codes with sums ``s``, its error, solvable."""
    for k in range(base.shape[1]):
        sw = base[0, k]
        sx = base[1, k]
        sl = s[0, k]
        sl2 = s[1, k]
        sxl = s[2, k]
        det = sw * sl2 - sl * sl
        good = det > F0
        dd = det if good else F1
        ak = (sw * sxl - sx * sl) / dd
        ok_ = (sl2 * sx - sl * sxl) / dd
        pos = ok_ > F0
        ak = sxl / (sl2 if good else F1) if pos else ak
        ok_ = F0 if pos else ok_
        a[k] = ak
        o[k] = ok_
        e[k] = _k_quad(ak, ok_, sw, sx, base[2, k], sl, sl2, sxl)
        ok[k] = good


@_jit
def _k_lloyd(x, w, base, a, o, e, cs, rounds, ns, a2, o2, e2, ok2, ia):
    """``_lloyd_ref`` on the lanes (``ns`` .. ``ia``: scratch)."""
    for _ in range(rounds):
        _k_code_sums(x, w, a, o, ns, ia)
        _k_fit(base, ns, a2, o2, e2, ok2)
        for k in range(a.shape[0]):
            t = ok2[k] and a[k] > F0 and e2[k] < e[k]
            a[k] = a2[k] if t else a[k]
            o[k] = o2[k] if t else o[k]
            e[k] = e2[k] if t else e[k]
            cs[0, k] = ns[0, k] if t else cs[0, k]
            cs[1, k] = ns[1, k] if t else cs[1, k]
            cs[2, k] = ns[2, k] if t else cs[2, k]


@_jit
def _k_nibbles(dl, ml, a_fit, base, s, sc_out, mc_out, e_out, c_t, isw, im):
    """Per lane the best (sc, mc) for its block's d = ``dl``, dmin = ``ml`` (per lane) by the
    closed-form error at the codes with sums ``s`` (as ``_nibbles_ref``; ``c_t``, ``isw``, ``im``:
    scratch); selects, so it vectorises."""
    nl = a_fit.shape[0]
    for k in range(nl):
        e_out[k] = np.float32(np.inf)
        sc_out[k] = F0
        mc_out[k] = F0
        d = dl[k]
        c = np.rint(a_fit[k] / (d if d > F0 else F1))
        c_t[k] = (c if c < F15 else F15) if d > F0 else F0
        sw = base[0, k]
        isw[k] = F1 / (sw if sw > F0 else F1) if sw > F0 else F0
        m = ml[k]
        im[k] = F1 / (m if m > F0 else F1) if m > F0 else F0
    for t in range(3):
        dc = F0 if t == 0 else (-F1 if t == 1 else F1)
        for k in range(nl):
            m = ml[k]
            sw = base[0, k]
            sx = base[1, k]
            sxx = base[2, k]
            sl = s[0, k]
            sl2 = s[1, k]
            sxl = s[2, k]
            sc = c_t[k] + dc
            sc = sc if sc > F0 else F0
            sc = sc if sc < F15 else F15
            a = dl[k] * sc
            u = ((a * sl - sx) * isw[k]) * im[k]
            u = u if u > F0 else F0
            u = u if u < F15 else F15
            m0 = np.floor(u)
            m1 = m0 + F1
            m1 = m1 if m1 < F15 else F15
            e0 = _k_quad(a, -(m * m0), sw, sx, sxx, sl, sl2, sxl)
            e1 = _k_quad(a, -(m * m1), sw, sx, sxx, sl, sl2, sxl)
            be = e_out[k]
            t0 = e0 < be
            be = e0 if t0 else be
            bs = sc if t0 else sc_out[k]
            bm = m0 if t0 else mc_out[k]
            t1 = e1 < be
            e_out[k] = e1 if t1 else be
            sc_out[k] = sc if t1 else bs
            mc_out[k] = m1 if t1 else bm


@_jit
def _k_levels(x, w, dl, ml, sc, mc, acc, errl, lv, la, lb, ia):
    """At levels a q - b (a = d sc, b = dmin mc): the nearest codes ``lv`` (uint8), their sums
    and each lane's exact weighted error (``_levels_ref``), in one pass (``la``, ``lb``, ``ia``:
    scratch)."""
    nl = x.shape[1]
    for k in range(nl):
        acc[0, k] = F0
        acc[1, k] = F0
        acc[2, k] = F0
        errl[k] = F0
        la[k] = dl[k] * sc[k]
        lb[k] = ml[k] * mc[k]
        ia[k] = F1 / la[k] if la[k] > F0 else F0
    for i in range(16):
        for k in range(nl):
            a = la[k]
            b = lb[k]
            v = np.rint((x[i, k] - (-b)) * ia[k])
            v = v if v > F0 else F0
            v = v if v < F3 else F3
            lv[i, k] = np.uint8(v)
            r = (a * v - b) - x[i, k]
            errl[k] += (w[i, k] * r) * r
            wl = w[i, k] * v
            acc[0, k] += wl
            acc[1, k] += wl * v
            acc[2, k] += wl * x[i, k]


@_jit
def _k_ls_dm(bk, sc, mc, base, s, unscale):
    """Least-squares (d, dmin) of block ``bk`` (float64), each fp16-rounded and normalised."""
    aa = 0.0
    bb = 0.0
    cc = 0.0
    u = 0.0
    v = 0.0
    for k in range(16 * bk, 16 * bk + 16):
        c = np.float64(sc[k])
        m = np.float64(mc[k])
        aa += c * c * np.float64(s[1, k])
        bb += c * m * np.float64(s[0, k])
        cc += m * m * np.float64(base[0, k])
        u += c * np.float64(s[2, k])
        v += m * np.float64(base[1, k])
    det = aa * cc - bb * bb
    okd = det > 0.0
    dd = det if okd else 1.0
    d = (u * cc - v * bb) / dd
    mm = (u * bb - v * aa) / dd
    if (not okd) or mm < 0.0:
        d = u / (aa if aa > 0.0 else 1.0)
        mm = 0.0
    d = d if d > 0.0 else 0.0
    mm = mm if mm > 0.0 else 0.0
    return (np.float32(_round_f16_nb(d * unscale) / unscale),
            np.float32(_round_f16_nb(mm * unscale) / unscale))


@_jit
def _encode_kernel(xb, qt, r_cand, lloyd, final_lloyd, d_mult, ls_steps, m_mult, out):
    # xb [n, 256] float32 super-blocks, qt [nq, 16, 16] their importance in lane order
    # (``_lane_importance``; block i uses qt[i % nq]), out [n, 84] u8 zero-filled.
    nblk = xb.shape[0]
    nq = qt.shape[0]
    nsb = SB_CHUNK
    nl = 16 * nsb
    inf32 = np.float32(np.inf)
    x = np.zeros((16, nl), np.float32)
    w = np.zeros((16, nl), np.float32)
    live = np.zeros(nsb, np.bool_)
    lane_live = np.zeros(nl, np.bool_)
    fpow = np.zeros(nsb, np.float32)           # each block's power-of-two input scale
    unscale = np.ones(nsb)
    sig = np.zeros(nsb, np.float32)
    base = np.zeros((3, nl), np.float32)       # sum w, w x, w x^2
    cs = np.zeros((3, nl), np.float32)         # a trial's code sums: w q, w q^2, w q x
    ns = np.zeros((3, nl), np.float32)         # a Lloyd round's
    bs = np.zeros((3, nl), np.float32)         # the best fit's, later the chosen codes'
    lo = np.zeros(nl, np.float32)
    rr = np.zeros(nl, np.float32)
    flat = np.zeros(nl, np.bool_)
    ba = np.zeros(nl, np.float32)
    bo = np.zeros(nl, np.float32)
    be = np.zeros(nl, np.float32)
    a = np.zeros(nl, np.float32)
    o = np.zeros(nl, np.float32)
    e = np.zeros(nl, np.float32)
    ok = np.zeros(nl, np.bool_)
    a2 = np.zeros(nl, np.float32)
    o2 = np.zeros(nl, np.float32)
    e2 = np.zeros(nl, np.float32)
    ok2 = np.zeros(nl, np.bool_)
    sc = np.zeros(nl, np.float32)
    mc = np.zeros(nl, np.float32)
    scs = np.zeros(nl, np.float32)
    mcs = np.zeros(nl, np.float32)
    el = np.zeros(nl, np.float32)
    la = np.zeros(nl, np.float32)
    lb = np.zeros(nl, np.float32)
    ia = np.zeros(nl, np.float32)
    dl = np.zeros(nl, np.float32)
    ml = np.zeros(nl, np.float32)
    lvc = np.zeros((16, nl), np.uint8)         # the chosen levels' codes
    lvt = np.zeros((16, nl), np.uint8)         # a refinement's
    dsel = np.zeros(nsb, np.float32)
    msel = np.zeros(nsb, np.float32)
    btot = np.zeros(nsb, np.float32)
    err = np.zeros(nsb, np.float32)
    act = np.zeros(nsb, np.bool_)
    amx = np.zeros(nsb, np.float32)
    bmx = np.zeros(nsb, np.float32)
    dn = np.zeros(nsb, np.float32)
    mn = np.zeros(nsb, np.float32)
    for b0 in range(0, nblk, nsb):
        # 0. scaled inputs and importance as lanes; padding and tiny blocks are zero lanes.  The
        #    inputs go in unscaled, so each block's largest magnitude comes from the lanes' maxima
        #    (vectorised) rather than a scalar pass over its 256 values.  The importance comes
        #    already in lane order (``qt``), a contiguous copy.
        for bk in range(nsb):
            blk = b0 + bk
            if blk < nblk:
                row = xb[blk]
                qr = blk % nq
                for i in range(16):
                    for j in range(16):
                        x[i, 16 * bk + j] = row[16 * j + i]
                        w[i, 16 * bk + j] = qt[qr, i, j]
            else:
                for i in range(16):
                    for j in range(16):
                        x[i, 16 * bk + j] = F0
                        w[i, 16 * bk + j] = F1
        for k in range(nl):
            e[k] = F0
        for i in range(16):
            for k in range(nl):
                v = abs(x[i, k])
                e[k] = v if v > e[k] else e[k]
        for bk in range(nsb):
            amax = F0
            for k in range(16 * bk, 16 * bk + 16):
                amax = e[k] if e[k] > amax else amax
            live[bk] = amax >= TINY
            f = F0
            unscale[bk] = 1.0
            if live[bk]:
                _, ex = math.frexp(amax)
                f = np.float32(math.ldexp(1.0, -ex))
                unscale[bk] = math.ldexp(1.0, ex)
            fpow[bk] = f
        for k in range(nl):
            dl[k] = fpow[k >> 4]
            lane_live[k] = live[k >> 4]
            e[k] = F0
        for i in range(16):
            for k in range(nl):
                v = x[i, k] * dl[k] if lane_live[k] else F0
                x[i, k] = v
                e[k] += v * v
        for bk in range(nsb):
            t2 = F0
            for k in range(16 * bk, 16 * bk + 16):
                t2 += e[k]
            sig[bk] = t2 / np.float32(QK)
        for k in range(nl):
            dl[k] = sig[k >> 4]
            base[0, k] = F0
            base[1, k] = F0
            base[2, k] = F0
        for i in range(16):
            for k in range(nl):
                wk = w[i, k] * np.sqrt(dl[k] + x[i, k] * x[i, k])
                w[i, k] = wk
                wx = wk * x[i, k]
                base[0, k] += wk
                base[1, k] += wx
                base[2, k] += wx * x[i, k]
        # 1. per sub-block fits: each trial start with its Lloyd rounds, then Lloyd rounds on the best
        for k in range(nl):
            mnv = x[0, k]
            mxv = x[0, k]
            for i in range(1, 16):
                mnv = x[i, k] if x[i, k] < mnv else mnv
                mxv = x[i, k] if x[i, k] > mxv else mxv
            lo[k] = mnv if mnv < F0 else F0
            rng = mxv - lo[k]
            flat[k] = rng > F0
            rr[k] = rng if flat[k] else F1
            be[k] = inf32
        for idx in range(r_cand.shape[0]):
            r = r_cand[idx]
            for k in range(nl):
                a[k] = (F3 + r) / rr[k]                       # the trial's inverse step
            _k_trial_sums(x, w, a, lo, cs)
            _k_fit(base, cs, a, o, e, ok)
            for k in range(nl):
                good = ok[k] and flat[k]
                if idx == 0:    # no solvable fit: the min-max levels at these codes
                    a[k] = a[k] if good else (rr[k] / F3 if flat[k] else F0)
                    o[k] = o[k] if good else lo[k]
                    e[k] = e[k] if good else _k_quad(a[k], o[k], base[0, k], base[1, k], base[2, k],
                                                     cs[0, k], cs[1, k], cs[2, k])
                else:
                    e[k] = e[k] if good else inf32
            _k_lloyd(x, w, base, a, o, e, cs, lloyd, ns, a2, o2, e2, ok2, ia)
            for k in range(nl):
                t = e[k] < be[k]
                ba[k] = a[k] if t else ba[k]
                bo[k] = o[k] if t else bo[k]
                be[k] = e[k] if t else be[k]
                bs[0, k] = cs[0, k] if t else bs[0, k]
                bs[1, k] = cs[1, k] if t else bs[1, k]
                bs[2, k] = cs[2, k] if t else bs[2, k]
        _k_lloyd(x, w, base, ba, bo, be, bs, final_lloyd, ns, a2, o2, e2, ok2, ia)
        # 2. d / dmin candidates per block, nibbles per lane by the closed-form error
        for bk in range(nsb):
            amx[bk] = F0
            bmx[bk] = F0
            for k in range(16 * bk, 16 * bk + 16):
                amx[bk] = ba[k] if ba[k] > amx[bk] else amx[bk]
                nb = -bo[k]
                bmx[bk] = nb if nb > bmx[bk] else bmx[bk]
            btot[bk] = inf32
            dsel[bk] = F0
            msel[bk] = F0
        for k in range(nl):
            scs[k] = F0
            mcs[k] = F0
        for fd in d_mult:
            for bk in range(nsb):
                dn[bk] = np.float32(_round_f16_nb(np.float64(amx[bk]) * fd / 15.0 * unscale[bk]) / unscale[bk])
            for fm in m_mult:
                for bk in range(nsb):
                    mn[bk] = np.float32(_round_f16_nb(np.float64(bmx[bk]) * fm / 15.0 * unscale[bk]) / unscale[bk])
                for k in range(nl):
                    dl[k] = dn[k >> 4]
                    ml[k] = mn[k >> 4]
                _k_nibbles(dl, ml, ba, base, bs, sc, mc, el, a2, o2, e2)
                for bk in range(nsb):
                    tot = F0
                    for k in range(16 * bk, 16 * bk + 16):
                        tot += el[k]
                    if tot < btot[bk]:
                        btot[bk] = tot
                        dsel[bk] = dn[bk]
                        msel[bk] = mn[bk]
                        for k in range(16 * bk, 16 * bk + 16):
                            scs[k] = sc[k]
                            mcs[k] = mc[k]
        # 3. codes at the chosen nibbles, then least-squares d / dmin refinement
        for k in range(nl):
            dl[k] = dsel[k >> 4]
            ml[k] = msel[k >> 4]
        _k_levels(x, w, dl, ml, scs, mcs, bs, el, lvc, la, lb, ia)
        for bk in range(nsb):
            t = F0
            for k in range(16 * bk, 16 * bk + 16):
                t += el[k]
            err[bk] = t
            act[bk] = live[bk]
        for _ in range(ls_steps):
            more = False
            for bk in range(nsb):
                d2, m2 = _k_ls_dm(bk, scs, mcs, base, bs, unscale[bk])
                dn[bk] = d2
                mn[bk] = m2
                act[bk] = act[bk] and d2 > F0 and (d2 != dsel[bk] or m2 != msel[bk])
                more = more or act[bk]
            if not more:
                break
            for k in range(nl):
                dl[k] = dn[k >> 4]
                ml[k] = mn[k >> 4]
            _k_nibbles(dl, ml, ba, base, bs, sc, mc, el, a2, o2, e2)
            _k_levels(x, w, dl, ml, sc, mc, ns, el, lvt, la, lb, ia)
            for bk in range(nsb):
                t = F0
                for k in range(16 * bk, 16 * bk + 16):
                    t += el[k]
                act[bk] = act[bk] and t < err[bk]
                if act[bk]:
                    err[bk] = t
                    dsel[bk] = dn[bk]
                    msel[bk] = mn[bk]
                    for k in range(16 * bk, 16 * bk + 16):
                        scs[k] = sc[k]
                        mcs[k] = mc[k]
                        bs[0, k] = ns[0, k]
                        bs[1, k] = ns[1, k]
                        bs[2, k] = ns[2, k]
                    for i in range(16):
                        for k in range(16 * bk, 16 * bk + 16):
                            lvc[i, k] = lvt[i, k]
        # 4. bytes: the codes of the last accepted levels
        for bk in range(nsb):
            blk = b0 + bk
            if blk >= nblk or not live[bk]:
                continue
            bits = _f16_bits_nb(np.float64(dsel[bk]) * unscale[bk])
            out[blk, 80] = bits & 255
            out[blk, 81] = bits >> 8
            bits = _f16_bits_nb(np.float64(msel[bk]) * unscale[bk])
            out[blk, 82] = bits & 255
            out[blk, 83] = bits >> 8
            for j in range(16):
                k = 16 * bk + j
                out[blk, j] = np.uint8(scs[k]) | (np.uint8(mcs[k]) << 4)
            # weight 128 h + 32 g + l (sub-block 8 h + 2 g + l // 16, element l % 16) -> bits 2g of qs[32 h + l]
            for h in range(2):
                for l in range(32):
                    k = 16 * bk + 8 * h + l // 16
                    i = l % 16
                    out[blk, 16 + 32 * h + l] = (lvc[i, k] | (lvc[i, k + 2] << 2) | (lvc[i, k + 4] << 4)
                                                 | (lvc[i, k + 6] << 6))


def _lane_importance(qw: np.ndarray) -> np.ndarray:
    """Importance rows ``[nq, 256]`` in the kernel's lane order ``[nq, 16, 16]`` (element ``i`` of
    sub-block ``j`` at ``[r, i, j]``): done once per call, not per block."""
    return np.ascontiguousarray(qw.reshape(-1, 16, 16).transpose(0, 2, 1), np.float32)


def encode(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """float32 ``[..., K]`` (K a multiple of 256, finite) -> Q2_K bytes U8 ``[..., K/256*84]`` (numba, one thread).

    ``imatrix``: importance per column, float ``[K]`` (None: all ones; ``check_imatrix``)."""
    xb, qw, shape = _prepare(x, imatrix, name)
    out = np.zeros((xb.shape[0], BLOCK_BYTES), np.uint8)
    eff = effort_for(imatrix)
    _encode_kernel(xb, _lane_importance(qw), np.array(eff.r_cand, np.float32), eff.lloyd, eff.final_lloyd,
                   np.array(eff.d_mult, np.float64), eff.ls_steps, M_MULT, out)
    return as_rows(out, shape)
