"""What a checkpoint holds, from its headers alone (and, with ``scan``, its data).

``inspect_checkpoint`` returns an ``InspectReport``: the CLI renders it as text
or as the stable JSON documented in docs/inspect-json.md.  Nothing here reads
tensor data unless ``scan=True``; the scan is in ``k3ckpt.scan``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .columns import first_ids
from .completeness import empty_text, missing_experts_text
from .formats import ids
from .io import dtypes
from .io.header import paused_gc
from .io.reader import Checkpoint
from .profiles import detect
from .profiles.declared import coded_params, header_disagrees
from .profiles.roles import Role, TensorRole

JSON_SCHEMA_VERSION = 1

# Parts that store no parameters of their own: they qualify the codes of another part.
_OVERHEAD_PARTS = frozenset({"scale", "scale_inv", "scales", "shape", "global_scale", "scale_2", "zero_point",
                             "levels", "exp_base"})
# Elements per stored element for parts that pack several weights into one (storage not registered).
_PACKING = {("packed", "U8"): 2, ("packed", "I32"): 8, ("blocks", "U8"): 2}


def params_of(tr: TensorRole, dtype: str, numel: int) -> int:
    """Logical weights a tensor stores: for the codes of a registered format, as
    its table says (2 per byte of MXFP4/NVFP4 codes, 4 for moet-w2, 8 per INT4
    word), none for scales; ``numel`` otherwise (F4 headers count elements)."""
    if tr.part in _OVERHEAD_PARTS:
        return 0
    coded = coded_params(tr.storage, tr.part, numel)
    if coded is not None:
        return coded
    if tr.storage in (ids.NVFP4, ids.NVFP4_MODELOPT) and tr.part == "weight" and dtype == "U8":  # ModelOpt codes under a plain name
        return numel * 2
    return numel * _PACKING.get((tr.part, dtype), 1)


@dataclass(frozen=True)
class Bucket:
    """Tensors, logical parameters and bytes of one role or storage format."""

    key: str
    tensors: int
    params: int
    bytes: int

    @property
    def bits_per_weight(self) -> float | None:
        return None if self.params == 0 else self.bytes * 8 / self.params


@dataclass(frozen=True)
class ShardInfo:
    name: str
    size: int       # file bytes (header included)
    tensors: int


@dataclass(frozen=True)
class LayerInfo:
    index: int
    mlp: str                 # 'dense' | 'moe' | 'none'
    attention: str           # 'mla' | 'kda' | 'mha' | 'unknown'
    experts: int             # routed experts seen in the headers
    bytes: int


@dataclass(frozen=True)
class TensorRow:
    """One tensor as ``inspect --tensors`` lists it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str
    storage: str
    bytes: int
    shard: str


def tensor_rows(ckpt: Checkpoint, profile=None) -> tuple[TensorRow, ...]:
    """Every tensor with its role and storage, in shard and offset order."""
    profile = profile or detect(ckpt.config, ckpt.tensors.keys())
    return tuple(TensorRow(name, e.dtype, e.shape, tr.role.value, tr.storage, e.nbytes, e.shard)
                 for name, e in ckpt.tensors.items()
                 for tr in (profile.classify(name, e.dtype),))


@dataclass(frozen=True)
class InspectReport:
    source: str
    profile: str
    display_name: str
    model_name: str | None          # the profile's short name ("Kimi K3"), else config's _name_or_path
    model_type: str | None
    architectures: tuple[str, ...]
    num_layers: int | None
    dense_layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    experts_per_layer: int | None
    top_k: int | None
    shared_experts: int | None
    attention_layers: dict[str, int]
    tensor_count: int
    total_bytes: int
    params_total: int
    params_active: int | None
    routed_experts: int
    routed_expert_bytes: int
    routed_expert_params: int
    by_role: tuple[Bucket, ...]
    by_storage: tuple[Bucket, ...]
    shards: tuple[ShardInfo, ...]
    layers: tuple[LayerInfo, ...]
    unrecognised: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    scan: Any = None                 # k3ckpt.scan.ScanReport when scanned
    extra: dict[str, Any] = field(default_factory=dict)   # e.g. hub bytes fetched
    tensors: tuple[TensorRow, ...] | None = None           # with inspect(..., tensors=True)

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form (docs/inspect-json.md)."""
        out = asdict(self)
        out["schema_version"] = JSON_SCHEMA_VERSION
        for key in ("by_role", "by_storage"):
            out[key] = [dict(asdict(b), bits_per_weight=b.bits_per_weight) for b in getattr(self, key)]
        out["scan"] = None if self.scan is None else self.scan.to_json()
        if self.tensors is None:
            del out["tensors"]
        return out


def _bucket_list(acc: dict[str, list[int]]) -> tuple[Bucket, ...]:
    rows = [Bucket(k, *v) for k, v in acc.items()]
    return tuple(sorted(rows, key=lambda b: (-b.bytes, b.key)))


def _group_tensors(profile, headers) -> tuple[dict[tuple, list], list[tuple[np.ndarray, np.ndarray]], list[str]]:
    """Tensors sharing a name template, dtype, shape and layer share a role and a
    size: ``{(entry, layer, dtype, shape): [count, example name, bytes each]}``
    (a K3 has 497,220 tensors in ~2,700 such groups), the layer and expert
    columns of per-expert tensors (``_experts_per_layer``), and the names no rule
    recognises.  Works on whole
    columns: per tensor only its name and the index of its (dtype, shape)."""
    names: list[str] = []
    kind_ids: dict[tuple, int] = {}
    parts = []
    for h in headers:
        kinds_h, kind_of_h = h.kind_table()
        remap = np.array([kind_ids.setdefault(k, len(kind_ids)) for k in kinds_h], dtype=np.int64)
        names.extend(h.tensors)
        parts.append(remap[kind_of_h] if len(kind_of_h) else kind_of_h)
    if not names:
        return {}, [], []
    kind = np.concatenate(parts)
    kinds = list(kind_ids)
    dtype_ids: dict[str, int] = {}
    kind_dtype = np.array([dtype_ids.setdefault(d, len(dtype_ids)) for d, _ in kinds], dtype=np.int64)
    entries, which, layer, expert = profile.locate_many(names, kind_dtype[kind], list(dtype_ids))
    nbytes = [dtypes.lookup(d).nbytes(shape) for d, shape in kinds]
    # a k3ckpt config may store tensors of one template and shape in two formats (moet-w2 and
    # MXFP4 scales of a --target-bpw output): the declared format is part of the group
    declared = _declared_column(profile, names)
    span = int(layer.max()) + 2
    n_declared = int(declared.max()) + 1
    if layer.dtype != object and span * len(kinds) * len(entries) * n_declared < 1 << 62:
        _, first, count = np.unique(((which * len(kinds) + kind) * n_declared + declared) * span + (layer + 1),
                                    return_index=True, return_counts=True)
    else:   # huge layer numbers (hostile names): group without packing the columns into one integer
        first, ids = first_ids(zip(which.tolist(), kind.tolist(), layer.tolist(), declared.tolist()))
        count = np.bincount(ids)
    groups: dict[tuple, list] = {}
    for i, c in zip(first.tolist(), count.tolist()):
        k = int(kind[i])
        groups[(entries[which[i]], int(layer[i]) if layer[i] >= 0 else None, *kinds[k], int(declared[i]))] = [
            c, names[i], nbytes[k]]
    pair = (layer >= 0) & (expert >= 0)
    experts = [(layer[pair], expert[pair])]
    other = [i for i, e in enumerate(entries) if e.role is Role.OTHER]
    unrecognised = [names[i] for i in np.flatnonzero(np.isin(which, other)).tolist()] if other else []
    return groups, experts, unrecognised


def _experts_per_layer(columns: list[tuple[np.ndarray, np.ndarray]]) -> dict[int, int]:
    """Distinct routed experts per layer, from (layer, expert) column pairs: a
    K3's 245,000 per-expert tensors are 82,432 experts, counted by numpy."""
    layer = np.concatenate([c[0] for c in columns]) if columns else np.empty(0, dtype=np.int64)
    expert = np.concatenate([c[1] for c in columns]) if columns else np.empty(0, dtype=np.int64)
    if not len(layer):
        return {}
    span = int(expert.max()) + 1
    if layer.dtype == object or expert.dtype == object or int(layer.max()) * span >= 1 << 62:
        counts: dict[int, int] = defaultdict(int)   # numbers past int64 (hostile names): sets
        for lay, _ in set(zip(layer.tolist(), expert.tolist())):
            counts[lay] += 1
        return dict(counts)
    pairs = np.unique(layer * span + expert)   # one int64 key per (layer, expert)
    layers, counts_ = np.unique(pairs // span, return_counts=True)
    return dict(zip(layers.tolist(), counts_.tolist()))


def _declared_column(profile, names: list[str]) -> np.ndarray:
    """Per name, 1 + the index of its declared format (0: none), int64."""
    if not profile.declared:
        return np.zeros(len(names), dtype=np.int64)
    ids: dict[str, int] = {}
    get = profile.declared.get
    return np.array([0 if (hit := get(n)) is None else 1 + ids.setdefault(hit[0], len(ids)) for n in names],
                    dtype=np.int64)


def inspect_checkpoint(ckpt: Checkpoint, *, source: str | None = None) -> InspectReport:
    """Summarise ``ckpt`` from headers and config alone."""
    profile = detect(ckpt.config, ckpt.tensors.keys())
    geo = profile.geometry
    by_role: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    by_storage: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    per_layer_bytes: dict[int, int] = defaultdict(int)
    per_layer_expert_params: dict[int, int] = defaultdict(int)
    shard_tensors: dict[str, int] = defaultdict(int)
    routed_bytes = routed_params = total_bytes = params_total = vision_params = 0

    for shard, header in ckpt.headers.items():
        shard_tensors[shard] = len(header.tensors)
    with paused_gc():   # half a million short-lived names: collector passes over the headers cost seconds
        groups, experts, unrecognised = _group_tensors(profile, ckpt.headers.values())

    misdeclared = 0
    for (_, layer, dtype, shape, declared), (count, example, each) in groups.items():
        tr = profile.classify(example, dtype)
        if declared and header_disagrees(tr.storage, tr.part, dtype):
            misdeclared += count
        numel = 1
        for d in shape:
            numel *= d
        params = params_of(tr, dtype, numel) * count
        nbytes = each * count
        total_bytes += nbytes
        params_total += params
        for acc, key in ((by_role, tr.role.value), (by_storage, tr.storage)):
            row = acc[key]
            row[0] += count
            row[1] += params
            row[2] += nbytes
        if layer is not None:
            per_layer_bytes[layer] += nbytes
        if tr.role is Role.ROUTED_EXPERT:
            routed_bytes += nbytes
            routed_params += params
            if layer is not None:
                per_layer_expert_params[layer] += params
                if tr.expert is None and len(shape) >= 3 and tr.part in ("blocks", "scales", "weight", "bias"):
                    # fused [E, ...] tensors (gpt-oss): the leading dim counts the experts
                    experts.append((np.full(shape[0], layer, dtype=np.int64), np.arange(shape[0], dtype=np.int64)))
        elif tr.role is Role.VISION:
            vision_params += params
    per_layer_experts = _experts_per_layer(experts)

    warnings: list[str] = []
    if misdeclared:
        warnings.append(f"config.json's quantization_config declares {misdeclared} tensor(s) in a format whose "
                        "dtype the header does not have")
    params_active = None
    if geo is not None and geo.experts and geo.top_k:
        # A token runs top_k of each MoE layer's experts and every other text weight.
        active_routed = sum(p * geo.top_k / geo.experts for p in per_layer_expert_params.values())
        params_active = int(round(params_total - vision_params - routed_params + active_routed))
        seen = set(per_layer_experts.values())
        if seen and seen != {geo.experts}:
            warnings.append(f"config says {geo.experts} experts per layer, headers hold {sorted(seen)}")
    elif geo is not None:
        params_active = params_total - vision_params

    layers: list[LayerInfo] = []
    if geo is not None:
        dense, moe = set(geo.dense_layers), set(geo.moe_layers)
        for i in range(geo.num_layers):
            mlp = "moe" if i in moe else "dense" if i in dense else "none"
            layers.append(LayerInfo(i, mlp, geo.attention.get(i, "unknown"), per_layer_experts.get(i, 0),
                                    per_layer_bytes.get(i, 0)))
        extra_layers = sorted(set(per_layer_bytes) - set(range(geo.num_layers)))
        if extra_layers:
            warnings.append(f"headers hold layers {extra_layers} beyond the config's {geo.num_layers}")
    # what writers refuse (k3ckpt.completeness), said here as warnings: exit 2 with --strict
    bare = [layer.index for layer in layers if layer.mlp == "moe" and layer.experts == 0]
    if not ckpt.tensors:
        warnings.insert(0, empty_text(ckpt))
    elif bare and geo is not None and geo.experts:
        warnings.insert(0, missing_experts_text(bare, geo.experts))
    attention_layers: dict[str, int] = defaultdict(int)
    for layer in layers:
        attention_layers[layer.attention] += 1

    config = ckpt.config or {}
    return InspectReport(
        source=source or str(ckpt.root),
        profile=profile.id,
        display_name=profile.display_name,
        model_name=profile.model_name or (str(config.get("_name_or_path") or "") or None),
        model_type=config.get("model_type"),
        architectures=tuple(config.get("architectures") or ()),
        num_layers=None if geo is None else geo.num_layers,
        dense_layers=() if geo is None else tuple(geo.dense_layers),
        moe_layers=() if geo is None else tuple(geo.moe_layers),
        experts_per_layer=None if geo is None else geo.experts,
        top_k=None if geo is None else geo.top_k,
        shared_experts=None if geo is None else geo.shared_experts,
        attention_layers=dict(attention_layers),
        tensor_count=len(ckpt.tensors),
        total_bytes=total_bytes,
        params_total=params_total,
        params_active=params_active,
        routed_experts=sum(per_layer_experts.values()),
        routed_expert_bytes=routed_bytes,
        routed_expert_params=routed_params,
        by_role=_bucket_list(by_role),
        by_storage=_bucket_list(by_storage),
        shards=tuple(ShardInfo(s, ckpt.shard_size(s), shard_tensors.get(s, 0)) for s in ckpt.shards),
        layers=tuple(layers),
        unrecognised=tuple(unrecognised),
        warnings=tuple(warnings),
    )
