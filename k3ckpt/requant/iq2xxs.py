"""float32 -> llama.cpp IQ2_XXS (2.0625 bpw): weighted E8-grid search per group, numba.

The stored format (decoder, byte layout, tables) is ``k3ckpt.formats.iq2xxs``.
A super-block of 256 weights decodes as ``d * (0.5 + s) / 4 * g * sign``:
``d`` one fp16, ``s`` a 4-bit scale per sub-block of 32 weights, ``g`` an
8-vector of the 256-point grid (entries 8, 25, 43) per group of 8 and
``sign`` an 8-bit pattern with an even number of minus signs.

The error minimised is ``sum w_i (value_i - x_i)^2`` with llama.cpp's weights
``w_i = imatrix_i * sqrt(sigma^2 + x_i^2)`` (``sigma^2`` the super-block's mean
square, all-ones importance when none is given).  Per super-block:

1. Per group of 8 (magnitudes ``a``, weights ``w``): for every point ``g``,
   ``B_g = sum w a g`` minus ``2 min_j w_j a_j g_j`` when the group has an odd
   number of negative inputs (the parity rule forces one sign flip, cheapest
   where ``w a g`` is least); the error at step ``t`` is
   ``sum w a^2 + t (t N_g - 2 B_g)``, ``N_g = sum w g^2``.  The grid's 256
   points fall into 12 classes of equal ``|g|^2``; per class one point is kept
   with its own ``B`` and ``N``: the one with the largest ``B - t0 N / 2`` at
   an expected step ``t0 = C_TAU * sqrt(sum w a^2 / sum w)`` of its sub-block
   (the largest ``B`` when a group's weights are equal).  The pass over the
   points (``_class_scores``) has the SIMD-lane layout of
   ``requant.iq2xs._class_maxima``.
2. Per sub-block of 4 groups: a free step ``t*``: classes by their best gain
   ``B^2 / N``, then ``ALT`` rounds of the least-squares ``t`` for the chosen
   classes and the best classes at that ``t``.
3. Per super-block: fp16 ``d`` candidates ``4 * max t* / 15.5 * D_MULT``; for
   each, every sub-block takes the better of the two scales around
   ``t* / (d/4) - 0.5`` (the 12-class minimum per group); then up to
   ``LS_STEPS`` least-squares refinements of ``d`` (classes and scales
   fixed), rounded to fp16, kept only when the error drops.
4. Codes: the winning class (first of equal errors) and its point; signs
   are the inputs' sign bits, with the cheapest element flipped when odd.

The choice depends on magnitudes only and zero inputs keep their sign bit, so
``encode(-x)`` decodes to exactly ``-decode(encode(x))``.  Inputs are scaled
per super-block by a power of two (exact); super-blocks with
``max|x| < 2^-24`` encode as zeros and ``d`` is clamped to 65504.

``encode`` (numba) and ``encode_reference`` (numpy, the same float operations in
the same order, ties broken the same way) return identical bytes.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np

from ._ggml_encode import (QK, TINY, _f16_bits_nb, _jit, _round_f16_nb, best_d, check_imatrix, check_rows,
                           class_argmax, freeze, grid_classes, half_offsets, half_sums, round_f16)

__all__ = ["ALT", "C_TAU", "D_MULT", "LS_STEPS", "encode", "encode_reference", "search_tables"]

BLOCK_BYTES = 66
D_MULT = np.array([1.0, 0.97, 0.94, 0.91])
ALT = 2
LS_STEPS = 2
# Class points are scored as B - (t/2) N at an expected step t = C_TAU * the sub-block's weighted RMS
# magnitude (the median of t* / RMS on Gaussian and Student-t data).
C_TAU = 0.0366
HALF_TAU = np.float32(0.5 * C_TAU)
D_MULT.flags.writeable = False
SB_CHUNK = 4                  # super-blocks per kernel pass: 128 groups as SIMD lanes


@functools.cache
def search_tables() -> types.SimpleNamespace:
    """The IQ2_XXS grid in norm-class order (``_ggml_encode.grid_classes`` of
    ``formats.iq2xxs.grid_table``) and the squares ``gsq`` [8, 256] of ``gt``, ``lsq`` of ``lev``."""
    from ..formats.iq2xxs import grid_table

    t = grid_classes(grid_table())
    t.gsq = t.gt * t.gt
    t.lsq = t.lev * t.lev
    return freeze(t)


# ------------------------------------------------------------------ checks
def _rows(x, *, name: str | None) -> tuple[np.ndarray, tuple[int, ...]]:
    return check_rows(x, "IQ2_XXS", name=name)


# --------------------------------------------------------------- reference
def encode_reference(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """Numpy twin of ``encode`` (same decisions, same float operations; slow)."""
    x2, shape = _rows(x, name=name)
    qw = check_imatrix(imatrix, x2.shape[1], name=name).reshape(-1, QK)
    t = search_tables()
    blocks = x2.reshape(-1, QK)
    out = np.zeros((len(blocks), BLOCK_BYTES), np.uint8)
    for i, b in enumerate(blocks):
        out[i] = _ref_block(b, qw[i % len(qw)], t)
    return out.reshape(shape[:-1] + (x2.shape[1] // QK * BLOCK_BYTES,))


def _seq(v) -> float:
    """Sum from +0.0, left to right (the kernel's order)."""
    acc = 0.0
    for e in v:
        acc += e
    return acc


def _ref_block(x: np.ndarray, q: np.ndarray, t) -> np.ndarray:
    f0 = np.float32(0.0)
    a = np.abs(x)
    neg = (x.view(np.uint32) >> 31).astype(np.int64)
    amax = a.max()
    if amax < TINY:
        return np.zeros(BLOCK_BYTES, np.uint8)
    ex = math.frexp(float(amax))[1]
    x = x * np.float32(math.ldexp(1.0, -ex))
    a = a * np.float32(math.ldexp(1.0, -ex))
    unscale = math.ldexp(1.0, ex)
    if not _seq32(q.reshape(32, 8)) > f0:       # all-zero importance: ones
        q = np.ones(QK, np.float32)
    # weights (float32): sigma^2 = sum x^2 / 256, group sums first, then the 32 groups in order
    sigma2 = _seq32(_rowsum32((x * x).reshape(32, 8))) / np.float32(QK)
    w = (q * np.sqrt(sigma2 + x * x)).astype(np.float32).reshape(32, 8)
    p = (w * a.reshape(32, 8)).astype(np.float32)                    # [32, 8]
    ncls = len(t.cls_norm)

    odd = (neg.reshape(32, 8).sum(axis=1) & 1).astype(bool)
    odd2 = np.where(odd, np.float32(2.0), f0).astype(np.float32)
    prod = p[:, :, None] * t.gt[None, :, :]                          # [32, 8, 256]: w a g
    pen = odd2[:, None] * prod.min(axis=1)                           # the forced flip's cost
    bvals = (_half(prod, 0) + _half(prod, 4)) - pen                  # B of every point
    gsq = t.gt * t.gt
    bounds = t.cls_start

    def classes(htau):
        """Per group and class the point with the best score B - htau N (htau [32] float32, htau = t / 2
        at the group's expected step: 0 first), its B and its own energy N = sum w g^2."""
        ps = prod - (htau[:, None] * w)[:, :, None] * gsq[None, :, :]
        score = (_half(ps, 0) + _half(ps, 4)) - pen
        arg = np.stack([bounds[c] + np.argmax(score[:, bounds[c]:bounds[c + 1]], axis=1)
                        for c in range(ncls)], axis=1)               # [32, C], first maximum
        egy = np.zeros((32, ncls), np.float32)
        for j in range(8):
            egy = egy + w[:, j][:, None] * gsq[j][arg]
        return arg, np.take_along_axis(bvals, arg, axis=1).astype(np.float64), egy.astype(np.float64)

    def errors(g, tt):              # [C]: each class's error (minus sum w a^2) for group g at step tt
        return tt * (tt * nn[g] - 2.0 * bd[g])

    def best_class(g, tt):
        return int(np.argmin(errors(g, tt)))

    def sub_error(m, tt):
        return _seq(float(errors(4 * m + h, tt).min()) for h in range(4))

    def lsq_t(m, cls):
        num = _seq(bd[4 * m + h, cls[h]] for h in range(4))
        den = _seq(nn[4 * m + h, cls[h]] for h in range(4))
        return num / den if den > 0.0 else 0.0

    # 2. class points scored at the expected step, then the free step per sub-block by alternation
    def free_steps():
        tstar = np.zeros(8)
        for m in range(8):
            cls = []
            for h in range(4):
                g = 4 * m + h
                gain = np.where(nn[g] > 0.0, bd[g] * bd[g] / np.where(nn[g] > 0.0, nn[g], 1.0), 0.0)
                cls.append(int(np.argmax(gain)))
            tt = lsq_t(m, cls)
            for _ in range(ALT):
                tt = lsq_t(m, [best_class(4 * m + h, tt) for h in range(4)])
            tstar[m] = tt
        return tstar

    gwa = _rowsum32(p * a.reshape(32, 8)).reshape(8, 4)             # sum w a^2 per group
    gw = _rowsum32(w).reshape(8, 4)
    s1, s2 = _rowsum32(gwa), _rowsum32(gw)                          # per sub-block, groups in order
    rms = np.where(s2 > f0, np.sqrt(s1 / np.where(s2 > f0, s2, np.float32(1.0))), f0).astype(np.float32)
    barg, bd, nn = classes(np.repeat(HALF_TAU * rms, 4).astype(np.float32))
    tstar = free_steps()

    def eval_d(dn):
        u = dn * 0.25
        total = 0.0
        sel = np.zeros(8, np.int64)
        for m in range(8):
            sc = min(tstar[m] / u - 0.5, 14.0)
            s0 = int(math.floor(sc)) if sc > 0.0 else 0
            e0 = sub_error(m, u * (0.5 + s0))
            e1 = sub_error(m, u * (0.5 + (s0 + 1)))
            sel[m] = s0 + 1 if e1 < e0 else s0
            total += e1 if e1 < e0 else e0
        return total, sel

    # 3. d candidates, then least-squares refinement
    tmax = 0.0
    for v in tstar:
        tmax = v if v > tmax else tmax
    d0 = 4.0 * tmax / 15.5
    best_total, best_dn, s_sel = best_d(d0, unscale, D_MULT, eval_d)
    if best_dn == 0.0:
        return np.zeros(BLOCK_BYTES, np.uint8)
    for _ in range(LS_STEPS):
        num = 0.0
        den = 0.0
        for m in range(8):
            h = 0.5 + s_sel[m]
            tt = best_dn * 0.25 * h
            cls = [best_class(4 * m + j, tt) for j in range(4)]
            num += h * _seq(bd[4 * m + j, cls[j]] for j in range(4))
            den += h * h * _seq(nn[4 * m + j, cls[j]] for j in range(4))
        if not den > 0.0:
            break
        dn = round_f16(4.0 * num / den * unscale) / unscale
        if not dn > 0.0 or dn == best_dn:
            break
        tot, sc = eval_d(dn)
        if not tot < best_total:
            break
        best_total, best_dn, s_sel = tot, dn, sc

    # 4. bytes: d via numpy's own fp16 conversion (an independent check of round_f16 / f16_bits)
    out = np.zeros(BLOCK_BYTES, np.uint8)
    out[0:2] = np.array([best_dn * unscale], np.float64).astype("<f2").view(np.uint8)
    for m in range(8):
        tt = best_dn * 0.25 * (0.5 + s_sel[m])
        aux = int(s_sel[m]) << 28
        for h in range(4):
            g = 4 * m + h
            i = int(barg[g, best_class(g, tt)])
            bits = neg[8 * g:8 * g + 8].copy()
            if odd[g]:
                bits[int(np.argmin(prod[g, :, i]))] ^= 1
            sg = int((bits << np.arange(8)).sum()) & 127
            out[2 + 8 * m + h] = int(t.order[i])
            aux |= sg << (7 * h)
        out[2 + 8 * m + 4:2 + 8 * m + 8] = np.array([aux], "<u4").view(np.uint8)
    return out


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
# Lanes: the 32 * SB_CHUNK groups of a chunk; group h of sub-block m (m = 8 b + ib for
# sub-block ib of super-block b) is lane h * S + m, S = 8 * SB_CHUNK, so a sub-block's
# four groups are lanes m, S + m, 2 S + m, 3 S + m and the class maxima run over all lanes.
@_jit
def _min_err(bd, nn, k, tt):
    """Least class error t (t N - 2 B) of lane ``k`` at step ``tt`` and its first class."""
    be = np.inf
    bc = 0
    for c in range(bd.shape[1]):
        v = tt * (tt * nn[k, c] - 2.0 * bd[k, c])
        if v < be:
            be = v
            bc = c
    return be, bc


@_jit
def _class_scores(at, wl, htau, hpf, lev, lsq, ou, ow, cls_start, prods, prodm, p2, m2, p3, m3, hh, acc):
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
    half_sums(prods, prodm, hpf, p2, m2, p3, m3, hh)
    class_argmax(hh, ou, ow, cls_start, np.float32(-np.inf), acc)   # scores may be negative


@_jit
def _class_values(acc, at, wl, hpf, gt, gsq, bd, nn):
    """For each class's chosen point (``acc[c, L + k]``): its B (float32 as the reference's
    ``bvals``) and its energy sum w g^2, as float64 into ``bd`` / ``nn``."""
    nl = at.shape[1]
    f0 = np.float32(0.0)
    for c in range(bd.shape[1]):
        for k in range(nl):
            i = np.int64(acc[c, nl + k])
            g0 = at[0, k] * gt[0, i]
            g1 = at[1, k] * gt[1, i]
            g2 = at[2, k] * gt[2, i]
            g3 = at[3, k] * gt[3, i]
            g4 = at[4, k] * gt[4, i]
            g5 = at[5, k] * gt[5, i]
            g6 = at[6, k] * gt[6, i]
            g7 = at[7, k] * gt[7, i]
            mn = min(min(min(g0, g1), min(g2, g3)), min(min(g4, g5), min(g6, g7)))
            b = ((((g0 + g1) + g2) + g3) + (((g4 + g5) + g6) + g7)) - hpf[k] * mn
            e = f0
            for j in range(8):
                e += wl[j, k] * gsq[j, i]
            bd[k, c] = b
            nn[k, c] = e


@_jit
def _free_steps(bd, nn, ns, tstar):
    """Per sub-block lane m the free step by alternation (as the reference's ``free_steps``)."""
    ncls = bd.shape[1]
    for m in range(ns):
        num = 0.0
        den = 0.0
        for h in range(4):
            k = h * ns + m
            bg = -1.0
            bc = 0
            for c in range(ncls):
                gv = bd[k, c] * bd[k, c] / nn[k, c] if nn[k, c] > 0.0 else 0.0
                if gv > bg:
                    bg = gv
                    bc = c
            num += bd[k, bc]
            den += nn[k, bc]
        tt = num / den if den > 0.0 else 0.0
        for _ in range(ALT):
            num = 0.0
            den = 0.0
            for h in range(4):
                k = h * ns + m
                _, bc = _min_err(bd, nn, k, tt)
                num += bd[k, bc]
                den += nn[k, bc]
            tt = num / den if den > 0.0 else 0.0
        tstar[m] = tt


@_jit
def _encode_kernel(xb, sbits, qb, gt, gsq, order, lev, lsq, lo, hi, cls_start, norm, d_mult, out):
    # xb [n, 256] float32 super-blocks, sbits their bits (for the sign of zeros), qb [nq, 256]
    # importance (block i uses row i % nq), out [n, 66] u8 zero-filled.
    nblk = xb.shape[0]
    nq = qb.shape[0]
    nsb = SB_CHUNK
    nl = 32 * nsb
    ns = 8 * nsb
    ncls = norm.shape[0]
    f0 = np.float32(0.0)
    ou = np.empty(256, np.uint64)
    ow = np.empty(256, np.uint64)
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
    acc = np.empty((ncls, 2 * nl), np.float32)
    bd = np.empty((nl, ncls))             # per lane, its classes contiguous (the scalar loops run over c)
    nn = np.empty((nl, ncls))
    tstar = np.zeros(ns)
    s_try = np.zeros(ns, np.int64)
    s_sel = np.zeros(ns, np.int64)
    best_total = np.zeros(nsb)
    best_dn = np.zeros(nsb)
    for b0 in range(0, nblk, nsb):
        # 0. scaled magnitudes, weights, signs and parity as lanes; padding / tiny blocks are zero lanes
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
            qt = f0
            s2 = f0
            for g in range(32):
                gq = f0
                gx = f0
                for j in range(8):
                    v = xb[blk, 8 * g + j] * f if live[b] else f0
                    xs[b, 8 * g + j] = v
                    qv = qb[qr, 8 * g + j]
                    ws[b, 8 * g + j] = qv
                    gq += qv
                    gx += v * v
                qt += gq
                s2 += gx
            if not qt > f0:
                for j in range(256):
                    ws[b, j] = np.float32(1.0)
            sigma2 = s2 / np.float32(QK)
            for g in range(32):
                k = (g & 3) * ns + 8 * b + (g >> 2)
                bits = 0
                par = 0
                swa = f0
                sw = f0
                for j in range(8):
                    v = xs[b, 8 * g + j]
                    wv = ws[b, 8 * g + j] * np.sqrt(sigma2 + v * v)
                    wl[j, k] = wv
                    pv = wv * abs(v)
                    at[j, k] = pv
                    swa += pv * abs(v)
                    sw += wv
                    ng = np.int64(sbits[blk, 8 * g + j] >> 31) if live[b] else np.int64(0)
                    bits |= ng << j
                    par += ng
                sgn[k] = bits
                hpf[k] = 2.0 if par & 1 else 0.0
                gwa[k] = swa
                gws[k] = sw
        # 1. class points scored at each sub-block's expected step; 2. free steps by alternation
        for m in range(ns):
            s1 = f0
            s2 = f0
            for h in range(4):
                s1 += gwa[h * ns + m]
                s2 += gws[h * ns + m]
            rms = np.sqrt(s1 / (s2 if s2 > f0 else np.float32(1.0))) if s2 > f0 else f0
            for h in range(4):
                htau[h * ns + m] = HALF_TAU * rms
        _class_scores(at, wl, htau, hpf, lev, lsq, ou, ow, cls_start, prods, prod, p2, m2, p3, m3, hh, acc)
        _class_values(acc, at, wl, hpf, gt, gsq, bd, nn)
        _free_steps(bd, nn, ns, tstar)
        # 3. d candidates per super-block, then least-squares refinement
        for b in range(nsb):
            tmax = 0.0
            for m in range(8 * b, 8 * b + 8):
                tmax = tstar[m] if tstar[m] > tmax else tmax
            d0 = 4.0 * tmax / 15.5
            best_total[b] = np.inf
            best_dn[b] = 0.0
            if not live[b]:
                continue
            for q in range(d_mult.shape[0]):
                dn = _round_f16_nb(d0 * d_mult[q] * unscale[b]) / unscale[b]
                if dn == 0.0:
                    continue
                total = _eval_d(dn, b, tstar, bd, nn, ns, s_try)
                if total < best_total[b]:
                    best_total[b] = total
                    best_dn[b] = dn
                    for m in range(8 * b, 8 * b + 8):
                        s_sel[m] = s_try[m]
            if best_dn[b] == 0.0:
                continue
            for _ in range(LS_STEPS):
                num = 0.0
                den = 0.0
                for m in range(8 * b, 8 * b + 8):
                    hv = 0.5 + s_sel[m]
                    tt = best_dn[b] * 0.25 * hv
                    sb = 0.0
                    sn = 0.0
                    for h in range(4):
                        k = h * ns + m
                        _, bc = _min_err(bd, nn, k, tt)
                        sb += bd[k, bc]
                        sn += nn[k, bc]
                    num += hv * sb
                    den += hv * hv * sn
                if not den > 0.0:
                    break
                dn = _round_f16_nb(4.0 * num / den * unscale[b]) / unscale[b]
                if not dn > 0.0 or dn == best_dn[b]:
                    break
                total = _eval_d(dn, b, tstar, bd, nn, ns, s_try)
                if not total < best_total[b]:
                    break
                best_total[b] = total
                best_dn[b] = dn
                for m in range(8 * b, 8 * b + 8):
                    s_sel[m] = s_try[m]
        # 4. codes and bytes
        for b in range(nsb):
            blk = b0 + b
            if blk >= nblk or best_dn[b] == 0.0:
                continue
            bits = _f16_bits_nb(best_dn[b] * unscale[b])
            out[blk, 0] = bits & 255
            out[blk, 1] = bits >> 8
            for ib in range(8):
                m = 8 * b + ib
                tt = best_dn[b] * 0.25 * (0.5 + s_sel[m])
                aux = np.int64(s_sel[m]) << 28
                for h in range(4):
                    k = h * ns + m
                    _, bc = _min_err(bd, nn, k, tt)
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
                    out[blk, 2 + 8 * ib + h] = order[i]
                    aux |= (sg & 127) << (7 * h)
                for j in range(4):
                    out[blk, 2 + 8 * ib + 4 + j] = (aux >> (8 * j)) & 255


@_jit
def _eval_d(dn, b, tstar, bd, nn, ns, s_out):
    """Total error of super-block ``b`` at normalised ``dn``; each sub-block's better of the two
    scales around its t* -> ``s_out``."""
    u = dn * 0.25
    total = 0.0
    for m in range(8 * b, 8 * b + 8):
        sc = min(tstar[m] / u - 0.5, 14.0)
        s0 = int(math.floor(sc)) if sc > 0.0 else 0
        t0 = u * (0.5 + s0)
        t1 = u * (0.5 + (s0 + 1))
        e0 = 0.0
        e1 = 0.0
        for h in range(4):
            v0, _ = _min_err(bd, nn, h * ns + m, t0)
            v1, _ = _min_err(bd, nn, h * ns + m, t1)
            e0 += v0
            e1 += v1
        if e1 < e0:
            s_out[m] = s0 + 1
            total += e1
        else:
            s_out[m] = s0
            total += e0
    return total


def encode(x, *, imatrix=None, name: str | None = None) -> np.ndarray:
    """float32 ``[..., K]`` (K a multiple of 256, finite) -> IQ2_XXS bytes U8 ``[..., K/256*66]`` (numba, one thread).

    ``imatrix``: importance per column, float ``[K]`` (None: all ones; ``_ggml_encode.check_imatrix``)."""
    x2, shape = _rows(x, name=name)
    qw = check_imatrix(imatrix, x2.shape[1], name=name).reshape(-1, QK)
    t = search_tables()
    xb = x2.reshape(-1, QK)
    out = np.zeros((xb.shape[0], BLOCK_BYTES), np.uint8)
    _encode_kernel(xb, xb.view(np.uint32), qw, t.gt, t.gsq, t.order, t.lev, t.lsq, t.lo, t.hi, t.cls_start, t.cls_norm,
                   D_MULT, out)
    return out.reshape(shape[:-1] + (x2.shape[1] // QK * BLOCK_BYTES,))
