"""The planner's ``MoEGeometry`` from a checkpoint's headers and its profile.

``moe_geometry(ckpt, format_id=...)`` reads no tensor data: the profile names the
MoE layers, the routed experts and top-k (``num_experts_per_token`` for K3, never the
generation key ``top_k``); the headers give every expert's tensors.

Bytes of one expert, in the planned format:

* the format the experts are stored in (K3: ``mxfp4-pack-quantized``): the sum of
  one expert's stored tensors, from the headers (K3: 17,547,264 B);
* any other registered format: each expert weight's logical shape ``[rows, K]``
  through ``get_format(id).part_specs(shape)`` (per-tensor side parts included);
* ``stored``: every expert as the checkpoint stores it, expert by expert (a
  ``--target-bpw`` requant output mixes MXFP4 and 2.25-bpw experts); where the sizes
  differ the geometry carries ``per_expert_bytes``.  A requant report
  (``requant_report``) gives the same table for the checkpoint it was made from:
  each reported weight counts at its written bytes, everything else as stored.

Expert biases (gpt-oss) count as stored in every format.  Every expert must have the
same tensors (names, dtypes, shapes), except with ``stored``, where only their
weights must agree; every MoE layer must have the config's expert count.

Dense bytes are all other text-model tensors (attention, shared experts, router,
dense layers, norms, embeddings, head); the vision tower is left out unless
``include_vision`` (a text deployment does not load it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidFileError, UnsupportedError, UsageError
from .spec import FORMAT_ID, MoEGeometry

__all__ = ["GeometryReport", "STORED", "check_format_id", "expert_bytes_table",
           "expert_format_bytes", "moe_geometry", "moe_geometry_report"]

STORED = "stored"   # format id: each expert's bytes as the checkpoint (or a requant report) has them


@dataclass(frozen=True)
class GeometryReport:
    """``moe_geometry``'s result and how its byte counts were found.

    Attributes:
        geometry: what the planner needs.
        format_id: the format planned (``format_id`` as given, or resolved from None).
        source_storage: storage id(s) of the experts on disk, ``+``-joined.
        expert_weights: ``(name, logical shape)`` of one expert's weights (suffix
            after ``experts.E.``), sorted by name.
        bytes_from: ``headers`` or ``registry``.
        vision_bytes: bytes of vision tensors (left out of ``dense_bytes`` unless
            ``include_vision``).
        notes: sentences for the plan's notes.
    """

    geometry: MoEGeometry
    format_id: str
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
    """Bytes of one expert stored as ``format_id`` (from the format registry), and how
    they were found (``"registry"``).

    Args:
        weights: ``(name, logical shape)`` of the expert's weights.
    """
    from ..formats import target_format

    fmt = target_format(format_id, option="--format")
    total = 0
    for name, shape in weights:
        total += sum(spec.nbytes for spec in fmt.part_specs(shape, name=name).values())
    return total, "registry"


def check_format_id(format_id: str) -> str:
    """The registry's id for ``format_id`` (any case, llama.cpp spellings: ``IQ2_XS``), or
    ``stored``; refuses an unknown id before any work (``UsageError`` with "did you mean")."""
    from ..formats import find_format

    return format_id if format_id == STORED else find_format(format_id, option="--format").id


def moe_geometry_report(ckpt, *, format_id: str | None = None, include_vision: bool = False,
                        model_id: str | None = None, requant_report=None) -> GeometryReport:
    """See the module docstring.  ``ckpt`` is an open ``Checkpoint`` (``.config``,
    ``.tensors``: name -> entry with ``dtype``, ``shape``, ``nbytes``).

    Args:
        format_id: the planned expert format, ``stored``, or None: ``stored`` for a
            k3ckpt requant output whose experts differ (its config declares the
            formats), else MXFP4.
        requant_report: a requant report (``requant_report.json`` or its folder) made
            from ``ckpt`` or into it: bytes per expert as it wrote them (``stored``).

    Raises:
        UsageError: unknown format id; a format other than ``stored`` with a report.
        UnsupportedError: not a mixture-of-experts model, or experts that differ in
            their tensors.
        InvalidFileError: headers that disagree with the config (expert counts).
    """
    from ..profiles import Role, detect, logical_params

    if requant_report is not None:
        if format_id not in (None, STORED):
            raise UsageError(f"a requant report gives the bytes of every expert; it cannot be combined with "
                             f"format {format_id!r}")
        format_id = STORED
    if format_id is not None:
        format_id = check_format_id(format_id)
    tensors = ckpt.tensors
    profile = detect(ckpt.config, tensors.keys())
    g = profile.geometry
    if g is None or not g.experts or not g.moe_layers or not g.top_k:
        raise UnsupportedError(f"{profile.display_name}: the config names no routed experts; nothing to place")
    per_expert: dict[tuple[int, int | None], list] = {}
    expert_bytes: dict[tuple[int, int | None], int] = {}
    weight_bytes: dict[str, int] = {}   # stored bytes per logical expert weight (for a report)
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
            if requant_report is not None:
                weight_bytes[r.weight] = weight_bytes.get(r.weight, 0) + nb
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

    # every expert must be the same tensors (names, parts, dtypes, shapes); as stored,
    # only the same weights (a mixed-format requant changes parts and shapes)
    signatures: dict[tuple, tuple[int, int | None]] = {}
    for key, items in per_expert.items():
        signatures.setdefault(tuple(sorted((a, b, c, d) for a, b, c, d, _ in items)), key)
    if format_id is None:
        # differing experts are a mixed-format requant output only where the config says so
        from ..checkpoint.qconfig import declared_groups

        # a k3ckpt-written checkpoint is planned as stored (one format: that format)
        declared = bool(declared_groups(ckpt.config))
        if len(signatures) > 1 and declared:
            format_id = STORED
        elif declared and len(storages) == 1:
            format_id = next(iter(storages))
        else:
            format_id = FORMAT_ID
    if len(signatures) > 1:
        (a, b) = list(signatures.values())[:2]
        differ = f"experts differ in their tensors (layer {a[0]} expert {a[1]} vs layer {b[0]} expert {b[1]})"
        if format_id != STORED:
            raise UnsupportedError(f"{differ}; plan them as stored (format 'stored', --format stored) or plan on "
                                   f"the checkpoint they were made from")
        if len({tuple(sorted({it[0] for it in items})) for items in per_expert.values()}) > 1:
            raise UnsupportedError(f"{differ}: not the same weights")
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
    table = None
    if format_id == STORED:
        table = expert_bytes_table(expert_bytes, layers, g.experts, fused_e)
        how = "headers"
        if requant_report is not None:
            _apply_report(table, requant_report, layers, weight_bytes, fused=bool(fused_e))
            how = "requant report"
        per = int(table.max())
        lo, mean = int(table.min()), float(table.mean())
        sizes = f"{per:,} B per expert" if lo == per else f"{lo:,}-{per:,} B per expert (mean {mean:,.0f})"
        notes.append(f"expert bytes as {'the requant report wrote them' if requant_report is not None else 'stored'}"
                     f", expert by expert: {sizes}" + ("" if lo == per else
                                                       "; placement sizes each layer's slots for its largest "
                                                       "expert, cache tiers hold the hottest experts that fit"))
    elif storages == {format_id}:
        per = expert_bytes[key0] // e_div
        how = "headers"
    else:
        per, how = expert_format_bytes(weights, format_id)
        per += bias_bytes.get(key0, 0) // e_div
        notes.append(f"expert bytes in {format_id} from the format registry: {per:,} B per expert "
                     f"(stored as {source_storage}: {expert_bytes[key0] // e_div:,} B)")
    dense = total - all_experts - (0 if include_vision else vision)
    hidden = g.expert_hidden or g.hidden_size
    if model_id is None:
        # hf:// sources carry the repo id; local folders only what the config names
        model_id = ckpt.origin.repo_id or str((ckpt.config or {}).get("_name_or_path", "") or "")
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
        per_expert_bytes=None if table is None else table,
    )
    return GeometryReport(geometry, format_id, source_storage, weights, how, vision, tuple(notes))


def expert_bytes_table(expert_bytes: dict, layers, experts: int, fused_e: dict | None = None) -> np.ndarray:
    """``int64 [layers, experts]`` from bytes per ``(layer, expert)`` (``(layer, None)``: a fused
    tensor of ``fused_e[layer]`` experts, split evenly)."""
    row = {layer: i for i, layer in enumerate(layers)}
    table = np.zeros((len(layers), experts), dtype=np.int64)
    for (layer, e), nb in expert_bytes.items():
        if e is None:
            table[row[layer], :] += nb // fused_e[layer]
        elif 0 <= e < experts:
            table[row[layer], e] += nb
        else:
            raise InvalidFileError(f"layer {layer} has expert {e}; the config's experts are 0-{experts - 1}",
                                   file="config.json")
    return table


def _apply_report(table: np.ndarray, path, layers: list[int], weight_bytes: dict, *, fused: bool) -> None:
    """Each weight in the report at the bytes it wrote, in place of its stored bytes."""
    from ..requant.report import load_report

    if fused:
        raise UnsupportedError("a requant report cannot be mapped onto fused expert tensors; plan on the requant "
                               "output instead (format 'stored')")
    report = load_report(path)
    row = {layer: i for i, layer in enumerate(layers)}
    for t in report.tensors:
        if t.expert is None:
            continue
        stored = weight_bytes.get(t.name)
        if stored is None or t.layer not in row or not 0 <= t.expert < table.shape[1]:
            raise UsageError(f"the requant report names {t.name}, a routed-expert weight this checkpoint does not "
                             "have: plan on the checkpoint the report was made from, or on its output")
        table[row[t.layer], t.expert] += int(t.bytes) - stored
    if (table < 1).any():
        raise UsageError("the requant report leaves an expert with no bytes; it does not belong to this checkpoint")


def moe_geometry(ckpt, *, format_id: str | None = None, include_vision: bool = False,
                 model_id: str | None = None, requant_report=None) -> MoEGeometry:
    """The planner's geometry of ``ckpt`` with experts in ``format_id`` (see module doc)."""
    return moe_geometry_report(ckpt, format_id=format_id, include_vision=include_vision, model_id=model_id,
                               requant_report=requant_report).geometry
