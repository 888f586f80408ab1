"""Routed experts as units: which tensors make up each expert, and its size.

Works on headers alone (``Checkpoint.tensors`` or any mapping of name -> entry
with ``dtype``, ``shape`` and optionally ``nbytes``).  Fused tensors that hold
every expert of a layer (gpt-oss ``*_blocks [E, ...]``) form one group
``(layer, None)``; their per-expert size is the fused size divided by E.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..formats import ids
from ..io import dtypes
from .base import Profile, _dtype_of
from .declared import coded_params
from .roles import Role, TensorRole

ExpertKey = tuple[int, "int | None"]


def _resolve(tensors: Mapping[str, Any], profile: Profile | None) -> Profile:
    if profile is not None:
        return profile
    from .detect import detect

    return detect(None, tensors.keys())


def expert_groups(tensors: Mapping[str, Any], profile: Profile | None = None) -> dict[ExpertKey, list[str]]:
    """``{(layer, expert): [names in the mapping's order]}`` for every routed
    expert tensor.  ``profile`` defaults to one detected from the names."""
    prof = _resolve(tensors, profile)
    out: dict[ExpertKey, list[str]] = {}
    for name, entry in tensors.items():
        r = prof.classify(name, _dtype_of(entry))
        if r.role is Role.ROUTED_EXPERT and r.layer is not None:
            out.setdefault((r.layer, r.expert), []).append(name)
    return out


def _shape_of(entry: Any) -> tuple[int, ...]:
    shape = getattr(entry, "shape", None)
    if shape is None and isinstance(entry, (tuple, list)) and len(entry) >= 2:
        shape = entry[1]
    if shape is None:
        raise TypeError(f"expert sizes need shapes; got an entry without one ({type(entry).__name__})")
    return tuple(int(d) for d in shape)


def _nbytes_of(entry: Any, dtype: str, shape: tuple[int, ...]) -> int:
    nb = getattr(entry, "nbytes", None)
    if isinstance(nb, int):
        return nb
    n = dtypes.lookup(dtype).nbytes(shape)
    assert n is not None, (dtype, shape)
    return n


def logical_params(role: TensorRole, dtype: str, shape: tuple[int, ...]) -> int:
    """Model parameters a tensor stores: the elements of the logical weight
    its codes encode (from the format table: two per U8 byte for FP4, four for
    moet-w2, eight per I32 word for INT4),
    its numel for plain weights and biases, and 0 for scales and shapes."""
    numel = 1
    for d in shape:
        numel *= d
    coded = coded_params(role.storage, role.part, numel)
    if coded is not None:
        return coded
    if role.part in ("packed", "blocks"):
        if dtype == "I32":
            return numel * 8
        if dtype == "U8":
            return numel * 2
    if role.part in ("weight", "bias"):
        if role.storage == ids.NVFP4_MODELOPT and dtype == "U8":  # ModelOpt codes under a plain name
            return numel * 2
        return numel
    return 0


@dataclass(frozen=True)
class ExpertStats:
    layers: tuple[int, ...]            # MoE layers with routed experts
    experts_per_layer: dict[int, int]  # layer -> experts (E of fused tensors)
    count: int                         # all routed experts
    total_bytes: int
    bytes_per_expert: int | None       # None when experts differ in size
    params_per_expert: int | None
    min_bytes: int
    max_bytes: int


def expert_stats(tensors: Mapping[str, Any], profile: Profile | None = None) -> ExpertStats:
    """Counts, bytes and parameters of the routed experts, from headers."""
    prof = _resolve(tensors, profile)
    sizes: dict[ExpertKey, int] = {}
    params: dict[ExpertKey, int] = {}
    fused_e: dict[int, int] = {}
    for name, entry in tensors.items():
        dtype = _dtype_of(entry)
        r = prof.classify(name, dtype)
        if r.role is not Role.ROUTED_EXPERT or r.layer is None:
            continue
        shape = _shape_of(entry)
        key = (r.layer, r.expert)
        sizes[key] = sizes.get(key, 0) + _nbytes_of(entry, dtype, shape)
        params[key] = params.get(key, 0) + logical_params(r, dtype, shape)
        if r.expert is None and shape:
            fused_e[r.layer] = max(fused_e.get(r.layer, 0), shape[0])
    per: dict[int, int] = {}
    unit_bytes: list[int] = []
    unit_params: list[int] = []
    for (layer, expert), nb in sizes.items():
        if expert is None:
            e = fused_e.get(layer, 1) or 1
            per[layer] = per.get(layer, 0) + e
            unit_bytes.append(nb // e)
            unit_params.append(params[(layer, expert)] // e)
        else:
            per[layer] = per.get(layer, 0) + 1
            unit_bytes.append(nb)
            unit_params.append(params[(layer, expert)])
    uniform_b = unit_bytes[0] if unit_bytes and len(set(unit_bytes)) == 1 else None
    uniform_p = unit_params[0] if unit_params and len(set(unit_params)) == 1 else None
    return ExpertStats(
        layers=tuple(sorted(per)),
        experts_per_layer=dict(sorted(per.items())),
        count=sum(per.values()),
        total_bytes=sum(sizes.values()),
        bytes_per_expert=uniform_b,
        params_per_expert=uniform_p,
        min_bytes=min(unit_bytes, default=0),
        max_bytes=max(unit_bytes, default=0),
    )
