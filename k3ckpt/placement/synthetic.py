"""Synthetic router statistics: expert loads and routing traces, deterministic by seed.

The model (docs/planner.md, "Synthetic loads"):

* Each layer ``l`` has base logits ``sigma_l * z`` (``z`` standard normal,
  ``sigma_l`` uniform in ``sigma_range``): a lognormal popularity whose tail sets
  max/mean and the share of the top 10 %.  A few "head" experts per layer get an
  extra boost (the hottest K3 experts take a few % of all selections) and a tiny
  fraction of experts is dead (never routed).
* ``topics`` topics each boost a random ``topic_share`` of every layer's experts by
  ``topic_boost`` (in logits).  Tokens of one topic pick those experts together:
  that is the co-activation structure, and documents of one topic in a trace give
  it temporal locality.
* A window (planning or held-out) has a topic mixture (Dirichlet with
  ``mix_concentration``) and a per-(layer, expert) lognormal drift of
  ``drift_sigma``.  Loads of a window are binomial draws from the inclusion
  probabilities of top-k routing, approximated by water-filling ``k * p`` under 1.
* Traces pick each token's top-k by Gumbel-top-k sampling from its topic's logits.

Everything is drawn from ``numpy.random.default_rng(seed)`` streams in a fixed
order, so the same arguments give the same arrays on every platform numpy supports.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UsageError

__all__ = [
    "SkewModel",
    "Popularity",
    "make_popularity",
    "inclusion_probs",
    "window_probs",
    "window_loads",
    "sample_trace",
    "skew_stats",
]


@dataclass(frozen=True)
class SkewModel:
    """Parameters of the synthetic router (defaults calibrated to K3's public skew)."""

    sigma_range: tuple[float, float] = (0.5, 1.0)
    head_experts: float = 2.0          # mean number of boosted head experts per layer (Poisson + 1)
    head_boost: tuple[float, float] = (0.3, 0.9)  # extra logits of head experts, uniform range
    dead_fraction: float = 15 / (92 * 896)  # K3: 15 of 92 x 896 never routed
    topics: int = 8
    topic_share: float = 0.08
    topic_boost: float = 1.2
    mix_concentration: float = 20.0
    drift_sigma: float = 0.1
    persistence: float = 0.6           # chance a trace slot keeps the previous token's expert

    def __post_init__(self):
        lo, hi = self.sigma_range
        if not (0 <= lo <= hi):
            raise UsageError(f"sigma_range must be 0 <= lo <= hi, found {self.sigma_range}")
        if self.topics < 1 or not (0 <= self.topic_share <= 1):
            raise UsageError("topics must be >= 1 and topic_share in [0, 1]")
        if self.mix_concentration <= 0 or self.drift_sigma < 0 or not (0 <= self.dead_fraction < 1):
            raise UsageError("mix_concentration > 0, drift_sigma >= 0 and 0 <= dead_fraction < 1 required")
        if not (0 <= self.persistence < 1):
            raise UsageError(f"persistence must lie in [0, 1), found {self.persistence}")


@dataclass(frozen=True, eq=False)
class Popularity:
    """Router logits of one synthetic model.

    Attributes:
        base: ``[layers, experts]`` base logits (``-inf`` for dead experts).
        topic: ``[topics, layers, experts]`` additive topic boosts.
        top_k: experts per token.
    """

    base: np.ndarray
    topic: np.ndarray
    top_k: int

    @property
    def layers(self) -> int:
        return self.base.shape[0]

    @property
    def experts(self) -> int:
        return self.base.shape[1]


def make_popularity(
    layers: int,
    experts: int,
    top_k: int,
    seed: int,
    model: SkewModel = SkewModel(),
    tiers: np.ndarray | None = None,
) -> Popularity:
    """Draw a model's router logits.

    Args:
        tiers: optional ``[layers, experts]`` integer ranks (higher = hotter), e.g. the
            number of REAP keep-lists an expert is in.  The same lognormal values are
            dealt out so that every expert of a higher tier is hotter than every
            expert of a lower one (ties inside a tier by the random draw).
    """
    if layers < 1 or experts < 1 or not (1 <= top_k <= experts):
        raise UsageError(f"need layers >= 1 and 1 <= top_k <= experts, found {layers}, {experts}, {top_k}")
    rng = np.random.default_rng([seed, 0x5EED])
    sigma = rng.uniform(*model.sigma_range, size=(layers, 1))
    z = rng.standard_normal((layers, experts))
    if tiers is not None:
        tiers = np.asarray(tiers)
        if tiers.shape != (layers, experts):
            raise UsageError(f"tiers must be [{layers}, {experts}], found {list(tiers.shape)}")
        # hottest z values to the highest tier; inside a tier keep the random order
        key = np.lexsort((rng.random((layers, experts)), -tiers), axis=1)
        zs = -np.sort(-z, axis=1)
        z = np.empty_like(z)
        np.put_along_axis(z, key, zs, axis=1)
    base = sigma * z
    heads = 1 + rng.poisson(max(model.head_experts - 1, 0), size=layers)
    boost = rng.uniform(*model.head_boost, size=(layers, experts))
    rank = np.argsort(np.argsort(-base, axis=1, kind="stable"), axis=1, kind="stable")
    base = base + np.where(rank < heads[:, None], boost, 0.0)
    dead = rng.random((layers, experts)) < model.dead_fraction
    dead[rank == 0] = False  # the hottest expert is never dead
    base = np.where(dead, -np.inf, base)
    chosen = rng.random((model.topics, layers, experts)) < model.topic_share
    topic = np.where(chosen, model.topic_boost, 0.0)
    return Popularity(base=base, topic=topic, top_k=top_k)


def inclusion_probs(logits: np.ndarray, top_k: int) -> np.ndarray:
    """``[..., experts]`` probability that a token picks each expert under top-k
    routing: ``min(1, t * p)`` with ``p = softmax(logits)`` and ``t`` chosen so the
    probabilities sum to ``top_k`` (water-filling; the hottest experts saturate at 1)."""
    logits = np.asarray(logits, dtype=np.float64)
    m = np.max(logits, axis=-1, keepdims=True)
    p = np.exp(logits - m)
    p /= p.sum(axis=-1, keepdims=True)
    # t lies in [k, k / smallest positive p]; bisect on log t
    pmin = np.min(np.where(p > 0, p, np.inf), axis=-1, keepdims=True)
    lo = np.full(p.shape[:-1] + (1,), np.log(top_k))
    hi = np.log(top_k / pmin) + 1e-9
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        over = np.minimum(1.0, np.exp(mid) * p).sum(axis=-1, keepdims=True) > top_k
        hi = np.where(over, mid, hi)
        lo = np.where(over, lo, mid)
    return np.minimum(1.0, np.exp(lo) * p)


def _window(pop: Popularity, seed: int, window: int, model: SkewModel):
    """Topic mixture ``[topics]`` and drift logits ``[layers, experts]`` of a window."""
    rng = np.random.default_rng([seed, 0xD1F7, window])
    mix = rng.dirichlet(np.full(pop.topic.shape[0], model.mix_concentration))
    drift = model.drift_sigma * rng.standard_normal(pop.base.shape) if window else np.zeros(pop.base.shape)
    return mix, drift


def window_probs(pop: Popularity, seed: int, window: int, model: SkewModel = SkewModel()) -> np.ndarray:
    """``[layers, experts]`` mean per-token inclusion probabilities of a window.

    Window 0 is the planning window (no drift); windows 1, 2, ... are later,
    held-out windows with their own topic mixture and lognormal drift.
    """
    mix, drift = _window(pop, seed, window, model)
    probs = np.zeros(pop.base.shape)
    for t in range(pop.topic.shape[0]):
        probs += mix[t] * inclusion_probs(pop.base + pop.topic[t] + drift, pop.top_k)
    # an expert saturated in every topic sums to 1 + rounding; binomial draws refuse p > 1
    return np.minimum(probs, 1.0)


def window_loads(
    pop: Popularity, tokens: int, seed: int, window: int = 0, model: SkewModel = SkewModel(), steps: int = 1
) -> np.ndarray:
    """Expert loads of a window: ``[layers, experts]`` counts (``[steps, layers,
    experts]`` when ``steps > 1``), each expert a binomial draw over ``tokens``."""
    if tokens < 1 or steps < 1:
        raise UsageError(f"tokens and steps must be >= 1, found {tokens} and {steps}")
    probs = window_probs(pop, seed, window, model)
    rng = np.random.default_rng([seed, 0x10AD, window])
    out = rng.binomial(tokens, np.broadcast_to(probs, (steps,) + probs.shape)).astype(np.float64)
    return out[0] if steps == 1 else out


def sample_trace(
    pop: Popularity,
    tokens: int,
    seed: int,
    window: int = 0,
    model: SkewModel = SkewModel(),
    doc_tokens: int = 256,
) -> np.ndarray:
    """A routing trace ``[tokens, layers, top_k]`` of int32 expert ids.

    Tokens come in documents (geometric lengths, mean ``doc_tokens``), each of one
    topic drawn from the window's mixture; a token's fresh experts are the Gumbel
    top-k of its topic's logits (drawn as successive picks without replacement).
    Temporal locality: inside a document, each of the ``top_k`` positions keeps the
    previous token's expert with probability ``model.persistence`` (runs of
    geometric length); a kept expert that collides with another position is replaced
    by the token's first unused fresh pick.
    """
    if tokens < 1 or doc_tokens < 1:
        raise UsageError(f"tokens and doc_tokens must be >= 1, found {tokens} and {doc_tokens}")
    mix, drift = _window(pop, seed, window, model)
    rng = np.random.default_rng([seed, 0x7ACE, window])
    topic_of = np.empty(tokens, dtype=np.int64)
    doc_start = np.zeros(tokens, dtype=bool)
    pos = 0
    while pos < tokens:
        n = int(rng.geometric(1.0 / doc_tokens))
        topic_of[pos : pos + n] = rng.choice(mix.shape[0], p=mix)
        doc_start[pos] = True
        pos += n
    L, E, k = pop.layers, pop.experts, pop.top_k
    M = pop.topic.shape[0]
    out = np.empty((tokens, L, k), dtype=np.int32)
    draws = 3 * k
    for l in range(L):
        # successive draws with replacement, first k distinct in draw order: the same
        # law as Gumbel-top-k (Plackett-Luce), far cheaper for k << E
        logits = pop.base[l][None, :] + drift[l][None, :] + pop.topic[:, l]  # [M, E]
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        cdf = np.cumsum(p, axis=1)
        cdf = cdf / cdf[:, -1:]
        cdf[:, -1] = 1.0
        flat = (cdf + np.arange(M)[:, None]).ravel()
        u = rng.random((tokens, draws)) + topic_of[:, None]
        cand = np.searchsorted(flat, u, side="right") - topic_of[:, None] * E
        cand = np.minimum(cand, E - 1)
        picked, ok = _first_distinct(cand, k)
        bad = np.flatnonzero(~ok)
        if bad.size:  # rare: too few distinct draws; Gumbel-top-k for these tokens
            score = logits[topic_of[bad]] + rng.gumbel(size=(bad.size, E))
            top = np.argpartition(-score, k - 1, axis=1)[:, :k]
            order = np.argsort(-np.take_along_axis(score, top, axis=1), axis=1, kind="stable")
            picked[bad] = np.take_along_axis(top, order, axis=1)
        if model.persistence > 0:
            picked = _persist(picked, doc_start, model.persistence, rng)
        out[:, l] = picked
    return out


def _persist(fresh: np.ndarray, doc_start: np.ndarray, rho: float, rng) -> np.ndarray:
    """Slot-wise runs: ``out[t, j] = fresh[s, j]`` with ``s`` the start of the run
    holding ``t`` (a run restarts with probability ``1 - rho`` and at documents)."""
    T, k = fresh.shape
    start = (rng.random((T, k)) >= rho) | doc_start[:, None]
    start[0] = True
    idx = np.where(start, np.arange(T)[:, None], 0)
    idx = np.maximum.accumulate(idx, axis=0)
    out = np.take_along_axis(fresh, idx, axis=0)
    srt = np.sort(out, axis=1)
    bad = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
    for t in bad:  # rare collisions: later positions take unused fresh picks
        row = out[t]
        seen: set[int] = set()
        taken = set(row.tolist())
        spare = [int(e) for e in fresh[t] if int(e) not in taken]
        for j in range(k):
            if int(row[j]) in seen:
                row[j] = spare.pop(0)
            seen.add(int(row[j]))
    return out


def _first_distinct(cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """First ``k`` distinct values of every row of ``cand [n, d]`` in row order, and
    whether the row had ``k`` distinct values."""
    n, d = cand.shape
    key = cand.astype(np.int64) * d + np.arange(d)
    srt = np.sort(key, axis=1)
    val = srt // d
    first = np.ones((n, d), dtype=bool)
    first[:, 1:] = val[:, 1:] != val[:, :-1]
    pos = np.where(first, srt % d, d)
    pos = np.sort(pos, axis=1)[:, :k]
    ok = pos[:, -1] < d
    picked = np.take_along_axis(cand, np.minimum(pos, d - 1), axis=1)
    return picked, ok


def skew_stats(loads: np.ndarray) -> dict[str, float]:
    """Skew figures comparable with K3_FACTS: per-layer max/mean (median, max), share
    of the top 10 % and 25 % (min, max), share of the hottest expert (mean), and
    the count of never-routed experts.

    Args:
        loads: ``[layers, experts]``.
    """
    loads = np.asarray(loads, dtype=np.float64)
    E = loads.shape[1]
    tot = loads.sum(axis=1)
    ok = tot > 0
    loads, tot = loads[ok], tot[ok]
    s = -np.sort(-loads, axis=1)
    share = np.cumsum(s, axis=1) / tot[:, None]
    top10 = share[:, max(1, round(0.10 * E)) - 1]
    top25 = share[:, max(1, round(0.25 * E)) - 1]
    ratio = s[:, 0] / (tot / E)
    return {
        "max_over_mean_median": float(np.median(ratio)),
        "max_over_mean_max": float(ratio.max()),
        "top10_share_min": float(top10.min()),
        "top10_share_max": float(top10.max()),
        "top25_share_min": float(top25.min()),
        "top25_share_max": float(top25.max()),
        "hottest_share_mean": float((s[:, 0] / tot).mean()),
        "never_routed": int(np.count_nonzero(loads == 0)),
    }
