"""Expert cache mode: HBM hot set, host-RAM tier, NVMe for the rest.

When the experts do not fit in the GPUs' HBM, every rank keeps a cache of experts
(keys ``layer_row * experts + expert``) for the MoE layers it runs.  Ranks split the
layers into contiguous ranges (pipeline order); the dense weights are split the
same way.  Per rank:

* tier 1, HBM: ``hbm_slots`` experts (free HBM / expert bytes);
* tier 2, host DRAM: ``host_slots`` experts (the node's DRAM share of the rank);
* NVMe: everything, read on a miss in both tiers.

Policies simulated on a held-out trace (all start warm from the same content,
the hottest experts of the planning loads, so the bound holds from step one):

* ``lru``: least recently used leaves.
* ``lfu``: lowest access count leaves (counts kept after eviction; ties: least
  recent).
* ``static``: the planning window's hottest keys, pinned; nothing else is admitted.
* ``hot-recent``: keys read within the last token (one token's reads of the rank
  plus one layer's) stay; among the others the coldest by planning load leaves.
  Routing persists from token to token, so a key just read is likely read again
  in the same layer of the next token; beyond that popularity ranks keys.
* ``recent-freq``: ``hot-recent`` whose heat moves with the trace: a key's score
  is its planning rate (reads per token) times ``RF_PRIOR_TOKENS`` plus the runs
  of it that started in the last ``RF_HORIZON_TOKENS`` tokens.  Topics change
  which experts are hot from document to document; recent run starts see that,
  the planning rate keeps the long-run order.  (A decayed frequency over a planning
  prior, as vLLM-Moet's GPU pool.)
* ``belady``: Belady's MIN (the resident needed farthest in the future leaves):
  the optimal hit rate of any policy that admits every miss, so a bound for
  ``lru``, ``lfu``, ``hot-recent`` and ``recent-freq``.
* ``belady-bypass``: MIN where the missing key may also stay out: the optimal hit
  rate of any policy (``static`` included) from the same start.

Tier 2 sees tier 1's miss stream and runs the same policy (``static``: the next
hottest keys).  Hit rates count all accesses.  docs/planner.md has the formulas of
the bandwidth ceilings.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import UsageError

__all__ = [
    "POLICIES",
    "lru_hits_ref",
    "lfu_hits_ref",
    "belady_hits_ref",
    "hot_recent_hits_ref",
    "recent_freq_hits_ref",
    "static_hits",
    "simulate",
    "TierStats",
    "RankCache",
    "split_layers",
    "rank_keys",
    "simulate_rank",
]

POLICIES = ("lru", "lfu", "static", "hot-recent", "recent-freq", "belady", "belady-bypass")
ONLINE = ("lru", "lfu", "static", "hot-recent", "recent-freq")

# recent-freq's constants, in tokens; chosen on traces of the planning window
# (docs/planner.md, "Cache mode"), never on the held-out trace
RF_HORIZON_TOKENS = 256
RF_PRIOR_TOKENS = 128
RF_UNIT = 1000  # score resolution: one run start


# ---------------------------------------------------------------------------
# plain-Python references (same signatures as the numba kernels)


def lru_hits_ref(keys: np.ndarray, capacity: int, initial: np.ndarray, nkeys: int) -> np.ndarray:
    """LRU hits of ``keys [n]`` after warming with ``initial`` (last = most recent)."""
    hits = np.zeros(len(keys), dtype=bool)
    if capacity <= 0:
        return hits
    cache: OrderedDict[int, None] = OrderedDict()
    for j, k in enumerate([*map(int, initial), *map(int, keys)]):
        if k in cache:
            if j >= len(initial):
                hits[j - len(initial)] = True
            cache.move_to_end(k)
            continue
        if len(cache) == capacity:
            cache.popitem(last=False)
        cache[k] = None
    return hits


def lfu_hits_ref(keys: np.ndarray, capacity: int, initial: np.ndarray, nkeys: int) -> np.ndarray:
    """LFU hits: evict the lowest (count, last use); counts persist; warm keys count 0."""
    hits = np.zeros(len(keys), dtype=bool)
    if capacity <= 0:
        return hits
    m = len(initial)
    count: dict[int, int] = {}
    last: dict[int, int] = {}
    inside: set[int] = set()
    for j, k in enumerate([*map(int, initial), *map(int, keys)]):
        if j >= m:
            count[k] = count.get(k, 0) + 1
        if k in inside:
            if j >= m:
                hits[j - m] = True
        else:
            if len(inside) == capacity:
                victim = min(inside, key=lambda v: (count.get(v, 0), last[v]))
                inside.remove(victim)
            inside.add(k)
        last[k] = j
    return hits


def _next_use(keys: np.ndarray) -> np.ndarray:
    n = len(keys)
    nxt = np.empty(n, dtype=np.int64)
    seen: dict[int, int] = {}
    for t in range(n - 1, -1, -1):
        nxt[t] = seen.get(int(keys[t]), n)
        seen[int(keys[t])] = t
    return nxt


def belady_hits_ref(keys: np.ndarray, capacity: int, initial: np.ndarray, nkeys: int, bypass: bool) -> np.ndarray:
    """Belady's MIN: the resident needed farthest ahead leaves (ties: the larger key).
    With ``bypass`` the new key is not admitted when it is needed last (ties: not admitted)."""
    n = len(keys)
    hits = np.zeros(n, dtype=bool)
    if capacity <= 0:
        return hits
    nxt = _next_use(keys)
    first: dict[int, int] = {}
    for t in range(n - 1, -1, -1):
        first[int(keys[t])] = t
    cur: dict[int, int] = {}
    for k in map(int, initial):
        if k in cur:
            continue
        if len(cur) == capacity:
            victim = max(cur, key=lambda v: (cur[v], v))
            del cur[victim]
        cur[k] = first.get(k, n)
    for t, k in enumerate(map(int, keys)):
        if k in cur:
            hits[t] = True
            cur[k] = int(nxt[t])
            continue
        if len(cur) == capacity:
            victim = max(cur, key=lambda v: (cur[v], v))
            if bypass and nxt[t] >= cur[victim]:
                continue
            del cur[victim]
        cur[k] = int(nxt[t])
    return hits


def hot_recent_hits_ref(
    keys: np.ndarray, capacity: int, initial: np.ndarray, heat: np.ndarray, window: int, nkeys: int
) -> np.ndarray:
    """hot-recent: among residents not used in the last ``window`` accesses the lowest
    ``heat`` leaves; when all are that recent, the least recently used.  Warm keys
    count as used long ago, in warm order (the last is the most recent)."""
    hits = np.zeros(len(keys), dtype=bool)
    if capacity <= 0:
        return hits
    last = _warm_recency(initial, capacity, window)
    for t, k in enumerate(map(int, keys)):
        if k in last:
            hits[t] = True
        elif len(last) == capacity:
            old = [v for v in last if last[v] < t - window]
            victim = min(old, key=lambda v: int(heat[v])) if old else min(last, key=last.__getitem__)
            del last[victim]
        last[k] = t
    return hits


def _warm_recency(initial: np.ndarray, capacity: int, window: int) -> dict[int, int]:
    """key -> last use of the warm content, as if read in order long before the trace (LRU on overflow)."""
    base = -(window + len(initial) + 2)
    last: dict[int, int] = {}
    for j, k in enumerate(map(int, initial)):
        if k not in last and len(last) == capacity:
            del last[min(last, key=last.__getitem__)]
        last[k] = base + j
    return last


def recent_freq_hits_ref(
    keys: np.ndarray,
    capacity: int,
    initial: np.ndarray,
    prior: np.ndarray,
    window: int,
    horizon: int,
    unit: int,
    nkeys: int,
) -> np.ndarray:
    """recent-freq: ``score[k] = prior[k] + unit * runs of k started in the last
    ``horizon`` accesses`` (a run starts at a read of a key that is not a resident
    read in the last ``window`` accesses).  Residents read in the last ``window``
    accesses stay; among the others the lowest ``(score, key)`` leaves; when all are
    that recent, the least recently used.  Warm keys count as read long ago."""
    hits = np.zeros(len(keys), dtype=bool)
    if capacity <= 0:
        return hits
    last = _warm_recency(initial, capacity, window)
    score = [int(x) for x in prior]
    starts: list[tuple[int, int]] = []
    first = 0
    for t, k in enumerate(map(int, keys)):
        while first < len(starts) and starts[first][0] < t - horizon:
            score[starts[first][1]] -= unit
            first += 1
        if not (k in last and last[k] >= t - window):
            score[k] += unit
            starts.append((t, k))
        if k in last:
            hits[t] = True
        elif len(last) == capacity:
            old = [v for v in last if last[v] < t - window]
            victim = min(old, key=lambda v: (score[v], v)) if old else min(last, key=last.__getitem__)
            del last[victim]
        last[k] = t
    return hits


def static_hits(keys: np.ndarray, pinned: np.ndarray, nkeys: int) -> np.ndarray:
    """Hits of a pinned set: ``keys`` that are in ``pinned``."""
    member = np.zeros(nkeys, dtype=bool)
    member[np.asarray(pinned, dtype=np.int64)] = True
    return member[np.asarray(keys, dtype=np.int64)]


def simulate(
    policy: str,
    keys: np.ndarray,
    capacity: int,
    order: np.ndarray,
    nkeys: int,
    *,
    window: int = 0,
    rates: np.ndarray | None = None,
    horizon: int = 0,
    reference: bool = False,
) -> np.ndarray:
    """``bool [n]`` hits of ``policy`` on ``keys`` (numba kernel unless ``reference``).

    Args:
        order: candidate keys in increasing heat (planning load); the warm content
            of every policy is its last ``capacity`` keys, ``static`` pins them and
            ``hot-recent`` ranks evictions by position in it.
        window: ``hot-recent``'s and ``recent-freq``'s recency window in accesses.
        rates: ``[nkeys]`` planning reads per token of every key (``recent-freq``'s
            prior, weighted by ``RF_PRIOR_TOKENS``); None: no prior.
        horizon: ``recent-freq``'s run-counting horizon in accesses.
    """
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    order = np.ascontiguousarray(order, dtype=np.int64)
    capacity = int(max(capacity, 0))
    warm = order[order.size - min(capacity, order.size) :]
    if policy not in POLICIES:
        raise UsageError(f"unknown cache policy {policy!r}; known: {', '.join(POLICIES)}")
    if keys.size and (keys.min() < 0 or keys.max() >= nkeys):
        raise UsageError(f"cache keys must lie in [0, {nkeys})")
    if policy == "static":
        return static_hits(keys, warm, nkeys)
    if policy == "recent-freq":
        r = np.zeros(nkeys) if rates is None else np.asarray(rates, dtype=np.float64)
        if r.shape != (nkeys,) or not np.all(np.isfinite(r)) or (r < 0).any():
            raise UsageError(f"rates must be [{nkeys}] finite non-negative reads per token")
        prior = np.round(r * (RF_PRIOR_TOKENS * RF_UNIT)).astype(np.int64)
        args = (keys, capacity, warm, prior, int(window), int(horizon), RF_UNIT, int(nkeys))
        if reference:
            return recent_freq_hits_ref(*args)
        from . import _cache_kernels as K

        return K.recent_freq_hits(*args)
    if policy == "hot-recent":
        # unique heat: keys outside ``order`` are colder than all in it, lower id colder
        heat = np.arange(nkeys, dtype=np.int64)
        heat[order] = nkeys + np.arange(order.size)
        args = (keys, capacity, warm, heat, int(window), int(nkeys))
        if reference:
            return hot_recent_hits_ref(*args)
        from . import _cache_kernels as K

        return K.hot_recent_hits(*args)
    args = (keys, capacity, warm, int(nkeys))
    bypass = policy == "belady-bypass"
    if reference:
        if policy.startswith("belady"):
            return belady_hits_ref(*args, bypass)
        return {"lru": lru_hits_ref, "lfu": lfu_hits_ref}[policy](*args)
    from . import _cache_kernels as K

    if policy.startswith("belady"):
        return K.belady_hits(*args, bypass)
    return {"lru": K.lru_hits, "lfu": K.lfu_hits}[policy](*args)


# ---------------------------------------------------------------------------
# ranks, tiers and reports


@dataclass(frozen=True)
class TierStats:
    """Hit rates of one policy on one rank (fractions of all accesses); with experts of
    different sizes also the bytes per token that miss HBM (``pcie_bytes``) and both
    tiers (``nvme_bytes``)."""

    policy: str
    accesses: int
    hbm_hit: float
    host_hit: float
    pcie_bytes: float | None = None
    nvme_bytes: float | None = None

    @property
    def nvme_rate(self) -> float:
        return max(0.0, 1.0 - self.hbm_hit - self.host_hit)

    def to_dict(self) -> dict:
        return {**asdict(self), "nvme_rate": self.nvme_rate}


@dataclass(frozen=True)
class RankCache:
    """One rank's cache layout.

    Attributes:
        rank: GPU rank; ``node`` its node.
        layer_start, layer_stop: MoE layer rows ``[start, stop)`` it runs.
        hbm_slots, host_slots: experts held in HBM and in host DRAM.
    """

    rank: int
    node: int
    layer_start: int
    layer_stop: int
    hbm_slots: int
    host_slots: int

    def __post_init__(self):
        if not (0 <= self.layer_start <= self.layer_stop):
            raise UsageError(f"rank {self.rank}: bad layer range [{self.layer_start}, {self.layer_stop})")
        if min(self.rank, self.node, self.hbm_slots, self.host_slots) < 0:
            raise UsageError(f"rank {self.rank}: negative field in cache layout")


def split_layers(layers: int, ranks: int) -> np.ndarray:
    """``[ranks + 1]`` boundaries of contiguous layer ranges, sizes differing by at most 1
    (the first ``layers % ranks`` ranks take one more)."""
    if ranks < 1:
        raise UsageError("need at least one rank")
    base, extra = divmod(layers, ranks)
    sizes = np.full(ranks, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate(([0], np.cumsum(sizes)))


def rank_keys(trace: np.ndarray, start: int, stop: int, experts: int) -> np.ndarray:
    """Access stream of layers ``[start, stop)``: token by token, layer by layer."""
    sub = np.asarray(trace[:, start:stop, :], dtype=np.int64)
    return (sub + (np.arange(start, stop) * experts)[None, :, None]).ravel()


def hot_order(loads: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Keys of layers ``[start, stop)`` in increasing planning load (ties: higher key
    first, so among equals the lower key counts as hotter)."""
    E = loads.shape[1]
    sub = loads[start:stop].ravel()
    keys = np.arange(start * E, stop * E)
    order = np.lexsort((-keys, sub))
    return keys[order]


def simulate_rank(
    trace: np.ndarray,
    loads: np.ndarray,
    cache: RankCache,
    policies: tuple[str, ...] = POLICIES,
    key_bytes: np.ndarray | None = None,
) -> dict[str, TierStats]:
    """Two-tier hit rates of every policy on one rank's part of a held-out trace.

    Args:
        trace: ``[tokens, moe_layers, top_k]`` held-out routing.
        loads: ``[moe_layers, experts]`` planning loads (warm start and static set).
        key_bytes: ``[moe_layers * experts]`` bytes of every expert when they differ:
            the stats then also count the missed bytes per token.
    """
    L, E = loads.shape
    nkeys = L * E
    keys = rank_keys(trace, cache.layer_start, cache.layer_stop, E)
    order = hot_order(loads, cache.layer_start, cache.layer_stop)
    c1 = min(cache.hbm_slots, order.size)
    c2 = min(cache.host_slots, order.size - c1)
    # a run continues in the same layer one token later: protect one token's reads
    # plus one layer's
    k = trace.shape[2]
    per_token = (cache.layer_stop - cache.layer_start) * k
    window = per_token + k - 1
    # planning reads per token of every key: a layer's loads sum to tokens x top-k
    tot = loads.sum(axis=1, keepdims=True)
    rates = np.divide(loads * k, tot, out=np.zeros_like(loads, dtype=np.float64), where=tot > 0).ravel()
    opts = dict(window=window, rates=rates, horizon=RF_HORIZON_TOKENS * per_token)
    out = {}
    for policy in policies:
        hit1 = simulate(policy, keys, c1, order, nkeys, **opts)
        miss = keys[~hit1]
        # tier 2 sees tier 1's misses; its warm content is the next hottest keys
        hit2 = (
            simulate(policy, miss, c2, order[: order.size - c1], nkeys, **opts)
            if c2
            else np.zeros(miss.size, dtype=bool)
        )
        n = max(keys.size, 1)
        missed = {}
        if key_bytes is not None:
            tokens = max(trace.shape[0], 1)
            missed = dict(pcie_bytes=float(key_bytes[miss].sum() / tokens),
                          nvme_bytes=float(key_bytes[miss[~hit2]].sum() / tokens))
        out[policy] = TierStats(policy, int(keys.size), float(hit1.sum() / n), float(hit2.sum() / n), **missed)
    return out
