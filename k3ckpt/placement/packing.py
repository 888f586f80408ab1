"""Packing replicas onto GPUs: LPT by rounds, then bounded swap search.

The working state holds, for all layers at once, every replica ("item") of a
layer with its expert, its size (expert load / replica count) and its GPU.  Items
are kept sorted by size, descending, ties by expert id, so all replicas of one
expert are adjacent.  Used by ``placement.plan_placement``; numpy only.

``set_noise`` switches a packing to a robust objective (load plus ``kappa``
standard deviations from drift, counting noise and shared load factors) for the
final polish.

Tie-breaking: stable sorts; ``argmin``/``argmax`` take the lowest index.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PackState", "pack", "pack_rounds", "scenario_max", "set_noise", "swap_search", "take_rows"]


def items_of(loads: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Replicas of every layer sorted by size, descending; ties by expert id.

    Returns ``item2exp [layers, S]`` and ``size [layers, S]``.  All replicas of one
    expert are adjacent.
    """
    L, E = loads.shape
    S = int(counts[0].sum())
    per_rep = loads / counts
    order = np.argsort(-per_rep, axis=1, kind="stable")
    cnt_sorted = np.take_along_axis(counts, order, axis=1)
    # row l repeats order[l, j] cnt_sorted[l, j] times: one flat repeat for all rows
    item2exp = np.repeat(order.ravel(), cnt_sorted.ravel()).reshape(L, S)
    size = np.take_along_axis(per_rep, item2exp, axis=1)
    return item2exp, size


def pack_rounds(item2exp: np.ndarray, size: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """LPT by rounds: returns ``item_gpu [layers, S]``.

    Items must come sorted by size, descending.  In round ``k`` every GPU with more
    than ``k`` slots takes one item; the heaviest item of the round goes to the
    lightest GPU (ties: lowest GPU id).  A GPU that already holds a replica of the
    expert offered to it trades with the nearest item of the round that fits.
    """
    L, S = size.shape
    G = cap.shape[0]
    item_gpu = np.full((L, S), -1, dtype=np.int64)
    gl = np.zeros((L, G))
    pos = 0
    for k in range(int(cap.max())):
        members = np.flatnonzero(cap > k)
        n = members.shape[0]
        sub = gl[:, members]
        rank = np.argsort(sub, axis=1, kind="stable")
        gpus = members[rank]  # [L, n] lightest first
        idx = slice(pos, pos + n)
        item_gpu[:, idx] = gpus
        if k:
            _repair_round(item2exp, item_gpu, pos, pos + n)
        gl += _row_bincount(item_gpu[:, idx], size[:, idx], G)
        pos += n
    assert pos == S, (pos, S)
    return item_gpu


def _row_bincount(idx: np.ndarray, weights: np.ndarray, width: int) -> np.ndarray:
    """``[rows, width]`` sums of ``weights`` by column ``idx``, row by row."""
    rows = idx.shape[0]
    flat = (np.arange(rows)[:, None] * width + idx).ravel()
    return np.bincount(flat, weights=np.ravel(weights), minlength=rows * width).reshape(rows, width)


def _collisions(item2exp: np.ndarray, item_gpu: np.ndarray, start: int, stop: int, G: int) -> np.ndarray:
    """``[L, stop - start]`` whether items ``start:stop`` land on a GPU that already
    holds their expert through an item before ``start``."""
    L = item2exp.shape[0]
    span = (int(item2exp.max()) + 1) * G
    off = (np.arange(L) * span)[:, None]
    prev = np.sort((item2exp[:, :start] * G + item_gpu[:, :start] + off).ravel())
    new = (item2exp[:, start:stop] * G + item_gpu[:, start:stop] + off).ravel()
    pos = np.minimum(np.searchsorted(prev, new), prev.size - 1)
    return (prev[pos] == new).reshape(L, stop - start)


def _member(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    if sorted_keys.size == 0:
        return np.zeros(keys.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_keys, keys), sorted_keys.size - 1)
    return sorted_keys[pos] == keys


def _repair_round(item2exp: np.ndarray, item_gpu: np.ndarray, start: int, stop: int, reach: int = 48) -> None:
    """Undo collisions (a GPU offered a second replica of an expert) inside one round
    by trading GPUs with the nearest item of the round that fits.

    Colliding positions are handled in order; each takes the nearest position outside
    its expert's run of replicas (before the run, after it, alternately) whose trade
    creates no collision and that no earlier trade touched.  ``reach`` candidates a
    side are checked in one numpy pass; if none fits, the nearest position at any
    distance is searched one by one.
    """
    G = int(item_gpu[:, :stop].max()) + 1
    hit = _collisions(item2exp, item_gpu, start, stop, G)
    n = stop - start
    for l in np.flatnonzero(hit.any(axis=1)):
        held_keys = np.sort(item2exp[l, :start] * G + item_gpu[l, :start])
        gpus = item_gpu[l, start:stop].copy()
        exps = item2exp[l, start:stop]
        bad = np.flatnonzero(hit[l])
        # replicas of one expert are adjacent: look just outside the expert's run
        change = np.flatnonzero(np.diff(exps)) + 1
        run_lo = np.concatenate(([0], change))[np.searchsorted(change, bad, side="right")]
        run_hi = np.concatenate((change, [n]))[np.searchsorted(change, bad, side="right")]
        t = np.arange(reach)
        cand = np.empty((bad.size, 2 * reach), dtype=np.int64)
        cand[:, 0::2] = run_lo[:, None] - 1 - t
        cand[:, 1::2] = run_hi[:, None] + t
        inside = (cand >= 0) & (cand < n)
        cj = np.clip(cand, 0, n - 1)
        ok = (
            inside
            & (exps[cj] != exps[bad][:, None])
            & ~_member(held_keys, exps[bad][:, None] * G + gpus[cj])
            & ~_member(held_keys, exps[cj] * G + gpus[bad][:, None])
        )
        touched = np.zeros(n, dtype=bool)
        held = None
        for r, i in enumerate(bad):
            if touched[i]:
                continue  # an earlier trade moved it, to a GPU checked not to hold its expert
            js = cand[r][ok[r] & ~touched[cj[r]]]
            if js.size:
                j = int(js[0])
                gpus[i], gpus[j] = gpus[j], gpus[i]
                touched[i] = touched[j] = True
                continue
            if held is None:
                held = set(held_keys.tolist())
            for dist in range(1, n):
                j = next(
                    (
                        j
                        for j in (i - dist, i + dist)
                        if 0 <= j < n
                        and exps[j] != exps[i]
                        and exps[i] * G + gpus[j] not in held
                        and exps[j] * G + gpus[i] not in held
                    ),
                    None,
                )
                if j is not None:
                    gpus[i], gpus[j] = gpus[j], gpus[i]
                    touched[i] = touched[j] = True
                    break
        item_gpu[l, start:stop] = gpus


# ---------------------------------------------------------------------------
# 3. local search


class PackState:
    """Mutable working state of one packing, all layers at once.

    ``item2exp, size, item_gpu [L, S]``; ``gl [L, G]`` GPU loads;
    ``gpu_items [L, G, smax]`` item ids per GPU, -1 where a GPU has fewer slots.
    After ``set_noise`` (``kappa > 0``) the search balances the robust load
    ``gl + kappa * sqrt(gv + |gp|^2)``: ``gv [L, G]`` the GPUs' independent variance
    (sum of the items' ``var``), ``gp [L, G, R]`` their summed factor loadings
    (items' ``proj``), and no swap lifts a GPU's ``gl`` above ``limit [L]``.
    """

    def __init__(self, item2exp, size, item_gpu, cap):
        self.item2exp = item2exp
        self.size = size
        self.item_gpu = item_gpu
        L, S = size.shape
        G = cap.shape[0]
        self.cap = cap
        r = np.arange(L)[:, None]
        self.gl = _row_bincount(item_gpu, size, G)
        # robust objective, off until set_noise
        self.kappa = 0.0
        self.limit = np.full(L, np.inf)
        self.var = np.zeros_like(size)
        self.gv = np.zeros((L, G))
        self.proj = np.zeros((L, S, 0))
        self.gp = np.zeros((L, G, 0))
        smax = int(cap.max())
        order = np.argsort(item_gpu, axis=1, kind="stable")
        self.gpu_items = np.full((L, G, smax), -1, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(cap)[:-1]))
        slot_in_gpu = np.arange(S) - np.repeat(starts, cap)
        gpu_of_pos = np.repeat(np.arange(G), cap)
        self.gpu_items[r, gpu_of_pos[None, :], slot_in_gpu[None, :]] = order

    def max_load(self) -> np.ndarray:
        return self.gl.max(axis=1)

    def robust(self) -> np.ndarray:
        """``[L, G]`` the balanced quantity: loads, plus ``kappa`` standard deviations."""
        if self.kappa == 0.0:
            return self.gl
        return self.gl + self.kappa * np.sqrt(np.maximum(self.gv + (self.gp**2).sum(axis=2), 0.0))

    def robust_max(self) -> np.ndarray:
        return self.robust().max(axis=1)


def _holds(state: PackState, layers: np.ndarray, gpus: np.ndarray, exps: np.ndarray) -> np.ndarray:
    """``[n]`` whether GPU ``gpus[i]`` of layer ``layers[i]`` holds expert ``exps[i]``."""
    items = state.gpu_items[layers, gpus]  # [n, smax]
    held = np.where(items >= 0, state.item2exp[layers[:, None], np.maximum(items, 0)], -1)
    return (held == exps[:, None]).any(axis=1)


def swap_search(state: PackState, max_iters: int, partners: int = 8, tries: int = 6) -> None:
    """Swap an item of the heaviest GPU with an item of a light GPU while that
    lowers the pair's maximum below the layer maximum.

    Per layer and iteration the best swap (lowest new pair maximum; ties: lowest
    item positions) among the ``partners`` lightest GPUs is applied.  A layer stops
    when no swap helps; the search stops after ``max_iters`` rounds.
    """
    L, G = state.gl.shape
    if G < 2:
        return
    m = min(partners, G - 1)
    active = np.ones(L, dtype=bool)
    kappa = state.kappa
    for _ in range(max_iters):
        rows = np.flatnonzero(active)
        if rows.size == 0:
            break
        gl = state.robust()[rows] if kappa else state.gl[rows]
        h = np.argmax(gl, axis=1)
        M = gl[np.arange(rows.size), h]
        # partners: the m lightest GPUs other than h (argpartition, then sorted by
        # load and id, so the set and its order are deterministic)
        masked = gl.copy()
        masked[np.arange(rows.size), h] = np.inf
        order = np.argpartition(masked, m - 1, axis=1)[:, :m] if m < G - 1 else np.argsort(masked, axis=1)[:, :m]
        sub = np.take_along_axis(masked, order, axis=1)
        order = np.take_along_axis(order, np.lexsort((order, sub), axis=1), axis=1)
        a_items = state.gpu_items[rows, h]  # [n, smax]
        b_items = state.gpu_items[rows[:, None], order].reshape(rows.size, -1)  # [n, m*smax]
        b_gpu = np.repeat(order, state.gpu_items.shape[2], axis=1)
        sa = np.where(a_items >= 0, state.size[rows[:, None], np.maximum(a_items, 0)], -np.inf)
        sb = np.where(b_items >= 0, state.size[rows[:, None], np.maximum(b_items, 0)], np.inf)
        tol = 1e-12 * np.maximum(M, 1e-300)
        d = sa[:, :, None] - sb[:, None, :]
        if kappa:
            va = state.var[rows[:, None], np.maximum(a_items, 0)]
            vb = state.var[rows[:, None], np.maximum(b_items, 0)]
            dv = va[:, :, None] - vb[:, None, :]
            ga = state.gl[rows, h]
            glb = np.take_along_axis(state.gl[rows], b_gpu, axis=1)
            va_new = state.gv[rows, h][:, None, None] - dv
            vb_new = np.take_along_axis(state.gv[rows], b_gpu, axis=1)[:, None, :] + dv
            if state.proj.shape[2]:
                # |gpa - ya + yb|^2 and |gpb + ya - yb|^2 for every pair, expanded so
                # that only [n, A, B] arrays appear (two batched products)
                ya = state.proj[rows[:, None], np.maximum(a_items, 0)]  # [n, A, R]
                yb = state.proj[rows[:, None], np.maximum(b_items, 0)]  # [n, B, R]
                gpa = state.gp[rows, h]  # [n, R]
                gpb = np.take_along_axis(state.gp[rows], b_gpu[:, :, None], axis=1)  # [n, B, R]
                cross = ya @ yb.transpose(0, 2, 1)  # [n, A, B]
                ya2 = (ya * ya).sum(axis=2)
                yb2 = (yb * yb).sum(axis=2)
                sq = ya2[:, :, None] + yb2[:, None, :] - 2 * cross
                gya = (ya * gpa[:, None, :]).sum(axis=2)  # [n, A]
                gyb = (yb * gpa[:, None, :]).sum(axis=2)  # [n, B]
                va_new = va_new + ((gpa * gpa).sum(axis=1)[:, None, None] - 2 * gya[:, :, None]
                                   + 2 * gyb[:, None, :] + sq)
                gbya = ya @ gpb.transpose(0, 2, 1)  # [n, A, B]: gpb . ya
                gbyb = (gpb * yb).sum(axis=2)  # [n, B]
                vb_new = vb_new + ((gpb * gpb).sum(axis=2)[:, None, :] + 2 * gbya - 2 * gbyb[:, None, :] + sq)
            with np.errstate(invalid="ignore"):
                na = ga[:, None, None] - d + kappa * np.sqrt(np.maximum(va_new, 0.0))
                nb_ = glb[:, None, :] + d + kappa * np.sqrt(np.maximum(vb_new, 0.0))
            new = np.maximum(na, nb_)
            lim = state.limit[rows][:, None, None]
            ok = (
                np.isfinite(d)
                & (new < (M - tol)[:, None, None])
                & (ga[:, None, None] - d <= lim)
                & (glb[:, None, :] + d <= lim)
            )
        else:
            glb = np.take_along_axis(gl, b_gpu, axis=1)
            new = np.maximum(M[:, None, None] - d, glb[:, None, :] + d)
            ok = (d > tol[:, None, None]) & (new < (M - tol)[:, None, None])
        score = np.where(ok, new, np.inf).reshape(rows.size, -1)
        nb = b_items.shape[1]
        chosen = np.full(rows.size, -1, dtype=np.int64)
        pending = np.ones(rows.size, dtype=bool)
        for _t in range(tries):
            idx = np.argmin(score, axis=1)
            best = score[np.arange(rows.size), idx]
            cand = pending & np.isfinite(best)
            if not cand.any():
                break
            ci = np.flatnonzero(cand)
            ia, ib = np.divmod(idx[ci], nb)
            it_a = a_items[ci, ia]
            it_b = b_items[ci, ib]
            ea = state.item2exp[rows[ci], it_a]
            eb = state.item2exp[rows[ci], it_b]
            gb = b_gpu[ci, ib]
            bad = (ea == eb) | _holds(state, rows[ci], gb, ea) | _holds(state, rows[ci], h[ci], eb)
            good = ci[~bad]
            chosen[good] = idx[good]
            pending[good] = False
            score[ci[bad], idx[ci[bad]]] = np.inf
            pending &= np.isfinite(score).any(axis=1)
        done = chosen < 0
        active[rows[done]] = False
        ci = np.flatnonzero(~done)
        if ci.size == 0:
            break
        ia, ib = np.divmod(chosen[ci], nb)
        _apply_swap(state, rows[ci], h[ci], a_items[ci, ia], b_gpu[ci, ib], b_items[ci, ib])


def _apply_swap(state: PackState, layers, ga, ia, gb, ib) -> None:
    """Exchange item ``ia`` (on ``ga``) with item ``ib`` (on ``gb``), per layer."""
    sa = state.size[layers, ia]
    sb = state.size[layers, ib]
    state.gl[layers, ga] += sb - sa
    state.gl[layers, gb] += sa - sb
    va = state.var[layers, ia]
    vb = state.var[layers, ib]
    state.gv[layers, ga] += vb - va
    state.gv[layers, gb] += va - vb
    if state.proj.shape[2]:
        ya = state.proj[layers, ia]
        yb = state.proj[layers, ib]
        state.gp[layers, ga] += yb - ya
        state.gp[layers, gb] += ya - yb
    state.item_gpu[layers, ia] = gb
    state.item_gpu[layers, ib] = ga
    pa = np.argmax(state.gpu_items[layers, ga] == ia[:, None], axis=1)
    pb = np.argmax(state.gpu_items[layers, gb] == ib[:, None], axis=1)
    state.gpu_items[layers, ga, pa] = ib
    state.gpu_items[layers, gb, pb] = ia


def _fix_colocation(state: PackState) -> None:
    """Resolve any GPU holding two replicas of one expert by trading one of them
    with the closest-sized item elsewhere that creates no new collision."""
    L, S = state.size.shape
    G = state.gl.shape[1]
    key = state.item2exp * G + state.item_gpu
    srt = np.sort(key, axis=1)
    for l in np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1)):
        for _ in range(S):
            k = state.item2exp[l] * G + state.item_gpu[l]
            uniq, first, cnt = np.unique(k, return_index=True, return_counts=True)
            dup = np.flatnonzero(cnt > 1)
            if dup.size == 0:
                break
            target = uniq[dup[0]]
            ia = int(np.flatnonzero(k == target)[1])
            ea, ga = int(state.item2exp[l, ia]), int(state.item_gpu[l, ia])
            held = set(k.tolist())
            cand = np.argsort(np.abs(state.size[l] - state.size[l, ia]), kind="stable")
            for ib in cand:
                eb, gb = int(state.item2exp[l, ib]), int(state.item_gpu[l, ib])
                if gb == ga or eb == ea:
                    continue
                if ea * G + gb in held or eb * G + ga in held:
                    continue
                _apply_swap(state, np.array([l]), np.array([ga]), np.array([ia]), np.array([gb]), np.array([ib]))
                break
            else:  # pragma: no cover - needs more replicas than GPUs, excluded by the counts
                raise AssertionError("no trade resolves a colocated replica")


def scenario_max(state: PackState, counts: np.ndarray, scen: np.ndarray) -> np.ndarray:
    """``[layers]`` mean over drift scenarios ``scen [K, L, E]`` of the max GPU load."""
    K = scen.shape[0]
    L, S = state.size.shape
    G = state.gl.shape[1]
    per_rep = scen / counts[None]
    size = np.take_along_axis(per_rep, np.broadcast_to(state.item2exp, (K, L, S)), axis=2)
    flat = (np.arange(L)[:, None] * G + state.item_gpu)[None] + (np.arange(K) * L * G)[:, None, None]
    gl = np.bincount(flat.ravel(), weights=size.ravel(), minlength=K * L * G).reshape(K, L, G)
    return gl.max(axis=2).mean(axis=0)


def item_variance(counts, item2exp, size, noise):
    """``[L, S]`` variance of every replica's load under ``noise = (sigma, q)``:
    lognormal drift ``sigma`` per expert (shared by its replicas) and counting noise
    of ``q`` times the mean."""
    sigma, q = noise
    c = np.take_along_axis(counts, item2exp, axis=1)
    return (sigma * size) ** 2 + q * size / c


def set_noise(state: PackState, counts, noise, kappa: float, factors=None, limit=None) -> None:
    """Switch ``state`` to the robust objective: item variances from ``noise``,
    factor loadings from ``factors [L, E, R]`` (a replica carries ``1 / c``),
    planning loads capped at ``limit [L]``."""
    L, S = state.size.shape
    G = state.gl.shape[1]
    state.kappa = float(kappa)
    state.var = item_variance(counts, state.item2exp, state.size, noise)
    state.gv = _row_bincount(state.item_gpu, state.var, G)
    c = np.take_along_axis(counts, state.item2exp, axis=1)
    if factors is None:
        state.proj = np.zeros((L, S, 0))
    else:
        state.proj = np.take_along_axis(factors, state.item2exp[:, :, None], axis=1) / c[:, :, None]
    R = state.proj.shape[2]
    state.gp = np.zeros((L, G, R))
    for k in range(R):
        state.gp[:, :, k] = _row_bincount(state.item_gpu, state.proj[:, :, k], G)
    if limit is not None:
        state.limit = np.asarray(limit, dtype=np.float64).copy()


def pack(loads: np.ndarray, counts: np.ndarray, cap: np.ndarray, iters: int, partners: int) -> PackState:
    """Pack every row's replicas (LPT by rounds), fix colocations, swap-search."""
    item2exp, size = items_of(loads, counts)
    state = PackState(item2exp, size, pack_rounds(item2exp, size, cap), cap)
    _fix_colocation(state)
    swap_search(state, iters, partners=partners)
    return state


def take_rows(dst: PackState, rows: np.ndarray, src: PackState, src_rows: np.ndarray) -> None:
    for name in ("item2exp", "size", "item_gpu", "gl", "gpu_items", "var", "gv", "proj", "gp"):
        getattr(dst, name)[rows] = getattr(src, name)[src_rows]
