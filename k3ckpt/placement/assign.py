"""Expert placement: replica counts chosen jointly with packing, then local search.

Model (docs/planner.md): every MoE layer has ``E`` experts and ``S`` physical slots.
Slot ``s`` lives on GPU ``slot2gpu[s]``; all layers share that slot layout (the
same memory per GPU per layer).  ``phy2log[l, s]`` names the expert held by slot
``s`` of layer ``l``.  An expert with ``c`` replicas has its load split evenly,
``w / c`` per replica; a GPU's load in a layer is the sum over its slots.  No GPU
holds two replicas of one expert (they would add nothing but a copy).

Planner, per layer, all layers at once in numpy:

1. Candidate replica counts: a family ``c_e = clip(floor(w_e / tau + beta), 1, G)``
   for a few ``beta`` (``beta = 1`` is the min-max per-replica count EPLB builds),
   ``tau`` found by bisection so that the counts fill the ``S`` slots.
2. Each candidate is packed (LPT by rounds: every GPU with room takes one item per
   round, the heaviest item to the lightest GPU) and improved by bounded swap
   search; the candidate with the lowest maximum GPU load wins, per layer.  This is
   the joint part: counts are judged by how well they pack, not by the largest
   replica alone.
3. Replica moves: a slot is taken from an over-replicated expert and given to an
   expert on the heaviest GPU when that lowers the maximum, then swaps again.
4. With shared load factors (``factors``, from a planning trace): a robust polish,
   swaps that lower the largest ``load + kappa * sd`` of a GPU over the next steps,
   under a cap on the planning load (docs/planner.md, step 6).

Tie-breaking is deterministic everywhere: stable sorts, lowest index on ties.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import UsageError
from .packing import pack, scenario_max, set_noise, swap_search, take_rows

__all__ = [
    "Placement",
    "even_slots",
    "slots_to_slot2gpu",
    "replica_loads",
    "gpu_loads",
    "balancedness",
    "lower_bound",
    "minmax_counts",
    "family_counts",
    "plan_placement",
]

_EPS = 1e-9


# ---------------------------------------------------------------------------
# the plan arrays


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class Placement:
    """EPLB-compatible placement arrays.

    Attributes:
        phy2log: ``[layers, slots]`` expert id of every slot.
        slot2gpu: ``[slots]`` GPU (rank) of every slot, non-decreasing.
        num_gpus: ranks ``G``; every rank id in ``slot2gpu`` is below it.
        experts: logical experts per layer ``E``.
        logcnt: ``[layers, experts]`` replica counts (derived).
        log2phy: ``[layers, experts, maxcnt]`` slots of every expert in ascending
            order, -1 padded (derived).
    """

    phy2log: np.ndarray
    slot2gpu: np.ndarray
    num_gpus: int
    experts: int
    logcnt: np.ndarray = field(init=False, repr=False)
    log2phy: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        phy2log = np.asarray(self.phy2log)
        slot2gpu = np.asarray(self.slot2gpu)
        if phy2log.ndim != 2 or not np.issubdtype(phy2log.dtype, np.integer):
            raise UsageError(f"phy2log must be an integer [layers, slots] array, found {phy2log.dtype} {phy2log.shape}")
        if slot2gpu.ndim != 1 or not np.issubdtype(slot2gpu.dtype, np.integer):
            raise UsageError(f"slot2gpu must be an integer [slots] array, found {slot2gpu.dtype} {slot2gpu.shape}")
        layers, slots = phy2log.shape
        G, E = int(self.num_gpus), int(self.experts)
        if G < 1 or E < 1:
            raise UsageError(f"num_gpus and experts must be >= 1, found {G} and {E}")
        if slot2gpu.shape[0] != slots:
            raise UsageError(f"slot2gpu has {slot2gpu.shape[0]} slots, phy2log has {slots}")
        if slots and (slot2gpu.min() < 0 or slot2gpu.max() >= G):
            raise UsageError(f"slot2gpu names rank {int(slot2gpu.max())} (or a negative one); there are {G} ranks")
        if slots > 1 and np.any(np.diff(slot2gpu) < 0):
            raise UsageError("slot2gpu must be non-decreasing (each rank owns one contiguous range of slots)")
        if phy2log.size and (phy2log.min() < 0 or phy2log.max() >= E):
            raise UsageError(f"phy2log names expert {int(phy2log.max())} (or a negative one); there are {E}")
        flat = (np.arange(layers)[:, None] * E + phy2log).ravel()
        logcnt = np.bincount(flat, minlength=layers * E).reshape(layers, E).astype(np.int64)
        if layers and logcnt.min() < 1:
            l, e = np.argwhere(logcnt < 1)[0]
            raise UsageError(f"expert {e} of layer index {l} has no slot")
        maxcnt = int(logcnt.max()) if layers else 1
        # replicas of one expert in ascending slot order: a stable sort by expert id
        order = np.argsort(phy2log, axis=1, kind="stable")
        sorted_exp = np.take_along_axis(phy2log, order, axis=1)
        starts = np.cumsum(logcnt, axis=1) - logcnt
        rank = np.arange(slots)[None, :] - np.take_along_axis(starts, sorted_exp, axis=1)
        log2phy = np.full((layers, E, maxcnt), -1, dtype=np.int64)
        log2phy[np.arange(layers)[:, None], sorted_exp, rank] = order
        for name, arr in (("phy2log", phy2log.astype(np.int64)), ("slot2gpu", slot2gpu.astype(np.int64))):
            object.__setattr__(self, name, _readonly(arr))
        object.__setattr__(self, "num_gpus", G)
        object.__setattr__(self, "experts", E)
        object.__setattr__(self, "logcnt", _readonly(logcnt))
        object.__setattr__(self, "log2phy", _readonly(log2phy))

    @property
    def layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def slots(self) -> int:
        return self.phy2log.shape[1]

    def slots_per_gpu(self) -> np.ndarray:
        """``[G]`` slots of every rank (per layer)."""
        return np.bincount(self.slot2gpu, minlength=self.num_gpus)

    def colocated_replicas(self) -> int:
        """Number of replicas that share a GPU with another replica of their expert."""
        key = (self.phy2log * self.num_gpus + self.slot2gpu[None, :]).astype(np.int64)
        key = np.sort(key, axis=1)
        return int(np.count_nonzero(key[:, 1:] == key[:, :-1]))


def even_slots(num_gpus: int, total_slots: int) -> np.ndarray:
    """``[G]`` slots per GPU for ``total_slots``: the first ``total % G`` GPUs take one more."""
    if num_gpus < 1 or total_slots < 0:
        raise UsageError(f"need >= 1 GPU and >= 0 slots, found {num_gpus} and {total_slots}")
    base, extra = divmod(int(total_slots), int(num_gpus))
    out = np.full(num_gpus, base, dtype=np.int64)
    out[:extra] += 1
    return out


def slots_to_slot2gpu(slots_per_gpu: np.ndarray) -> np.ndarray:
    """``[slots]`` rank of each slot for contiguous per-rank ranges."""
    spg = np.asarray(slots_per_gpu, dtype=np.int64)
    return np.repeat(np.arange(spg.shape[0]), spg)


# ---------------------------------------------------------------------------
# metrics shared by the planner, the reports and the benchmark


def replica_loads(placement: Placement, loads: np.ndarray) -> np.ndarray:
    """``[layers, slots]`` load of every slot: expert load / replica count."""
    loads = np.asarray(loads, dtype=np.float64)
    per_rep = loads / placement.logcnt
    return np.take_along_axis(per_rep, placement.phy2log, axis=1)


def gpu_loads(placement: Placement, loads: np.ndarray) -> np.ndarray:
    """``[layers, G]`` load of every GPU under ``loads [layers, experts]``."""
    rep = replica_loads(placement, loads)
    out = np.zeros((placement.layers, placement.num_gpus))
    spg = placement.slots_per_gpu()
    nz = np.flatnonzero(spg)
    starts = np.concatenate(([0], np.cumsum(spg)[:-1]))[nz]
    if rep.shape[1]:
        out[:, nz] = np.add.reduceat(rep, starts, axis=1)
    return out


def balancedness(gpu_load: np.ndarray) -> float:
    """vLLM's balancedness: sum over layers of mean GPU load / sum of max GPU load."""
    gpu_load = np.asarray(gpu_load, dtype=np.float64)
    top = gpu_load.max(axis=1).sum()
    return float(gpu_load.mean(axis=1).sum() / top) if top > 0 else 1.0


def lower_bound(loads: np.ndarray, num_gpus: int, total_slots: int) -> np.ndarray:
    """``[layers]`` lower bound on the largest GPU load.

    ``max(total / G, min over counts of max_e w_e / c_e)`` with ``sum c = S`` and
    ``1 <= c_e <= G`` (docs/planner.md, "Bounds").
    """
    loads = np.asarray(loads, dtype=np.float64)
    c = minmax_counts(loads, total_slots, num_gpus)
    return np.maximum(loads.sum(axis=1) / num_gpus, (loads / c).max(axis=1))


# ---------------------------------------------------------------------------
# 1. replica counts


def _check_counts_args(loads: np.ndarray, total_slots: int, max_count: int) -> None:
    E = loads.shape[1]
    if total_slots < E:
        raise UsageError(f"{total_slots} slots per layer cannot hold {E} experts")
    if total_slots > E * max_count:
        raise UsageError(f"{total_slots} slots exceed {E} experts x {max_count} GPUs (a GPU never holds two replicas)")


def _fill_leftover(loads: np.ndarray, counts: np.ndarray, total_slots: int, max_count: int) -> np.ndarray:
    """Hand the remaining slots one by one to the largest ``w / c`` (ties: lowest id)."""
    r = np.arange(loads.shape[0])
    left = total_slots - counts.sum(axis=1)
    # one extra per-replica ratio breaks ties towards loaded experts over empty ones
    while left.max() > 0:
        ratio = np.where(counts < max_count, loads / counts + 1e-300, -1.0)
        pick = np.argmax(ratio, axis=1)
        active = left > 0
        counts[r[active], pick[active]] += 1
        left -= active
    return counts


def family_counts(loads: np.ndarray, total_slots: int, max_count: int, beta: float) -> np.ndarray:
    """``[layers, experts]`` counts ``clip(floor(w / tau + beta), 1, max_count)``.

    ``tau`` is the smallest value (by bisection, per layer) whose counts fit in
    ``total_slots``; the slots left over go to the largest ``w / c``.  ``beta = 1``
    reproduces the min-max per-replica counts.
    """
    loads = np.asarray(loads, dtype=np.float64)
    _check_counts_args(loads, total_slots, max_count)
    top = np.maximum(loads.max(axis=1, keepdims=True), 1e-300)
    # tau in [top / (max_count + 1), 2 top] holds the answer; bisect on log tau
    lo = np.log(top / (max_count + 1))
    hi = np.log(top * 2.0)

    def count(log_tau):
        return np.clip(np.floor(loads * np.exp(-log_tau) + beta), 1, max_count)

    for _ in range(48):
        mid = 0.5 * (lo + hi)
        fits = count(mid).sum(axis=1, keepdims=True) <= total_slots
        hi = np.where(fits, mid, hi)
        lo = np.where(fits, lo, mid)
    counts = count(hi).astype(np.int64)
    return _fill_leftover(loads, counts, total_slots, max_count)


def minmax_counts(loads: np.ndarray, total_slots: int, max_count: int) -> np.ndarray:
    """Counts minimising the largest per-replica load ``max_e w_e / c_e``."""
    return family_counts(loads, total_slots, max_count, 1.0)


DEFAULT_BETAS = (1.0, 0.5, 0.0)


def _moves(loads: np.ndarray, counts: np.ndarray, usable: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replica transfers ``d -> e`` worth trying per layer.

    Receivers: the ``k`` largest replicas (``c < usable``).  Donors (``c >= 2``): the
    ``k`` largest replicas and the ``k`` whose remaining replicas would stay smallest.
    Returns ``(row, donor, receiver)`` arrays, one entry per move.
    """
    L, E = loads.shape
    per = loads / counts
    big = np.where(counts < usable, per, -np.inf)
    recv = np.argsort(-big, axis=1, kind="stable")[:, :k]
    recv_ok = np.take_along_axis(big, recv, axis=1) > -np.inf
    multi = counts >= 2
    don_big = np.argsort(np.where(multi, -per, np.inf), axis=1, kind="stable")[:, :k]
    after = np.where(multi, loads / np.maximum(counts - 1, 1), np.inf)
    don_small = np.argsort(after, axis=1, kind="stable")[:, :k]
    donors = np.concatenate([don_big, don_small], axis=1)
    don_ok = np.take_along_axis(multi, donors, axis=1)
    rows, dons, recs = [], [], []
    for l in range(L):
        d = np.unique(donors[l][don_ok[l]])
        e = recv[l][recv_ok[l]]
        dd, ee = np.meshgrid(d, e, indexing="ij")
        keep = dd != ee
        rows.append(np.full(int(keep.sum()), l))
        dons.append(dd[keep])
        recs.append(ee[keep])
    cat = lambda x: np.concatenate(x).astype(np.int64) if x else np.zeros(0, np.int64)  # noqa: E731
    return cat(rows), cat(dons), cat(recs)


def plan_placement(
    loads: np.ndarray,
    slots_per_gpu: np.ndarray,
    *,
    betas: tuple[float, ...] = DEFAULT_BETAS,
    drift: float = 0.1,
    scenarios: int = 8,
    seed: int = 0,
    swap_iters: int | None = None,
    partners: int = 8,
    in_sample_tolerance: float = 1e-3,
    climb_steps: int = 4,
    climb_width: int = 4,
    climb_gap: float = 2e-3,
    climb_budget: int = 1 << 17,
    factors: np.ndarray | None = None,
    kappa: float = 2.0,
    step_share: float = 0.0,
    robust_slack: float = 2e-3,
    robust_iters: int | None = None,
) -> Placement:
    """Plan replica counts and their GPUs for every layer.

    Args:
        loads: ``[layers, experts]`` non-negative loads (tokens routed per expert).
        slots_per_gpu: ``[G]`` slots each GPU offers per layer (memory limit).
        betas: count families tried (see ``family_counts``).
        drift: lognormal sigma of the per-expert drift the plan must survive; per
            layer the candidate kept is the one with the lowest mean maximum over
            ``scenarios`` drifted copies of ``loads``, among the candidates within
            ``in_sample_tolerance`` of the best in-sample maximum.
        seed: seed of those scenarios (fixed: the plan is deterministic).
        swap_iters: bound on swap rounds (default ``4 * smax + 64``).
        climb_steps, climb_width, climb_gap: replica-transfer hill climbing on layers
            whose maximum is more than ``climb_gap`` above the lower bound: each step
            tries moving one replica between the ``climb_width`` most relevant
            experts, re-packs every variant, keeps the best if it lowers the maximum.
        climb_budget: items re-packed per climbing step at most (bounds the time);
            when one layer's transfer pairs fit in it, pairs are tried too.
        factors: ``[layers, experts, R]`` shared load factors of the next steps (in
            load units; ``topology.load_factors`` from a planning trace).  Given, a
            final swap search balances each GPU's load plus ``kappa`` standard
            deviations of it: drift ``drift`` per expert, counting noise of a step
            ``step_share`` times the planning window, and the factors (co-moving
            experts spread over GPUs).  No GPU's planning load may pass its layer's
            maximum or ``(1 + robust_slack)`` times the lower bound, whichever is larger.
            ``robust_iters`` bounds its rounds (default: as ``swap_iters``).

    Returns:
        A ``Placement`` whose slot layout is ``slots_to_slot2gpu(slots_per_gpu)``.
    """
    loads = np.asarray(loads, dtype=np.float64)
    cap = np.asarray(slots_per_gpu, dtype=np.int64)
    if loads.ndim != 2 or cap.ndim != 1:
        raise UsageError(f"loads must be [layers, experts] and slots_per_gpu [G], found {loads.shape} and {cap.shape}")
    if not np.all(np.isfinite(loads)) or (loads < 0).any():
        raise UsageError("loads must be finite and non-negative")
    L, E = loads.shape
    G = cap.shape[0]
    if (cap < 0).any() or (cap > E).any():
        raise UsageError(f"slots per GPU must lie in [0, {E}] (a GPU never holds an expert twice)")
    S = int(cap.sum())
    usable = int(np.count_nonzero(cap))
    _check_counts_args(loads, S, usable)
    iters = 4 * int(cap.max()) + 64 if swap_iters is None else int(swap_iters)
    if factors is not None:
        factors = np.asarray(factors, dtype=np.float64)
        if factors.ndim != 3 or factors.shape[:2] != (L, E) or not np.all(np.isfinite(factors)):
            raise UsageError(f"factors must be finite [{L}, {E}, R], found {list(factors.shape)}")
    rng = np.random.default_rng([seed, 0xD21F7])
    scen = loads[None] * np.exp(drift * rng.standard_normal((scenarios, L, E)) - drift * drift / 2)

    best = None
    for beta in betas:
        counts = family_counts(loads, S, usable, beta)
        state = pack(loads, counts, cap, iters, partners)
        robust = scenario_max(state, counts, scen) if scenarios and len(betas) > 1 else None
        cand = (state, counts, state.max_load(), robust)
        best = cand if best is None else _merge(best, cand, in_sample_tolerance)
    state, counts = best[0], best[1]

    lb = lower_bound(loads, G, S)
    top = state.max_load()
    active = np.flatnonzero(top > lb * (1 + climb_gap))
    for _ in range(climb_steps if G > 1 else 0):
        if active.size == 0:
            break
        # the worst layers first, as many as the work budget allows; pairs of
        # transfers only where a layer's pairs fit in the budget on their own
        singles = 2 * climb_width * climb_width
        with_pairs = singles * (singles + 1) // 2 * S <= climb_budget
        per_layer = singles * (singles + 1) // 2 if with_pairs else singles
        room = max(1, climb_budget // (per_layer * S))
        active = active[np.argsort(-(top[active] / np.maximum(lb[active], 1e-300)), kind="stable")][:room]
        row, don, rec = _moves(loads[active], counts[active], usable, climb_width)
        if row.size == 0:
            break
        trial = counts[active][row]
        trial[np.arange(row.size), don] -= 1
        trial[np.arange(row.size), rec] += 1
        if with_pairs:
            # small problems: also every pair of transfers, which escapes the
            # two-step valleys single transfers cannot cross (docs/planner.md)
            i, j = np.triu_indices(row.size, 1)
            same = row[i] == row[j]
            i, j = i[same], j[same]
            pair = counts[active][row[i]]
            for a, b in ((don[i], rec[i]), (don[j], rec[j])):
                pair[np.arange(i.size), a] -= 1
                pair[np.arange(i.size), b] += 1
            ok = (pair >= 1).all(axis=1) & (pair <= usable).all(axis=1)
            row = np.concatenate([row, row[i[ok]]])
            trial = np.concatenate([trial, pair[ok]])
        tstate = pack(loads[active][row], trial, cap, 2 * int(cap.max()) + 16, partners)
        tmax = tstate.max_load()
        improved = []
        for i, l in enumerate(active):
            mine = np.flatnonzero(row == i)
            if mine.size == 0:
                continue
            j = mine[np.argmin(tmax[mine])]
            if tmax[j] < top[l] * (1 - 1e-9):
                take_rows(state, np.array([l]), tstate, np.array([j]))
                counts[l] = trial[j]
                top[l] = tmax[j]
                improved.append(l)
        active = np.array([l for l in improved if top[l] > lb[l] * (1 + climb_gap)], dtype=np.int64)

    if factors is not None and kappa > 0 and G > 1:
        # robust polish: balance mean + kappa sd of the next steps' GPU loads, never
        # letting a GPU's planning load pass max(its layer's maximum, (1 + slack) LB)
        limit = np.maximum(state.max_load(), lb * (1 + robust_slack))
        noise = (drift, 1.0 / step_share if step_share > 0 else 0.0)
        set_noise(state, counts, noise, kappa, factors, limit)
        swap_search(state, iters if robust_iters is None else int(robust_iters), partners=partners)

    order = np.lexsort((np.arange(S)[None, :].repeat(L, 0), state.item_gpu), axis=1)
    phy2log = np.take_along_axis(state.item2exp, order, axis=1)
    return Placement(phy2log, slots_to_slot2gpu(cap), G, E)


def _merge(a, b, tol):
    """Per layer, keep candidate ``b`` where it is better than ``a``."""
    sa, ca, ma, ra = a
    sb, cb, mb, rb = b
    floor = np.minimum(ma, mb) * (1 + tol)
    if ra is None:
        take = mb < ma
    else:
        take = (mb <= floor) & ((ma > floor) | (rb < ra))
    if not take.any():
        return a
    rows = np.flatnonzero(take)
    take_rows(sa, rows, sb, rows)
    ca = ca.copy()
    ca[take] = cb[take]
    return sa, ca, np.where(take, mb, ma), None if ra is None else np.where(take, rb, ra)
