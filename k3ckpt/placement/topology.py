"""Topology: dispatch traffic of a placement, and co-activation-aware GPU order.

Traffic model (docs/planner.md, "Traffic"): a token starts on a GPU chosen
uniformly at random; its copy for expert ``e`` goes to one of ``e``'s ``c``
replicas, each with probability ``1 / c`` (the even split of the load model).
Dispatch is deduplicated per scale-up domain (one send per remote domain, then
forwarding inside it, as DeepEP does across nodes), and combine mirrors it.

* ``remote_domain_fraction``: share of (token, expert) copies served outside the
  token's domain, without dedup.
* ``remote_domains``: expected distinct remote domains a token reaches per MoE
  layer, summed over layers (with a routing trace; else experts are taken as
  picked independently with probability ``min(1, k * w_e / sum w)``).
* bytes per token: copies that leave the source GPU times the bytes of one copy
  (all-to-all volume), and remote domains times the same (scale-out volume).

Topology-aware order: packing decides which replicas share a GPU ("bins"); which
GPU holds which bin does not change any GPU's load.  ``order_bins`` permutes bins
between GPUs of equal slot count so that bins whose experts fire together share a
domain (Kernighan-Lin swaps on the bins' co-activation), which lowers
``remote_domains`` at exactly the same balance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from .assign import Placement

__all__ = ["Traffic", "traffic", "order_bins", "domain_fractions", "load_factors"]


@dataclass(frozen=True)
class Traffic:
    remote_domain_fraction: float
    remote_domains_per_token: float
    a2a_bytes_per_token: float
    remote_domain_bytes_per_token: float
    source: str  # "trace" or "independent"


def load_factors(
    trace: np.ndarray, loads: np.ndarray, step_tokens: int, *, block_tokens: int = 64, rank: int = 8
) -> np.ndarray:
    """``[layers, experts, rank]`` shared load factors of a planning trace, in the
    units of ``loads``.

    The trace is cut into blocks of ``block_tokens``; per layer the top ``rank``
    principal components of the block-by-expert counts are the directions in which
    expert loads move together (topics: experts that fire for the same kind of
    text).  Each column is scaled to the standard deviation of that component over
    a step of ``step_tokens`` (blocks taken as independent), then to planning units
    (``loads`` sum to tokens x top-k per layer).  ``plan_placement(factors=...)``
    spreads such co-moving experts over GPUs.
    """
    trace = np.asarray(trace)
    loads = np.asarray(loads, dtype=np.float64)
    T, L, k = trace.shape
    E = loads.shape[1]
    nb = T // block_tokens
    if nb < 2 or rank < 1 or step_tokens < 1:
        raise UsageError(
            f"load factors need >= 2 blocks of {block_tokens} tokens (the trace has {T}), rank >= 1 and "
            f"step_tokens >= 1, found {rank} and {step_tokens}"
        )
    R = min(rank, nb - 1)
    blk = np.repeat(np.arange(nb), block_tokens)[:, None]
    X = np.empty((L, nb, E))
    for l in range(L):
        flat = (blk * E + trace[: nb * block_tokens, l, :]).ravel()
        X[l] = np.bincount(flat, minlength=nb * E).reshape(nb, E)
    X -= X.mean(axis=1, keepdims=True)
    # top components from the small [nb, nb] Gram matrix of every layer
    lam, U = np.linalg.eigh(X @ X.transpose(0, 2, 1))
    lam, U = lam[:, ::-1][:, :R], U[:, :, ::-1][:, :, :R]
    lam = np.maximum(lam, 0.0)
    V = X.transpose(0, 2, 1) @ U / np.sqrt(np.maximum(lam, 1e-300))[:, None, :]  # [L, E, R] unit columns
    sd_block = np.sqrt(lam / (nb - 1))
    plan_tokens = loads.sum(axis=1) / k  # [L]
    scale = sd_block * (plan_tokens[:, None] / np.sqrt(step_tokens * block_tokens))
    out = np.zeros((L, E, rank))
    out[:, :, :R] = V * scale[:, None, :]
    return out


def domain_fractions(placement: Placement, gpu_domain: np.ndarray) -> np.ndarray:
    """``[layers, experts, domains]`` share of each expert's replicas in each domain."""
    D = int(gpu_domain.max()) + 1
    L, S = placement.phy2log.shape
    E = placement.experts
    dom = gpu_domain[placement.slot2gpu]
    flat = ((np.arange(L)[:, None] * E + placement.phy2log) * D + dom[None, :]).ravel()
    q = np.bincount(flat, minlength=L * E * D).reshape(L, E, D).astype(np.float64)
    return q / placement.logcnt[:, :, None]


def traffic(
    placement: Placement,
    loads: np.ndarray,
    gpu_domain: np.ndarray,
    top_k: int,
    bytes_per_copy: int,
    trace: np.ndarray | None = None,
    max_tokens: int = 2048,
) -> Traffic:
    """Expected dispatch traffic of ``placement`` (see module doc).

    Args:
        loads: ``[layers, experts]`` (weights the copy fractions).
        gpu_domain: ``[G]`` scale-up domain of every rank.
        trace: optional ``[tokens, layers, top_k]``; its first ``max_tokens`` tokens
            are used.
    """
    loads = np.asarray(loads, dtype=np.float64)
    gpu_domain = np.asarray(gpu_domain, dtype=np.int64)
    G = placement.num_gpus
    D = int(gpu_domain.max()) + 1
    w_src = np.bincount(gpu_domain, minlength=D) / G  # source domain odds
    q = domain_fractions(placement, gpu_domain)  # [L, E, D]
    L, E = loads.shape
    local = (q * w_src[None, None, :]).sum(axis=2)  # [L, E] chance a copy stays in its domain
    tot = loads.sum()
    remote_frac = float(((1 - local) * loads).sum() / tot) if tot > 0 else 0.0
    fan = 0.0
    if trace is not None:
        tr = np.asarray(trace[:max_tokens], dtype=np.int64)
        for l in range(L):
            miss = np.prod(1.0 - q[l][tr[:, l, :]], axis=1)  # [T, D] no copy lands in d
            reach = 1.0 - miss
            fan += float((reach.sum(axis=1) - reach @ w_src).mean())
        source = "trace"
    else:
        tl = loads.sum(axis=1, keepdims=True)
        pi = np.minimum(1.0, top_k * loads / np.where(tl > 0, tl, 1.0))  # [L, E]
        with np.errstate(divide="ignore"):
            logmiss = np.log1p(-np.minimum(pi[:, :, None] * q, 1.0 - 1e-15)).sum(axis=1)  # [L, D]
        reach = 1.0 - np.exp(logmiss)
        fan = float((reach.sum(axis=1) - reach @ w_src).sum())
        source = "independent"
    # copies leaving the source GPU: 1 - 1/G for every copy (a GPU holds at most one
    # replica of an expert), counted per token over all layers
    copies_off_gpu = L * top_k * (1.0 - 1.0 / G)
    return Traffic(
        remote_domain_fraction=remote_frac,
        remote_domains_per_token=fan,
        a2a_bytes_per_token=copies_off_gpu * bytes_per_copy,
        remote_domain_bytes_per_token=fan * bytes_per_copy,
        source=source,
    )


def _bin_affinity(trace_l: np.ndarray, phy2log_l: np.ndarray, slot2gpu: np.ndarray, logcnt_l: np.ndarray, G: int):
    """``[G, G]`` expected co-activation between GPU bins of one layer (zero diagonal)."""
    E = logcnt_l.shape[0]
    member = np.zeros((E, G))
    member[phy2log_l, slot2gpu] = 1.0 / logcnt_l[phy2log_l]
    v = member[trace_l].sum(axis=1)  # [T, G]
    a = v.T @ v
    np.fill_diagonal(a, 0.0)
    return a


def order_bins(
    placement: Placement,
    gpu_domain: np.ndarray,
    trace: np.ndarray,
    max_tokens: int = 2048,
    max_swaps: int | None = None,
) -> Placement:
    """Permute GPU bins (per layer) so that co-activated experts share scale-up domains.

    Only GPUs with equal slot counts trade bins, so every GPU load multiset and
    therefore the balance is unchanged.  Per layer, the best bin swap between two
    domains (largest gain in same-domain co-activation; ties: lowest pair index) is
    applied until none gains or ``max_swaps`` (default ``2 * G``) is reached.

    Args:
        trace: ``[tokens, layers, top_k]`` planning trace.
    """
    gpu_domain = np.asarray(gpu_domain, dtype=np.int64)
    G = placement.num_gpus
    if int(gpu_domain.max()) == 0 or G < 2:
        return placement
    spg = placement.slots_per_gpu()
    starts = np.concatenate(([0], np.cumsum(spg)[:-1]))
    if not _allowed(spg, gpu_domain).any():
        return placement
    limit = 2 * G if max_swaps is None else int(max_swaps)
    tr = np.asarray(trace[:max_tokens], dtype=np.int64)
    D = int(gpu_domain.max()) + 1
    phy2log = placement.phy2log.copy()
    for l in range(placement.layers):
        a = _bin_affinity(tr[:, l, :], placement.phy2log[l], placement.slot2gpu, placement.logcnt[l], G)
        dom = gpu_domain.copy()  # domain of each bin; bins start on their own GPU
        onehot = np.zeros((G, D))
        onehot[np.arange(G), dom] = 1.0
        to_dom = a @ onehot  # [G bins, D] affinity of bin to each domain
        for _ in range(limit):
            own = to_dom[np.arange(G), dom]
            gain = (to_dom[:, dom] - own[:, None]) + (to_dom[:, dom].T - own[None, :]) - 2 * a
            gain = np.where(_allowed(spg, dom), gain, -np.inf)
            idx = int(np.argmax(gain))
            i, j = divmod(idx, G)
            if not gain[i, j] > 1e-9 * max(float(a.max()), 1e-300):
                break
            di, dj = dom[i], dom[j]
            to_dom[:, di] += a[:, j] - a[:, i]
            to_dom[:, dj] += a[:, i] - a[:, j]
            dom[i], dom[j] = dj, di
        # bins now sit in domains ``dom``; give each bin a GPU of its domain and size
        target = np.empty(G, dtype=np.int64)
        for d in range(D):
            for cap in np.unique(spg):
                bins = np.flatnonzero((dom == d) & (spg == cap))
                gpus = np.flatnonzero((gpu_domain == d) & (spg == cap))
                target[bins] = gpus
        row = placement.phy2log[l]
        for b in range(G):
            g = target[b]
            phy2log[l, starts[g] : starts[g] + spg[g]] = row[starts[b] : starts[b] + spg[b]]
    return Placement(phy2log, placement.slot2gpu, G, placement.experts)


def _allowed(spg: np.ndarray, dom: np.ndarray) -> np.ndarray:
    """Bins may trade when they hold the same number of slots and sit in different domains."""
    return (spg[:, None] == spg[None, :]) & (dom[:, None] != dom[None, :])
