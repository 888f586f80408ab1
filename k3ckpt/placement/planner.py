"""``make_plan``: model geometry, devices and loads in, a ``Plan`` out.

It decides the mode from the numbers (docs/planner.md, "Mode"): when every layer's
experts fit in the GPUs' HBM after the reserved memory and the dense weights, it plans
a placement (EPLB-compatible arrays); otherwise a cache layout (HBM hot set, host-RAM
tier, NVMe).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import UsageError
from .cache import ONLINE, POLICIES, RankCache, hot_order, simulate_rank
from .devices import DeviceSet
from .loads import check_loads, check_trace
from .assign import balancedness, gpu_loads, lower_bound, plan_placement
from .spec import (
    FORMAT_ID,
    CacheLayout,
    CachePolicyReport,
    CacheReport,
    MoEGeometry,
    Plan,
    PlacementReport,
    placement_slot_limit,
)
from .topology import load_factors, order_bins, traffic

__all__ = ["make_plan", "slot_budget", "robust_options", "best_policy", "binding_ceiling"]


def slot_budget(
    geometry: MoEGeometry, devices: DeviceSet, slots_per_gpu: int | None, redundant: int | None
) -> np.ndarray:
    """``[G]`` slots per GPU for placement mode, checked against memory."""
    G, E = devices.num_gpus, geometry.experts
    limit = placement_slot_limit(geometry, devices)
    if slots_per_gpu is not None and redundant is not None:
        raise UsageError("give slots_per_gpu or redundant, not both")
    if slots_per_gpu is not None:
        if not isinstance(slots_per_gpu, (int, np.integer)) or slots_per_gpu < 1:
            raise UsageError(f"slots_per_gpu must be a positive integer, found {slots_per_gpu!r}")
        total = int(slots_per_gpu) * G
    elif redundant is not None:
        if not isinstance(redundant, (int, np.integer)) or redundant < 0:
            raise UsageError(f"redundant must be a non-negative integer, found {redundant!r}")
        total = E + int(redundant)
    else:
        total = min(E + E // 8, limit * G, E * G)
    if total < E:
        raise UsageError(f"{total} slots per layer cannot hold {E} experts")
    if total > E * G:
        raise UsageError(f"{total} slots exceed {E} experts x {G} GPUs (a GPU never holds an expert twice)")
    base = -(-total // G)
    if base > limit:
        need = geometry.dense_bytes + devices.reserved_bytes + base * geometry.expert_layer_bytes
        raise UsageError(
            f"{base} expert slots per GPU need {need / 1e9:.1f} GB (dense {geometry.dense_bytes / 1e9:.1f} GB"
            " + reserved "
            f"{devices.reserved_bytes / 1e9:.1f} GB + {base} x {geometry.expert_layer_bytes / 1e9:.2f} GB); "
            f"{devices.device.name} has {devices.device.hbm_bytes / 1e9:.1f} GB, room for {limit} slots"
        )
    from .assign import even_slots

    return even_slots(G, total)


def make_plan(
    geometry: MoEGeometry,
    devices: DeviceSet,
    loads,
    *,
    trace=None,
    heldout_trace=None,
    slots_per_gpu: int | None = None,
    redundant: int | None = None,
    mode: str = "auto",
    topology: bool = True,
    format_id: str = FORMAT_ID,
    host_fraction: float = 0.8,
    pcie_efficiency: float = 0.8,
    dense_stream_s: float | None = None,
    decoder_layers: int | None = None,
    pp_partition=None,
    **planner_options,
) -> Plan:
    """Plan expert placement or an expert cache for ``geometry`` on ``devices``.

    Args:
        loads: ``[moe_layers, experts]`` planning loads (validated).
        trace: optional planning routing trace ``[tokens, moe_layers, top_k]``: its
            co-activation orders GPUs by scale-up domain, and its shared load
            factors steer a robust polish of the packing (placement mode; at least
            64 tokens).
        heldout_trace: optional held-out trace: traffic figures (placement) or the
            cache simulation (cache mode) use it.
        slots_per_gpu / redundant: slot budget per layer: every GPU gets
            ``slots_per_gpu`` slots, or ``experts + redundant`` slots are spread evenly
            (the first ranks take one more).  Default: ``redundant = experts // 8``,
            cut to what memory allows.  Give at most one.
        mode: ``auto`` (placement when all experts fit in HBM), ``placement`` or ``cache``.
        topology: order GPUs by co-activation when a trace and several domains exist.
        host_fraction: share of host DRAM the cache's host tier may use.
        pcie_efficiency: achieved / nominal host-link bandwidth for the ceilings.
        dense_stream_s: cache mode, dense weights in host DRAM: seconds to stream
            them to the GPUs once per forward pass; bounds tokens/s at batch 1.
        decoder_layers, pp_partition: cache mode: the model's decoder layers
            (default ``max(layer_ids) + 1``) and their counts per rank (default
            vLLM's ``get_pp_indices`` split, ``placement.stages``); each rank runs the
            MoE layers among its decoder layers, as the runtime's stages create them.
        planner_options: passed to ``placement.plan_placement`` (``drift``, ...), and
            ``step_tokens`` (tokens of one forward step over all GPUs, default 512
            per GPU): with a planning trace the placement is polished for the load
            swings of such steps (``planner.robust_options``).

    Raises:
        UsageError: bad loads or traces, a slot budget that does not fit in memory,
            or a cache that cannot hold one token's experts.
    """
    if not isinstance(geometry, MoEGeometry) or not isinstance(devices, DeviceSet):
        raise UsageError("make_plan needs a MoEGeometry and a DeviceSet")
    loads = check_loads(loads, geometry)
    trace = None if trace is None else check_trace(trace, geometry)
    heldout_trace = None if heldout_trace is None else check_trace(heldout_trace, geometry)
    if mode not in ("auto", "placement", "cache"):
        raise UsageError(f"mode must be auto, placement or cache, found {mode!r}")
    fits = placement_slot_limit(geometry, devices) * devices.num_gpus >= geometry.experts
    if mode == "auto":
        mode = "placement" if fits else "cache"
    if mode == "placement":
        if not fits:
            raise UsageError(
                f"the experts do not fit in {devices.describe()}: each GPU has room for "
                f"{placement_slot_limit(geometry, devices)} slots after dense weights and reserved memory"
            )
        return _placement_plan(geometry, devices, loads, trace, heldout_trace, slots_per_gpu, redundant, topology,
                               format_id, planner_options)
    if slots_per_gpu is not None or redundant is not None or planner_options:
        raise UsageError("slot budgets and planner options apply to placement mode only")
    stages = (geometry.layer_ids[-1] + 1 if decoder_layers is None else int(decoder_layers), pp_partition)
    return _cache_plan(geometry, devices, loads, heldout_trace, format_id, host_fraction, pcie_efficiency,
                       dense_stream_s, stages)


FACTOR_BLOCK_TOKENS = 32
STEP_TOKENS_PER_GPU = 512


def robust_options(loads, trace, top_k: int, num_gpus: int, step_tokens: int | None = None) -> dict:
    """``plan_placement`` options for the robust polish from a planning trace: the
    trace's shared load factors scaled to a step of ``step_tokens`` (default 512 per
    GPU) and that step's share of the planning window; {} without a usable trace."""
    step = STEP_TOKENS_PER_GPU * num_gpus if step_tokens is None else int(step_tokens)
    if step < 1:
        raise UsageError(f"step_tokens must be a positive integer, found {step_tokens!r}")
    if trace is None or trace.shape[0] < 2 * FACTOR_BLOCK_TOKENS:
        return {}
    plan_tokens = float(np.asarray(loads).sum(axis=1).mean()) / top_k
    return {
        "factors": load_factors(trace, loads, step, block_tokens=FACTOR_BLOCK_TOKENS),
        "step_share": step / plan_tokens if plan_tokens > 0 else 0.0,
    }


def _placement_plan(geometry, devices, loads, trace, heldout, slots_per_gpu, redundant, topology, format_id, opts):
    spg = slot_budget(geometry, devices, slots_per_gpu, redundant)
    opts = dict(opts)
    step_tokens = opts.pop("step_tokens", None)
    if "factors" not in opts:
        opts.update(robust_options(loads, trace, geometry.top_k, devices.num_gpus, step_tokens))
    pl = plan_placement(loads, spg, **opts)
    domain = devices.gpu_domain()
    ordered = False
    if topology and trace is not None and domain.max() > 0:
        pl = order_bins(pl, domain, trace)
        ordered = True
    G, S = devices.num_gpus, int(spg.sum())
    gl = gpu_loads(pl, loads)
    lb = lower_bound(loads, G, S)
    tr = traffic(pl, loads, domain, geometry.top_k, geometry.a2a_bytes_per_copy,
                 heldout if heldout is not None else trace)
    report = PlacementReport(
        total_slots=S,
        redundant_slots=S - geometry.experts,
        min_slots_per_gpu=int(spg.min()),
        max_slots_per_gpu=int(spg.max()),
        balancedness=balancedness(gl),
        gap_to_lower_bound=float(gl.max(axis=1).sum() / lb.sum() - 1.0),
        max_gpu_memory_bytes=int(
            geometry.dense_bytes + devices.reserved_bytes + spg.max() * geometry.expert_layer_bytes
        ),
        hbm_bytes=devices.device.hbm_bytes,
        remote_domain_fraction=tr.remote_domain_fraction,
        remote_domains_per_token=tr.remote_domains_per_token,
        a2a_bytes_per_token=tr.a2a_bytes_per_token,
        remote_domain_bytes_per_token=tr.remote_domain_bytes_per_token,
        traffic_source=tr.source,
        colocated_replicas=pl.colocated_replicas(),
        topology_ordered=ordered,
    )
    assert report.max_gpu_memory_bytes <= devices.device.hbm_bytes
    return Plan(model=geometry, devices=devices, mode="placement", format_id=format_id, placement=pl,
                placement_report=report)


def _cache_layout(geometry, devices, loads, host_fraction, decoder_layers, partition):
    from .stages import moe_bounds

    G, L, E, eb = devices.num_gpus, geometry.moe_layers, geometry.experts, geometry.expert_bytes
    if not 0 <= host_fraction <= 1:
        raise UsageError(f"host_fraction must lie in [0, 1], found {host_fraction}")
    if G > L:
        raise UsageError(f"cache mode runs whole layers per GPU: {G} GPUs exceed {L} MoE layers")
    # pipeline stages as vLLM creates them (the runtime keys a stage's MoE layers by creation order)
    bounds = moe_bounds(geometry.layer_ids, decoder_layers, G, partition)
    dense_share = -(-geometry.dense_bytes // G)
    free = devices.device.hbm_bytes - devices.reserved_bytes - dense_share
    hbm = free // eb if free > 0 else 0
    if hbm < geometry.top_k and not geometry.mixed:   # mixed sizes: checked per rank below
        raise UsageError(
            f"cache mode: {devices.device.name} keeps {max(free, 0) / 1e9:.1f} GB after reserved memory and "
            f"{dense_share / 1e9:.1f} GB of dense weights per GPU: {hbm} experts, fewer than one token's "
            f"{geometry.top_k} in a layer"
        )
    per_node = devices.gpus_per_node
    host_budget = int(devices.host_dram_bytes * host_fraction) // per_node
    table = geometry.bytes_table()
    sizes = table.ravel()
    node = devices.gpu_node()
    ranks, preload = [], []
    for r in range(G):
        a, b = int(bounds[r]), int(bounds[r + 1])
        order = hot_order(loads, a, b)[::-1]  # hottest first
        # each tier holds the hottest experts that fit its bytes (one size: budget // expert_bytes)
        filled = np.cumsum(sizes[order])
        c1 = int(np.searchsorted(filled, free, side="right")) if free > 0 else 0
        if c1 < min(geometry.top_k, order.size):   # only mixed sizes get here (one size: checked above)
            raise UsageError(
                f"cache mode: {devices.device.name} keeps {max(free, 0) / 1e9:.1f} GB after reserved memory "
                f"and {dense_share / 1e9:.1f} GB of dense weights per GPU: rank {r} fits {c1} of its hottest "
                f"experts, fewer than one token's {geometry.top_k} in a layer")
        base = int(filled[c1 - 1]) if c1 else 0
        c2 = int(np.searchsorted(filled, base + host_budget, side="right")) - c1
        ranks.append(RankCache(r, int(node[r]), a, b, c1, c2))
        for tier, sel in ((0, order[:c1]), (1, order[c1 : c1 + c2])):
            preload.append(np.stack([np.full(sel.size, r), np.full(sel.size, tier), sel // E, sel % E], axis=1))
    # NVMe holds every expert a node's ranks run
    for n in range(devices.nodes):
        mine = [rc for rc in ranks if rc.node == n]
        spill = sum((rc.layer_stop - rc.layer_start) * E - rc.hbm_slots - rc.host_slots for rc in mine)
        need = sum(int(table[rc.layer_start : rc.layer_stop].sum()) for rc in mine)
        if spill > 0 and not devices.nvme:
            raise UsageError(
                f"cache mode: {spill} experts of node {n} fit neither in HBM nor in host DRAM, and no NVMe drives "
                f"were given"
            )
        caps = [d.capacity_bytes for d in devices.nvme]
        if spill > 0 and caps and all(c is not None for c in caps) and sum(caps) < need:
            raise UsageError(
                f"cache mode: node {n} NVMe holds {sum(caps) / 1e12:.2f} TB, its experts need {need / 1e12:.2f} TB"
            )
    return bounds, ranks, np.concatenate(preload).astype(np.int64)


def _ceilings(devices, ranks, per_rank, k, eb, pcie_efficiency):
    """Bytes per token and tokens/s ceilings of one policy (docs/planner.md)."""
    reads = np.array([(rc.layer_stop - rc.layer_start) * k * eb for rc in ranks], dtype=np.float64)
    nvme_b = np.array([s.nvme_bytes if s.nvme_bytes is not None else r * s.nvme_rate
                       for r, s in zip(reads, per_rank, strict=True)])
    pcie_b = np.array([s.pcie_bytes if s.pcie_bytes is not None else r * (1 - s.hbm_hit)
                       for r, s in zip(reads, per_rank, strict=True)])
    node = np.array([rc.node for rc in ranks])
    node_b = np.bincount(node, weights=nvme_b, minlength=devices.nodes)
    bw = devices.nvme_read_bw
    tps_nvme = min((bw / b if bw > 0 else 0.0) for b in node_b if b > 0) if (node_b > 0).any() else math.inf
    link = devices.device.host_link_bw * pcie_efficiency
    tps_pcie = min(link / b for b in pcie_b if b > 0) if (pcie_b > 0).any() else math.inf
    best = min(tps_nvme, tps_pcie)

    def fin(x):
        return None if math.isinf(x) else float(x)

    return float(nvme_b.sum()), float(pcie_b.sum()), fin(tps_nvme), fin(tps_pcie), fin(best)


def best_policy(rows):
    """The fastest policy: highest tokens/s ceiling (None = unbounded), ties by HBM hit
    rate, then host hit rate, then the order of the rows (``cache.POLICIES``).  A hit
    rate is only a means: a policy with more HBM hits may still move more bytes."""
    def key(ir):
        i, r = ir
        return (math.inf if r.tokens_per_s is None else r.tokens_per_s, r.hbm_hit, r.host_hit, -i)

    return max(enumerate(rows), key=key)[1]


def binding_ceiling(best, dense_stream_s: float | None = None) -> tuple[float | None, str]:
    """``(tokens/s, limit)``: the smallest of the policy's NVMe and PCIe ceilings and the
    dense stream at batch 1 (one forward pass every ``dense_stream_s`` seconds)."""
    limits = [(best.tokens_per_s_nvme, "nvme"), (best.tokens_per_s_pcie, "pcie")]
    if dense_stream_s:
        limits.append((1.0 / dense_stream_s, "dense-stream"))
    limits = [(x, name) for x, name in limits if x is not None]
    if not limits:
        return None, ""
    x, name = min(limits, key=lambda t: t[0])
    return float(x), name


def _cache_plan(geometry, devices, loads, heldout, format_id, host_fraction, pcie_efficiency, dense_stream_s=None,
                stages=None):
    from .stages import pp_counts

    decoder_layers, partition = stages or (geometry.layer_ids[-1] + 1, None)
    bounds, ranks, preload = _cache_layout(geometry, devices, loads, host_fraction, decoder_layers, partition)
    k, eb = geometry.top_k, geometry.expert_bytes
    from .cache import TierStats

    sizes = geometry.bytes_table().ravel() if geometry.mixed else None
    if heldout is not None:
        per_rank = [simulate_rank(heldout, loads, rc, key_bytes=sizes) for rc in ranks]
        names = POLICIES
    else:
        # no trace: the static hot set's share of the planning loads
        per_rank = []
        for rc in ranks:
            order = hot_order(loads, rc.layer_start, rc.layer_stop)[::-1]   # hottest first, as the tiers
            sub = loads.ravel()[order]
            tot = sub.sum()
            c1, c12 = rc.hbm_slots, rc.hbm_slots + rc.host_slots
            h1 = sub[:c1].sum() / tot if tot > 0 else 0.0
            h2 = sub[c1:c12].sum() / tot if tot > 0 else 0.0
            missed = {}
            if sizes is not None:
                # each layer's loads sum to tokens x top-k: a key's reads per token are
                # load x layers x top-k / total
                scale = (rc.layer_stop - rc.layer_start) * k / tot if tot > 0 else 0.0
                per_read = sub * sizes[order] * scale
                missed = dict(pcie_bytes=float(per_read[c1:].sum()), nvme_bytes=float(per_read[c12:].sum()))
            per_rank.append({"static": TierStats("static", 0, float(h1), float(h2), **missed)})
        names = ("static",)
    rows = []
    for name in names:
        stats = [pr[name] for pr in per_rank]
        w = np.array([(rc.layer_stop - rc.layer_start) for rc in ranks], dtype=np.float64)
        w = w / w.sum()
        hbm_hit = float(sum(wi * s.hbm_hit for wi, s in zip(w, stats, strict=True)))
        host_hit = float(sum(wi * s.host_hit for wi, s in zip(w, stats, strict=True)))
        nvme_b, pcie_b, t_nvme, t_pcie, t_all = _ceilings(devices, ranks, stats, k, eb, pcie_efficiency)
        rows.append(CachePolicyReport(name, hbm_hit, host_hit, max(0.0, 1 - hbm_hit - host_hit), nvme_b, pcie_b,
                                      t_nvme, t_pcie, t_all))
    online = [r for r in rows if r.policy in ONLINE]
    best = best_policy(online)
    bel = next((r for r in rows if r.policy == "belady"), None)
    ratio = (best.hbm_hit / bel.hbm_hit if bel.hbm_hit > 0 else 1.0) if bel else None
    tps, binding = binding_ceiling(best, dense_stream_s)
    report = CacheReport(
        hbm_slots=int(sum(rc.hbm_slots for rc in ranks)),
        host_slots=int(sum(rc.host_slots for rc in ranks)),
        active_experts_per_token=geometry.active_experts,
        simulated=heldout is not None,
        policies=tuple(rows),
        best_policy=best.policy,
        best_over_belady=ratio,
        tokens_per_s=tps,
        binding=binding,
        dense_stream_s=dense_stream_s,
    )
    layout = CacheLayout(
        layer_bounds=bounds,
        hbm_slots=np.array([rc.hbm_slots for rc in ranks]),
        host_slots=np.array([rc.host_slots for rc in ranks]),
        preload=preload,
        policy=best.policy,
        pp_partition=tuple(pp_counts(decoder_layers, devices.num_gpus, partition)),
    )
    return Plan(model=geometry, devices=devices, mode="cache", format_id=format_id, cache=layout, cache_report=report)
