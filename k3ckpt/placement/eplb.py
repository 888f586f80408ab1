"""DeepSeek's EPLB (expert-parallel load balancer), re-implemented in numpy.

Written from the published description of deepseek-ai/EPLB ``eplb.py`` (see
docs/planner.md, "Baseline"): it is our baseline, so it follows that algorithm
step for step, including its known limits (replicas are chosen before packing,
two replicas of one expert may share a GPU, every GPU gets exactly R/G slots).

Three pieces:

* ``balanced_packing``: cardinality-constrained LPT.  Items in descending order
  (ties: lower index first, a stable sort), each to the lightest pack that is not
  yet full (ties: lowest pack index).
* ``replicate_experts``: each extra slot goes to the expert with the largest
  current load per replica ``w / logcnt`` (ties: lowest expert index).
* ``rebalance_experts``: hierarchical policy (groups packed to nodes, replicas made
  inside each node, replicas packed to that node's GPUs) when
  ``num_groups % num_nodes == 0``, else the global policy, which is the hierarchical
  one with one group and one node.

The loops run over item positions and are vectorised over rows, which gives the
same result as one loop per row.
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError

__all__ = ["balanced_packing", "replicate_experts", "rebalance_experts", "rebalance_hierarchical"]


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of permutations ``perm [X, n]``."""
    inv = np.empty_like(perm)
    rows = np.arange(perm.shape[0])[:, None]
    inv[rows, perm] = np.arange(perm.shape[1])[None, :]
    return inv


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items.

    Args:
        weight: ``[X, n]`` item weights, one packing problem per row.
        num_packs: ``m``; ``n % m`` must be 0.

    Returns:
        ``pack_index [X, n]`` (pack of each item) and ``rank_in_pack [X, n]``
        (position of the item inside its pack, in placement order).
    """
    weight = np.asarray(weight, dtype=np.float64)
    rows, n = weight.shape
    if num_packs <= 0 or n % num_packs:
        raise UsageError(f"balanced_packing: {n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1:
        idx = np.broadcast_to(np.arange(n), (rows, n)).copy()
        return idx, np.zeros((rows, n), dtype=np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")
    pack_index = np.full((rows, n), -1, dtype=np.int64)
    rank_in_pack = np.full((rows, n), -1, dtype=np.int64)
    pack_weight = np.zeros((rows, num_packs))
    pack_items = np.zeros((rows, num_packs), dtype=np.int64)
    r = np.arange(rows)
    for pos in range(n):
        item = order[:, pos]
        masked = np.where(pack_items < per_pack, pack_weight, np.inf)
        pack = np.argmin(masked, axis=1)
        pack_index[r, item] = pack
        rank_in_pack[r, item] = pack_items[r, pack]
        pack_weight[r, pack] += weight[r, item]
        pack_items[r, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate ``n`` logical experts into ``num_phy`` physical ones, minimising the
    largest load per replica.

    Args:
        weight: ``[X, n]`` loads.
        num_phy: physical experts per row, ``>= n``.

    Returns:
        ``phy2log [X, num_phy]``, ``rank [X, num_phy]`` (replica index of each
        physical expert) and ``logcnt [X, n]``.
    """
    weight = np.asarray(weight, dtype=np.float64)
    rows, n = weight.shape
    if num_phy < n:
        raise UsageError(f"replicate_experts: {num_phy} physical slots cannot hold {n} experts")
    phy2log = np.empty((rows, num_phy), dtype=np.int64)
    rank = np.zeros((rows, num_phy), dtype=np.int64)
    phy2log[:, :n] = np.arange(n)
    logcnt = np.ones((rows, n), dtype=np.int64)
    r = np.arange(rows)
    for i in range(n, num_phy):
        redundant = np.argmax(weight / logcnt, axis=1)
        phy2log[:, i] = redundant
        rank[:, i] = logcnt[r, redundant]
        logcnt[r, redundant] += 1
    return phy2log, rank, logcnt


def rebalance_hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's hierarchical policy.

    Args:
        weight: ``[layers, experts]`` loads.

    Returns:
        ``phy2log [layers, num_physical]``, ``phyrank [layers, num_physical]``,
        ``logcnt [layers, experts]``.  Slot ``s`` lives on GPU
        ``s // (num_physical / num_gpus)``.
    """
    weight = np.asarray(weight, dtype=np.float64)
    layers, experts = weight.shape
    for what, ok in (
        (f"experts {experts} % groups {num_groups}", num_groups > 0 and experts % num_groups == 0),
        (f"groups {num_groups} % nodes {num_nodes}", num_nodes > 0 and num_groups % num_nodes == 0),
        (f"gpus {num_gpus} % nodes {num_nodes}", num_gpus > 0 and num_gpus % num_nodes == 0),
        (f"physical {num_physical} % gpus {num_gpus}", num_physical % num_gpus == 0),
    ):
        if not ok:
            raise UsageError(f"EPLB needs {what} == 0")
    group_size = experts // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_physical // num_gpus
    mlog_per_node = experts // num_nodes

    # (i) whole groups to nodes; mlog = expert id renumbered node by node
    tokens_per_group = weight.reshape(layers, num_groups, group_size).sum(-1)
    gpack, grank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (((gpack * groups_per_node + grank) * group_size)[:, :, None] + np.arange(group_size)).reshape(
        layers, experts
    )
    mlog2log = _inverse(log2mlog)

    # (ii) replicate inside each node
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(layers * num_nodes, mlog_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical // num_nodes)

    # (iii) replicas to the node's GPUs
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, axis=1)
    pack, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    phy2pphy = pack * phy_per_gpu + rank_in_pack
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    offsets = (np.arange(num_nodes) * mlog_per_node)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(layers, num_nodes, -1) + offsets).reshape(layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, axis=1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB entry point.

    Args:
        weight: ``[layers, experts]`` load statistics.
        num_replicas: physical slots ``R`` per layer, a multiple of ``num_gpus``.

    Returns:
        ``phy2log [layers, R]``, ``log2phy [layers, experts, maxlogcnt]`` (slot ids,
        -1 padded, replicas in rank order) and ``logcnt [layers, experts]``.
    """
    weight = np.asarray(weight, dtype=np.float64)
    layers, experts = weight.shape
    if num_groups > 0 and num_nodes > 0 and num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    maxcnt = int(logcnt.max())
    log2phy = np.full((layers, experts * maxcnt), -1, dtype=np.int64)
    rows = np.arange(layers)[:, None]
    log2phy[rows, phy2log * maxcnt + phyrank] = np.arange(num_replicas)[None, :]
    return phy2log, log2phy.reshape(layers, experts, maxcnt), logcnt
