"""The plan as data: the model geometry a planner reads and the placement or cache
layout it returns.  ``Plan`` is a frozen dataclass with ``to_json`` / ``from_json``;
the schema is docs/plan-json.md.  ``planner.make_plan`` builds one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from ..errors import UsageError
from ..formats.ids import MXFP4_PACK
from .devices import DeviceSet, DeviceSpec, NVMeDrive

__all__ = ["PLAN_VERSION", "MoEGeometry", "PlacementReport", "CachePolicyReport", "CacheReport", "CacheLayout",
           "Plan", "placement_slot_limit"]

PLAN_VERSION = 1
FORMAT_ID = MXFP4_PACK   # what the planner sizes experts in unless told otherwise (Kimi K3 as shipped)


@dataclass(frozen=True)
class MoEGeometry:
    """What the planner needs to know about a mixture-of-experts model.

    Attributes:
        moe_layers: number of MoE layers ``L`` (rows of every ``[layers, ...]`` array).
        experts: routed experts per layer ``E``.
        top_k: experts per token.
        expert_bytes: bytes of one expert (all its matrices and scales) on the
            device, in the planned format; with ``per_expert_bytes``, the largest.
        dense_bytes: bytes of everything else (attention, shared experts, dense
            layers, embeddings), replicated on every GPU in placement mode.
        layer_ids: model layer number of every MoE layer, ascending.
        model_id: free text (hub id).
        a2a_bytes_per_copy: dispatch + combine bytes of one (token, expert) copy.
        per_expert_bytes: ``[moe_layers][experts]`` bytes of every expert when they
            differ (mixed formats, e.g. a ``--target-bpw`` requant); None when every
            expert takes ``expert_bytes``.
    """

    moe_layers: int
    experts: int
    top_k: int
    expert_bytes: int
    dense_bytes: int
    layer_ids: tuple[int, ...]
    model_id: str = ""
    a2a_bytes_per_copy: int = 0
    per_expert_bytes: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        for what in ("moe_layers", "experts", "top_k", "expert_bytes"):
            v = getattr(self, what)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise UsageError(f"MoEGeometry.{what} must be a positive integer, found {v!r}")
        for what in ("dense_bytes", "a2a_bytes_per_copy"):
            v = getattr(self, what)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise UsageError(f"MoEGeometry.{what} must be a non-negative integer, found {v!r}")
        if self.top_k > self.experts:
            raise UsageError(f"top_k {self.top_k} exceeds {self.experts} experts")
        ids = tuple(int(i) for i in self.layer_ids)
        if len(ids) != self.moe_layers or any(i < 0 for i in ids) or list(ids) != sorted(set(ids)):
            raise UsageError(f"layer_ids must be {self.moe_layers} distinct ascending layer numbers")
        object.__setattr__(self, "layer_ids", ids)
        for what in ("moe_layers", "experts", "top_k", "expert_bytes", "dense_bytes", "a2a_bytes_per_copy"):
            object.__setattr__(self, what, int(getattr(self, what)))
        if self.per_expert_bytes is not None:
            table = _bytes_table(self.per_expert_bytes, self.moe_layers, self.experts)
            if int(table.max()) != self.expert_bytes:
                raise UsageError(f"MoEGeometry.expert_bytes must be the largest of per_expert_bytes "
                                 f"({int(table.max()):,}), found {self.expert_bytes:,}")
            # one size throughout is the plain case: keep a single representation of it
            mixed = bool((table != self.expert_bytes).any())
            object.__setattr__(self, "per_expert_bytes", tuple(map(tuple, table.tolist())) if mixed else None)

    @property
    def mixed(self) -> bool:
        """Experts differ in size (``per_expert_bytes`` is set)."""
        return self.per_expert_bytes is not None

    def bytes_table(self) -> np.ndarray:
        """``int64 [moe_layers, experts]`` bytes of every expert."""
        if self.per_expert_bytes is None:
            return np.full((self.moe_layers, self.experts), self.expert_bytes, dtype=np.int64)
        return np.array(self.per_expert_bytes, dtype=np.int64)

    @property
    def all_expert_bytes(self) -> int:
        """Bytes of every routed expert, one copy each."""
        if self.per_expert_bytes is None:
            return self.expert_bytes * self.experts * self.moe_layers
        return int(self.bytes_table().sum())

    @property
    def expert_layer_bytes(self) -> int:
        """Bytes of one slot across all MoE layers (a slot holds one expert per layer).
        Mixed sizes: each layer's slots are sized for its largest expert, as a runtime
        that moves experts between slots (EPLB rebalancing) must allocate them."""
        if self.per_expert_bytes is None:
            return self.expert_bytes * self.moe_layers
        return int(self.bytes_table().max(axis=1).sum())

    @property
    def active_experts(self) -> int:
        """Experts one token reads over all layers."""
        return self.moe_layers * self.top_k

    @classmethod
    def k3(cls, bytes_per_expert: int = 17_547_264) -> "MoEGeometry":
        """Kimi K3 (K3_FACTS): 92 MoE layers (1-92) x 896 experts, top-16; MXFP4 expert
        17,547,264 B; the rest of the text model 113,509,540,864 B; dispatch in the
        3584-wide latent: MXFP8 3584 x 33/32 + BF16 combine 3584 x 2 = 10,864 B a copy."""
        return cls(92, 896, 16, bytes_per_expert, 113_509_540_864, tuple(range(1, 93)), "moonshotai/Kimi-K3",
                   3584 * 33 // 32 + 3584 * 2)

    @classmethod
    def k2(cls, bytes_per_expert: int = 23_396_352) -> "MoEGeometry":
        """Kimi K2: 61 layers, layer 0 dense, 60 MoE layers x 384 experts, top-8; MXFP4
        expert 3 x 7168 x 2048 -> 23,396,352 B; non-expert weights ~11.75 B params in
        BF16 (estimate: MLA 64 heads, shared experts, dense layer 0, embeddings and
        head); dispatch 7168 x 33/32 + combine 7168 x 2 = 21,728 B a copy."""
        return cls(60, 384, 8, bytes_per_expert, 23_500_000_000, tuple(range(1, 61)), "moonshotai/Kimi-K2-Instruct",
                   7168 * 33 // 32 + 7168 * 2)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        if self.per_expert_bytes is None:
            del d["per_expert_bytes"]   # plans of one expert size read as before
        else:
            d["per_expert_bytes"] = [list(row) for row in self.per_expert_bytes]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MoEGeometry":
        _keys(d, cls, "model")
        return cls(**{**d, "layer_ids": tuple(d.get("layer_ids", ()))})


def _bytes_table(rows, layers: int, experts: int) -> np.ndarray:
    """``per_expert_bytes`` as an int64 array, checked: ``[layers, experts]`` positive integers."""
    try:
        table = np.array(rows, dtype=object)
    except (ValueError, TypeError):
        table = None
    if table is None or table.shape != (layers, experts):
        raise UsageError(f"MoEGeometry.per_expert_bytes must be [{layers}][{experts}] (MoE layers x experts)")
    flat = table.ravel()
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in flat):
        raise UsageError("MoEGeometry.per_expert_bytes must hold positive integers")
    return table.astype(np.int64)


def _keys(d, cls, where: str) -> None:
    if not isinstance(d, dict):
        raise UsageError(f"plan: '{where}' must be an object")
    names = {f.name for f in fields(cls) if f.init}
    extra = set(d) - names
    if extra:
        raise UsageError(f"plan: unknown keys {sorted(extra)} in '{where}'")


@dataclass(frozen=True)
class PlacementReport:
    """Placement figures (docs/planner.md, "Metrics").  Balancedness is vLLM's: sum
    over layers of mean GPU load / sum of max GPU load; the gap is sum max / sum lower
    bound - 1.  Traffic per token sums over MoE layers."""

    total_slots: int
    redundant_slots: int
    min_slots_per_gpu: int
    max_slots_per_gpu: int
    balancedness: float
    gap_to_lower_bound: float
    max_gpu_memory_bytes: int
    hbm_bytes: int
    remote_domain_fraction: float
    remote_domains_per_token: float
    a2a_bytes_per_token: float
    remote_domain_bytes_per_token: float
    traffic_source: str
    colocated_replicas: int
    topology_ordered: bool


@dataclass(frozen=True)
class CachePolicyReport:
    """One policy over all ranks (hit rates are fractions of all expert reads)."""

    policy: str
    hbm_hit: float
    host_hit: float
    nvme_rate: float
    nvme_bytes_per_token: float
    pcie_bytes_per_token: float
    tokens_per_s_nvme: float | None  # None: this resource sets no limit
    tokens_per_s_pcie: float | None
    tokens_per_s: float | None


@dataclass(frozen=True)
class CacheReport:
    """Cache figures; ``simulated`` is False when no held-out trace was given (then the
    only row is ``static``, estimated from the planning loads).

    ``best_policy`` is the online policy with the highest tokens/s ceiling (ties: higher
    HBM hit rate, then the order of ``cache.POLICIES``).  ``tokens_per_s`` is the binding
    ceiling: the smallest of the best policy's NVMe and PCIe ceilings and, with the dense
    weights in host DRAM, the dense stream at batch 1 (``dense_stream_s`` seconds a
    forward pass); ``binding`` names it (``nvme``, ``pcie``, ``dense-stream``, or ``""``
    when nothing limits)."""

    hbm_slots: int
    host_slots: int
    active_experts_per_token: int
    simulated: bool
    policies: tuple[CachePolicyReport, ...]
    best_policy: str
    best_over_belady: float | None
    tokens_per_s: float | None = None
    binding: str = ""
    dense_stream_s: float | None = None

    def policy(self, name: str) -> CachePolicyReport:
        for p in self.policies:
            if p.policy == name:
                return p
        raise KeyError(name)


@dataclass(frozen=True)
class CacheLayout:
    """Per-rank cache layout and the warm content.

    Attributes:
        layer_bounds: ``[G + 1]`` rank ``r`` runs MoE layer rows ``[b[r], b[r+1])``.
        hbm_slots, host_slots: ``[G]`` experts per rank in HBM / host DRAM.
        preload: ``[n, 4]`` rows ``(rank, tier, layer_row, expert)``, tier 0 = HBM,
            1 = host; hottest first within a rank and tier.
        policy: the policy the plan recommends (best simulated, else ``static``).
        pp_partition: decoder layers per rank (dense ones included), as vLLM's
            ``get_pp_indices`` or ``VLLM_PP_LAYER_PARTITION`` splits them; ``()`` in
            plans written before it was recorded.
    """

    layer_bounds: np.ndarray
    hbm_slots: np.ndarray
    host_slots: np.ndarray
    preload: np.ndarray
    policy: str
    pp_partition: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("layer_bounds", "hbm_slots", "host_slots", "preload"):
            a = np.asarray(getattr(self, name), dtype=np.int64)
            a.setflags(write=False)
            object.__setattr__(self, name, a)
        b = self.layer_bounds
        if b.ndim != 1 or b.size < 2 or b[0] != 0 or np.any(np.diff(b) < 0):
            raise UsageError("cache layer_bounds must start at 0 and not decrease")
        G = b.size - 1
        if self.hbm_slots.shape != (G,) or self.host_slots.shape != (G,):
            raise UsageError(f"cache slot arrays must have one entry per rank ({G})")
        if (self.hbm_slots < 0).any() or (self.host_slots < 0).any():
            raise UsageError("cache slot counts must be >= 0")
        p = self.preload
        if p.size and (p.ndim != 2 or p.shape[1] != 4):
            raise UsageError("cache preload rows are (rank, tier, layer_row, expert)")
        if p.size:
            if p[:, 0].min() < 0 or p[:, 0].max() >= G:
                raise UsageError(f"cache preload names rank {int(p[:, 0].max())}; there are {G} ranks")
            if not np.isin(p[:, 1], (0, 1)).all():
                raise UsageError("cache preload tier must be 0 (HBM) or 1 (host)")
            lo, hi = b[p[:, 0]], b[p[:, 0] + 1]
            if ((p[:, 2] < lo) | (p[:, 2] >= hi)).any():
                raise UsageError("cache preload names a layer its rank does not run")
            for tier, cap in ((0, self.hbm_slots), (1, self.host_slots)):
                n = np.bincount(p[p[:, 1] == tier, 0], minlength=G)
                if (n > cap).any():
                    raise UsageError("cache preload holds more experts than the tier has slots")
        pp = tuple(int(c) for c in self.pp_partition)
        if pp and (len(pp) != G or min(pp) < 1):
            raise UsageError(f"cache pp_partition must hold one positive count per rank ({G})")
        object.__setattr__(self, "pp_partition", pp)

    def vllm_pp_partition(self) -> str | None:
        """``VLLM_PP_LAYER_PARTITION`` for this layout's stages, or None where vLLM's own split
        (``get_pp_indices``) already gives them."""
        from .stages import partition_text, pp_counts

        counts = list(self.pp_partition)
        if len(counts) > 1 and counts != pp_counts(sum(counts), len(counts)):
            return partition_text(counts)
        return None
        from .cache import POLICIES

        if self.policy not in POLICIES:
            raise UsageError(f"cache policy {self.policy!r} unknown; known: {', '.join(POLICIES)}")


def _device_set_to_json(ds: DeviceSet) -> dict:
    return ds.to_dict()


def _device_set_from_json(d: dict) -> DeviceSet:
    _keys(d, DeviceSet, "devices")
    dev = d.get("device")
    _keys(dev, DeviceSpec, "devices.device")
    nvme = []
    for x in d.get("nvme", []):
        _keys(x, NVMeDrive, "devices.nvme")
        nvme.append(NVMeDrive(**x))
    return DeviceSet(**{**d, "device": DeviceSpec(**dev), "nvme": tuple(nvme)})


@dataclass(frozen=True, eq=False)
class Plan:
    """A complete plan (see docs/plan-json.md).

    Exactly one of ``placement`` (with ``placement_report``) and ``cache`` (with
    ``cache_report``) is set, as ``mode`` says.
    """

    model: MoEGeometry
    devices: DeviceSet
    mode: str
    format_id: str = FORMAT_ID
    placement: object = None  # placement.Placement
    placement_report: PlacementReport | None = None
    cache: CacheLayout | None = None
    cache_report: CacheReport | None = None
    version: int = PLAN_VERSION
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.version != PLAN_VERSION:
            raise UsageError(f"plan version {self.version} is not supported (this k3ckpt reads {PLAN_VERSION})")
        if self.mode not in ("placement", "cache"):
            raise UsageError(f"plan mode must be 'placement' or 'cache', found {self.mode!r}")
        G = self.devices.num_gpus
        if self.mode == "placement":
            from .assign import Placement

            pl = self.placement
            if not isinstance(pl, Placement) or self.placement_report is None or self.cache is not None:
                raise UsageError("a placement plan needs placement arrays and a placement report, and no cache")
            if pl.layers != self.model.moe_layers or pl.experts != self.model.experts:
                raise UsageError(
                    f"placement is {pl.layers} layers x {pl.experts} experts; the model has "
                    f"{self.model.moe_layers} x {self.model.experts}"
                )
            if pl.num_gpus != G:
                raise UsageError(f"placement names {pl.num_gpus} ranks; the device set has {G}")
        else:
            c = self.cache
            if not isinstance(c, CacheLayout) or self.cache_report is None or self.placement is not None:
                raise UsageError("a cache plan needs a cache layout and a cache report, and no placement")
            if c.hbm_slots.shape[0] != G:
                raise UsageError(f"cache layout has {c.hbm_slots.shape[0]} ranks; the device set has {G}")
            if c.layer_bounds[-1] != self.model.moe_layers:
                raise UsageError(
                    f"cache layout covers {int(c.layer_bounds[-1])} layers; the model has {self.model.moe_layers}"
                )
            if c.preload.size and c.preload[:, 3].max() >= self.model.experts:
                raise UsageError(
                    f"cache preload names expert {int(c.preload[:, 3].max())}; the model has {self.model.experts}"
                )
        object.__setattr__(self, "notes", tuple(self.notes))

    # -- JSON ---------------------------------------------------------------

    def to_dict(self) -> dict:
        out = {
            "version": self.version,
            "kind": "k3ckpt-plan",
            "model": self.model.to_dict(),
            "format_id": self.format_id,
            "bytes_per_expert": self.model.expert_bytes,
            "devices": _device_set_to_json(self.devices),
            "mode": self.mode,
            "notes": list(self.notes),
            "placement": None,
            "cache": None,
            "metrics": None,
        }
        if self.mode == "placement":
            pl = self.placement
            out["placement"] = {
                "num_gpus": pl.num_gpus,
                "slot2gpu": pl.slot2gpu.tolist(),
                "phy2log": pl.phy2log.tolist(),
                "log2phy": pl.log2phy.tolist(),
                "logcnt": pl.logcnt.tolist(),
            }
            out["metrics"] = asdict(self.placement_report)
        else:
            c = self.cache
            out["cache"] = {
                "policy": c.policy,
                "layer_bounds": c.layer_bounds.tolist(),
                "hbm_slots": c.hbm_slots.tolist(),
                "host_slots": c.host_slots.tolist(),
                "preload": c.preload.tolist(),
                "pp_partition": list(c.pp_partition),
            }
            out["metrics"] = asdict(self.cache_report)
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if not isinstance(d, dict) or d.get("kind") != "k3ckpt-plan":
            raise UsageError("not a k3ckpt plan (missing \"kind\": \"k3ckpt-plan\")")
        allowed = {"version", "kind", "model", "format_id", "bytes_per_expert", "devices", "mode", "notes",
                   "placement", "cache", "metrics"}
        extra = set(d) - allowed
        if extra:
            raise UsageError(f"plan: unknown keys {sorted(extra)}")
        try:
            version = d["version"]
            if version != PLAN_VERSION:
                raise UsageError(f"plan version {version!r} is not supported (this k3ckpt reads {PLAN_VERSION})")
            model = MoEGeometry.from_dict(d["model"])
            if d.get("bytes_per_expert", model.expert_bytes) != model.expert_bytes:
                raise UsageError("plan: bytes_per_expert disagrees with model.expert_bytes")
            devices = _device_set_from_json(d["devices"])
            mode = d["mode"]
            kw = dict(model=model, devices=devices, mode=mode, format_id=str(d.get("format_id", FORMAT_ID)),
                      version=version, notes=tuple(d.get("notes", ())))
            if mode == "placement":
                kw.update(_placement_from_json(d.get("placement"), d.get("metrics"), devices.num_gpus, model))
            elif mode == "cache":
                kw.update(_cache_from_json(d.get("cache"), d.get("metrics")))
            return cls(**kw)
        except KeyError as exc:
            raise UsageError(f"plan: missing key {exc}") from None
        except TypeError as exc:
            raise UsageError(f"plan: malformed entry ({exc})") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"plan is not valid JSON: {exc}") from None
        return cls.from_dict(data)


def _int_array(x, name: str, ndim: int) -> np.ndarray:
    try:
        a = np.asarray(x)
    except (ValueError, TypeError):
        raise UsageError(f"plan: {name} is not a rectangular array") from None
    if a.dtype == object or (a.size and not np.issubdtype(a.dtype, np.integer)) or a.ndim != ndim:
        raise UsageError(f"plan: {name} must be a {ndim}-D integer array, found {a.dtype} {list(a.shape)}")
    return a.astype(np.int64)


def _placement_from_json(p, metrics, num_gpus: int, model: MoEGeometry) -> dict:
    from .assign import Placement

    if not isinstance(p, dict):
        raise UsageError("plan: 'placement' must be an object in placement mode")
    extra = set(p) - {"num_gpus", "slot2gpu", "phy2log", "log2phy", "logcnt"}
    if extra:
        raise UsageError(f"plan: unknown keys {sorted(extra)} in 'placement'")
    if p["num_gpus"] != num_gpus:
        raise UsageError(f"plan: placement names {p['num_gpus']} ranks; the device set has {num_gpus}")
    phy2log = _int_array(p["phy2log"], "phy2log", 2)
    slot2gpu = _int_array(p["slot2gpu"], "slot2gpu", 1)
    L, E = model.moe_layers, model.experts
    if phy2log.shape[0] != L:
        raise UsageError(f"plan: phy2log has {phy2log.shape[0]} layers; the model has {L} MoE layers")
    if "logcnt" in p:
        logcnt = _int_array(p["logcnt"], "logcnt", 2)
        if logcnt.shape != (L, E):
            raise UsageError(f"plan: logcnt is {list(logcnt.shape)}, the model needs [{L}, {E}]")
    pl = Placement(phy2log, slot2gpu, num_gpus, E)
    if "logcnt" in p and not np.array_equal(logcnt, pl.logcnt):
        raise UsageError("plan: logcnt does not match phy2log")
    if "log2phy" in p:
        log2phy = _int_array(p["log2phy"], "log2phy", 3)
        if log2phy.shape != pl.log2phy.shape or not np.array_equal(log2phy, pl.log2phy):
            raise UsageError("plan: log2phy is not the inverse of phy2log")
    _keys(metrics, PlacementReport, "metrics")
    return {"placement": pl, "placement_report": PlacementReport(**metrics)}


def _cache_from_json(c, metrics) -> dict:
    if not isinstance(c, dict):
        raise UsageError("plan: 'cache' must be an object in cache mode")
    extra = set(c) - {"policy", "layer_bounds", "hbm_slots", "host_slots", "preload", "pp_partition"}
    if extra:
        raise UsageError(f"plan: unknown keys {sorted(extra)} in 'cache'")
    pre = c.get("preload", [])
    layout = CacheLayout(
        layer_bounds=_int_array(c["layer_bounds"], "layer_bounds", 1),
        hbm_slots=_int_array(c["hbm_slots"], "hbm_slots", 1),
        host_slots=_int_array(c["host_slots"], "host_slots", 1),
        preload=_int_array(pre, "preload", 2) if len(pre) else np.zeros((0, 4), dtype=np.int64),
        policy=c["policy"],
        pp_partition=tuple(_int_array(c.get("pp_partition", []), "pp_partition", 1).tolist()),
    )
    _keys(metrics, CacheReport, "metrics")
    rows = []
    for r in metrics.get("policies", []):
        _keys(r, CachePolicyReport, "metrics.policies")
        rows.append(CachePolicyReport(**r))
    report = CacheReport(**{**metrics, "policies": tuple(rows)})
    return {"cache": layout, "cache_report": report}


def placement_slot_limit(geometry: MoEGeometry, devices: DeviceSet) -> int:
    """Most expert slots (per layer) one GPU can hold in placement mode:
    ``(HBM - reserved - dense) // (expert_bytes * moe_layers)``, at least 0."""
    free = devices.device.hbm_bytes - devices.reserved_bytes - geometry.dense_bytes
    return max(0, free // geometry.expert_layer_bytes)
