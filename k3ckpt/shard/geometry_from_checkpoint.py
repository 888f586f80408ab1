"""The planner's ``MoEGeometry`` from a checkpoint's headers and its profile.

``moe_geometry(ckpt, format_id=...)`` reads no tensor data: the profile names the
MoE layers, the routed experts and top-k (``num_experts_per_token`` for K3, never the
generation key ``top_k``); the headers give every expert's tensors.

Bytes of one expert, in the planned format:

* the format the experts are stored in (K3: ``mxfp4-pack-quantized``): the sum of
  one expert's stored tensors, from the headers (K3: 17,547,264 B);
* any other registered format: each expert weight's logical shape ``[rows, K]``
  through ``get_format(id).part_specs(shape)`` (per-tensor side parts included);
* a 2.25-bpw format id not (yet) in the registry (``moet-w2``, ``k3ckpt-mx2``):
  9 bytes per 32 weights (one scale byte + 32 two-bit codes), stated in the notes.

Expert biases (gpt-oss) count as stored in every format.  Every expert must have the
same tensors (names, dtypes, shapes), and every MoE layer the config's expert count.

Dense bytes are all other text-model tensors (attention, shared experts, router,
dense layers, norms, embeddings, head); the vision tower is left out unless
``include_vision`` (a text deployment does not load it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidFileError, NotFoundError, UnsupportedError, UsageError
from .plan import MoEGeometry

__all__ = ["GeometryReport", "TWO_BIT_FORMATS", "check_format_id", "expert_format_bytes", "moe_geometry",
           "moe_geometry_report"]

# 2.25-bpw expert formats: 1 scale/selector byte + 32 two-bit codes (8 B) per 32 weights.
TWO_BIT_FORMATS = ("moet-w2", "k3ckpt-mx2")
_TWO_BIT_BLOCK, _TWO_BIT_BYTES = 32, 1 + 8


@dataclass(frozen=True)
class GeometryReport:
    """``moe_geometry``'s result and how its byte counts were found.

    Attributes:
        geometry: what the planner needs.
        source_storage: storage id(s) of the experts on disk, ``+``-joined.
        expert_weights: ``(name, logical shape)`` of one expert's weights (suffix
            after ``experts.E.``), sorted by name.
        bytes_from: ``headers``, ``registry`` or ``2.25-bpw rule``.
        vision_bytes: bytes of vision tensors (left out of ``dense_bytes`` unless
            ``include_vision``).
        notes: sentences for the plan's notes.
    """

    geometry: MoEGeometry
    source_storage: str
    expert_weights: tuple[tuple[str, tuple[int, ...]], ...]
    bytes_from: str
    vision_bytes: int
    notes: tuple[str, ...]


def _logical_shape(part: str, dtype: str, shape: tuple[int, ...], params: int) -> tuple[int, ...]:
    """Logical ``[..., K]`` of a stored part that carries the weights (``packed``,
    ``weight`` or gpt-oss ``blocks [..., K/32, 16]``)."""
    lead = shape[:-2] if part == "blocks" else shape[:-1]
    rows = math.prod(lead)
    if rows == 0 or params % rows:
        raise UnsupportedError(f"cannot tell the logical shape of a {dtype} {part} part {list(shape)}")
    return tuple(lead) + (params // rows,)


def expert_format_bytes(weights, format_id: str) -> tuple[int, str]:
    """Bytes of one expert stored as ``format_id``, and how they were found.

    Args:
        weights: ``(name, logical shape)`` of the expert's weights.
    """
    from ..formats import get_format

    try:
        fmt = get_format(format_id)
    except NotFoundError as exc:
        if format_id not in TWO_BIT_FORMATS:
            raise UsageError(str(exc).replace("unknown format", "unknown --format", 1)) from None
        total = 0
        for name, shape in weights:
            if shape[-1] % _TWO_BIT_BLOCK:
                raise UnsupportedError(f"{format_id} stores blocks of 32 along K; {name} has K = {shape[-1]}")
            total += math.prod(shape[:-1]) * (shape[-1] // _TWO_BIT_BLOCK) * _TWO_BIT_BYTES
        return total, "2.25-bpw rule"
    total = 0
    for name, shape in weights:
        total += sum(spec.nbytes for spec in fmt.part_specs(shape, name=name).values())
    return total, "registry"


def check_format_id(format_id: str) -> None:
    """Refuse an unknown format id before any work (2.25-bpw ids always pass)."""
    from ..formats import get_format

    if format_id in TWO_BIT_FORMATS:
        return
    try:
        get_format(format_id)
    except NotFoundError as exc:
        raise UsageError(str(exc).replace("unknown format", "unknown --format", 1)) from None


def moe_geometry_report(ckpt, *, format_id: str = "mxfp4-pack-quantized", include_vision: bool = False,
                        model_id: str | None = None) -> GeometryReport:
    """See the module docstring.  ``ckpt`` is an open ``Checkpoint`` (``.config``,
    ``.tensors``: name -> entry with ``dtype``, ``shape``, ``nbytes``).

    Raises:
        UsageError: unknown format id.
        UnsupportedError: not a mixture-of-experts model, or experts that differ in
            their tensors.
        InvalidFileError: headers that disagree with the config (expert counts).
    """
    from ..profiles import Role, detect, logical_params

    check_format_id(format_id)
    tensors = ckpt.tensors
    profile = detect(ckpt.config, tensors.keys())
    g = profile.geometry
    if g is None or not g.experts or not g.moe_layers or not g.top_k:
        raise UnsupportedError(f"{profile.display_name}: the config names no routed experts; nothing to place")
    per_expert: dict[tuple[int, int | None], list] = {}
    expert_bytes: dict[tuple[int, int | None], int] = {}
    storages: set[str] = set()  # of the weight parts (biases aside)
    bias_bytes: dict[tuple[int, int | None], int] = {}
    fused_e: dict[int, int] = {}
    total = vision = 0
    for name, entry in tensors.items():
        nb = int(entry.nbytes)
        total += nb
        r = profile.classify(name, entry.dtype)
        if r.role is Role.VISION:
            vision += nb
            continue
        if r.role is not Role.ROUTED_EXPERT or r.layer is None:
            continue
        key = (r.layer, r.expert)
        shape = tuple(int(d) for d in entry.shape)
        # the weight's name inside its expert, e.g. "w1.weight", so experts compare
        marker = f"experts.{r.expert}." if r.expert is not None else "experts."
        local = r.weight.split(marker, 1)[-1] if marker in r.weight else r.weight
        per_expert.setdefault(key, []).append((local, r.part, entry.dtype, shape,
                                               logical_params(r, entry.dtype, shape)))
        expert_bytes[key] = expert_bytes.get(key, 0) + nb
        if r.part == "bias":  # kept as stored in any format (gpt-oss expert biases)
            bias_bytes[key] = bias_bytes.get(key, 0) + nb
        else:
            storages.add(r.storage)
        if r.expert is None and shape:
            fused_e[r.layer] = max(fused_e.get(r.layer, 0), shape[0])
    if not per_expert:
        raise UnsupportedError(f"{profile.display_name}: the headers hold no routed-expert tensors")

    layers = sorted({layer for layer, _ in per_expert})
    counts = {layer: 0 for layer in layers}
    for layer, e in per_expert:
        counts[layer] += fused_e.get(layer, 1) if e is None else 1
    bad = [(layer, n) for layer, n in counts.items() if n != g.experts]
    if bad:
        layer, n = bad[0]
        raise InvalidFileError(f"layer {layer} has {n} routed experts in the headers; the config says {g.experts}",
                               file="config.json")
    missing = sorted(set(g.moe_layers) - set(layers))
    if missing:
        raise InvalidFileError(f"config names MoE layers {missing[:5]} that have no expert tensors in the headers",
                               file="config.json")

    # every expert must be the same tensors (names, parts, dtypes, shapes)
    signatures: dict[tuple, tuple[int, int | None]] = {}
    for key, items in per_expert.items():
        signatures.setdefault(tuple(sorted((a, b, c, d) for a, b, c, d, _ in items)), key)
    if len(signatures) > 1:
        (a, b) = list(signatures.values())[:2]
        raise UnsupportedError(f"experts differ in their tensors (layer {a[0]} expert {a[1]} vs layer {b[0]} "
                               f"expert {b[1]}); the planner needs one expert size")
    key0 = next(iter(per_expert))
    fused = key0[1] is None
    e_div = fused_e.get(key0[0], 1) if fused else 1
    weights = []
    for local, part, dtype, shape, params in sorted(per_expert[key0]):
        if part in ("packed", "weight", "blocks") and params:
            ls = _logical_shape(part, dtype, shape, params)
            weights.append((local, ls[1:] if fused else ls))
    weights = tuple(sorted(weights))
    source_storage = "+".join(sorted(storages))
    all_experts = sum(expert_bytes.values())
    notes = []
    if storages == {format_id}:
        per = expert_bytes[key0] // e_div
        how = "headers"
    else:
        per, how = expert_format_bytes(weights, format_id)
        per += bias_bytes.get(key0, 0) // e_div
        if how == "2.25-bpw rule":
            notes.append(f"{format_id} is not in the format registry here: expert bytes computed at 2.25 bits per "
                         f"weight (9 B per 32 weights), {per:,} B per expert")
        else:
            notes.append(f"expert bytes in {format_id} from the format registry: {per:,} B per expert "
                         f"(stored as {source_storage}: {expert_bytes[key0] // e_div:,} B)")
    dense = total - all_experts - (0 if include_vision else vision)
    hidden = g.expert_hidden or g.hidden_size
    if model_id is None:
        # hf:// sources carry the repo id; local folders only what the config names
        hub_ref = getattr(getattr(ckpt, "hub", None), "requested", None)
        model_id = getattr(hub_ref, "repo_id", None) or str((ckpt.config or {}).get("_name_or_path", "") or "")
    geometry = MoEGeometry(
        moe_layers=len(layers),
        experts=g.experts,
        top_k=g.top_k,
        expert_bytes=int(per),
        dense_bytes=int(dense),
        layer_ids=tuple(layers),
        model_id=model_id,
        # dispatch in MXFP8 (1 + 1/32 B per value) and combine in BF16 over the width experts read
        a2a_bytes_per_copy=hidden * 33 // 32 + hidden * 2,
    )
    return GeometryReport(geometry, source_storage, weights, how, vision, tuple(notes))


def moe_geometry(ckpt, *, format_id: str = "mxfp4-pack-quantized", include_vision: bool = False,
                 model_id: str | None = None) -> MoEGeometry:
    """The planner's geometry of ``ckpt`` with experts in ``format_id`` (see module doc)."""
    return moe_geometry_report(ckpt, format_id=format_id, include_vision=include_vision,
                               model_id=model_id).geometry
