"""What ``k3ckpt requant`` will do, from headers alone: the per-weight plan.

``plan_requant`` finds the MXFP4 weights of routed experts (through the
model profile's roles), applies ``--experts`` and ``--tensor-type``, checks
the shapes and the expert structure, and returns a ``RequantPlan``: which
weights become which format, which output tensors they produce, and the
output layout (source order; a requantized weight takes the place of its
first stored part).  No tensor data is read.

Sources (both MXFP4, error measured against the decoded MXFP4 values):

- compressed-tensors pair layout (Kimi K3, K2-style): ``<w>.weight_packed``
  U8 [N, K/2] + ``<w>.weight_scale`` U8 [N, K/32] per expert and projection;
  any ``<w>.weight_shape`` is copied unchanged (the logical shape does not change);
- gpt-oss fused ``<p>_blocks`` U8 [E, N, K/32, 16] + ``<p>_scales`` U8 [E, N, K/32]:
  each expert slice is one weight, written per expert as
  ``<stem>.<e>.<proj>.weight_packed`` ... (the fused ``_bias`` is copied).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Collection, Iterable, Sequence

from ..errors import InvalidFileError, ShapeError, UsageError
from ..io.writer import TensorSpec
from .qconfig import logical_weight_name

SOURCE_FORMATS = ("mxfp4-pack-quantized", "gpt-oss-mxfp4")
KEEP = "keep"
DEFAULT_FORMAT = "moet-w2"
# Projection words users may pass to --experts (profile's PROJECTIONS keys plus values).
_PROJECTION_WORDS = {"w1": "gate", "w3": "up", "w2": "down", "gate": "gate", "up": "up", "down": "down",
                     "gate_up": "gate_up", "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                     "gate_up_proj": "gate_up"}
# Rough single-core rates (weights/s) of the whole per-weight job (encode, two decodes, error
# metric) for --dry-run's time estimate; measured at K3 expert shapes (docs/requant.md).
_RATE = {"keep-scales": 35e6, "refit": 30e6, "k3ckpt-mx2": 16e6}
_RATE_OTHER = 3e6
_IO_RATE = 500e6   # bytes/s read + written, a conservative local-disk figure


@dataclass(frozen=True)
class FormatChoice:
    """A parsed ``--format`` / ``--tensor-type`` value."""

    spec: str                 # as given, e.g. "moet-w2:keep-scales"
    format: str               # registered format id, or "keep" (copy the source unchanged)
    method: str | None        # "refit" | "keep-scales" for moet-w2, else None

    @property
    def keep(self) -> bool:
        return self.format == KEEP


def parse_format(spec: str) -> FormatChoice:
    """``moet-w2`` (= ``moet-w2:refit``), ``moet-w2:keep-scales``, ``k3ckpt-mx2``, ``keep``, or any
    registered format that encodes from MXFP4 (``from_mxfp4``) or from floats."""
    from ..formats import get_format

    if not isinstance(spec, str) or not spec.strip():
        raise UsageError(f"--format must be a format id, found {spec!r}")
    spec = spec.strip()
    if spec == KEEP:
        return FormatChoice(spec, KEEP, None)
    fid, _, method = spec.partition(":")
    fmt = get_format(fid)   # NotFoundError lists the known ids
    if fid == "moet-w2":
        method = method or "refit"
        if method not in ("refit", "keep-scales"):
            raise UsageError(f"moet-w2 method must be refit or keep-scales, found {method!r} in {spec!r}")
        return FormatChoice(spec, fid, method)
    if method:
        raise UsageError(f"format {fid} takes no method, found {spec!r}")
    if not (hasattr(fmt, "from_mxfp4") or fmt.info.can_encode):
        raise UsageError(f"format {fid} cannot be written (decode-only)")
    return FormatChoice(spec, fid, None)


def parse_experts(experts) -> tuple[str | None, frozenset[str] | None]:
    """(regex, projections) from ``experts``: None (all routed experts), a regex, or a
    list of projection names (``gate``/``up``/``down``/``gate_up`` or ``w1``/``w3``/``w2``).
    A string of comma-separated projection names counts as a list."""
    if experts is None:
        return None, None
    if isinstance(experts, str):
        words = [w.strip() for w in experts.split(",")]
        if all(w in _PROJECTION_WORDS for w in words):
            return None, frozenset(_PROJECTION_WORDS[w] for w in words)
        try:
            re.compile(experts)
        except re.error as e:
            raise UsageError(f"bad --experts regular expression {experts!r}: {e}") from None
        return experts, None
    words = list(experts)
    bad = [w for w in words if w not in _PROJECTION_WORDS]
    if bad or not words:
        raise UsageError(f"--experts projections must be among {sorted(_PROJECTION_WORDS)}, found {words}")
    return None, frozenset(_PROJECTION_WORDS[w] for w in words)


def parse_tensor_types(items: Iterable) -> tuple[tuple[str, FormatChoice], ...]:
    """``[(regex, format)]`` or ``["REGEX=FORMAT"]`` -> checked pairs (first match wins)."""
    out = []
    for it in items or ():
        if isinstance(it, str):
            rx, sep, f = it.rpartition("=")
            if not sep or not rx:
                raise UsageError(f"--tensor-type must be REGEX=FORMAT, found {it!r}")
        else:
            rx, f = it
        try:
            re.compile(rx)
        except re.error as e:
            raise UsageError(f"bad --tensor-type regular expression {rx!r}: {e}") from None
        out.append((rx, parse_format(f)))
    return tuple(out)


@dataclass(frozen=True)
class PlannedWeight:
    """One weight to requantize: where its MXFP4 comes from and what it becomes."""

    index: int
    name: str                            # logical name, e.g. "...experts.17.w1.weight" (report key)
    layer: int | None
    expert: int | None
    projection: str | None
    source_format: str                   # "mxfp4-pack-quantized" | "gpt-oss-mxfp4"
    packed: str                          # source tensor of the codes (pair layout or gpt-oss _blocks)
    scale: str                           # source tensor of the E8M0 scales
    expert_slice: int | None             # gpt-oss: index into the fused tensors' first axis
    shape: tuple[int, int]               # logical [N, K]
    format: str
    method: str | None
    outputs: tuple[tuple[str, str], ...]  # (role, output tensor name) in the format's part order
    out_bytes: int

    @property
    def params(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def in_bytes(self) -> int:
        return self.params // 2 + self.params // 32

    def to_dict(self) -> dict:
        return {"name": self.name, "layer": self.layer, "expert": self.expert, "projection": self.projection,
                "source_format": self.source_format, "shape": list(self.shape), "format": self.format,
                "method": self.method, "outputs": [n for _, n in self.outputs], "out_bytes": self.out_bytes}


@dataclass(frozen=True)
class RequantPlan:
    weights: tuple[PlannedWeight, ...]
    specs: tuple[TensorSpec, ...]        # every output tensor, in output order
    copies: tuple[str, ...]              # source tensors copied byte for byte (same name)
    kept: tuple[str, ...]                # routed-expert weights left in MXFP4 ("keep" or not selected)

    @property
    def params(self) -> int:
        return sum(w.params for w in self.weights)

    def units(self) -> dict[str, list[PlannedWeight]]:
        """Weights by source tensor: one per weight (K3), all experts of a fused gpt-oss tensor
        together (they are kept or requantized as one)."""
        out: dict[str, list[PlannedWeight]] = {}
        for w in self.weights:
            out.setdefault(w.packed, []).append(w)
        return out

    @property
    def out_bytes(self) -> int:
        return sum(w.out_bytes for w in self.weights)

    @property
    def in_bytes(self) -> int:
        return sum(w.in_bytes for w in self.weights)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def estimated_seconds(self, workers: int) -> float:
        """A rough wall-time estimate (encode rates per core, plus disk traffic)."""
        cpu = sum(w.params / _RATE.get(w.method or w.format, _RATE_OTHER) for w in self.weights)
        return cpu / max(1, workers) + (self.in_bytes + self.total_bytes) / _IO_RATE

    def groups(self) -> dict[tuple[str, str | None], list[str]]:
        """(format, method) -> logical names of the output weights (for quantization_config)."""
        out: dict[tuple[str, str | None], list[str]] = defaultdict(list)
        for w in self.weights:
            out[(w.format, w.method)].append(self._output_weight(w))
        return dict(out)

    @staticmethod
    def _output_weight(w: PlannedWeight) -> str:
        from ..formats import get_format

        fmt = get_format(w.format)
        first = w.outputs[0][1]
        return logical_weight_name(first[: len(first) - len(fmt.info.parts[0].suffix)], fmt.info.parts[0].suffix)


@dataclass
class _Found:
    """A routed-expert MXFP4 weight found in the source (before selection)."""

    name: str
    layer: int | None
    expert: int | None
    projection: str | None
    source_format: str
    parts: dict[str, str]
    routed: bool


def _find(ckpt, extra_rx: Sequence[str]) -> tuple[list[_Found], dict[str, str]]:
    """Routed-expert MXFP4 weights (and MXFP4 weights any ``extra_rx`` names), with their parts."""
    from ..profiles import detect
    from ..profiles.roles import Role

    profile = detect(ckpt.config, ckpt.tensors.keys())
    found: dict[tuple[str, str], _Found] = {}
    part_of: dict[str, str] = {}
    suffix = {"packed": ".weight_packed", "scale": ".weight_scale", "blocks": "_blocks", "scales": "_scales"}
    for name, e in ckpt.tensors.items():
        tr = profile.classify(name, e.dtype)
        if tr.storage not in SOURCE_FORMATS or tr.part not in suffix:
            continue
        base = name[: len(name) - len(suffix[tr.part])]
        weight = base + ".weight" if tr.storage == "mxfp4-pack-quantized" else base
        routed = tr.role == Role.ROUTED_EXPERT
        if not routed and not any(re.search(rx, weight) for rx in extra_rx):
            continue
        f = found.setdefault((tr.storage, base), _Found(weight, tr.layer, tr.expert, tr.projection,
                                                         tr.storage, {}, routed))
        role = {"blocks": "packed", "scales": "scale"}.get(tr.part, tr.part)
        f.parts[role] = name
        part_of[name] = base
    return list(found.values()), part_of


def _check_parts(ckpt, f: _Found) -> tuple[int, ...]:
    """The weight's logical shape ([N, K], or [E, N, K] fused), after checking its two parts agree."""
    missing = [r for r in ("packed", "scale") if r not in f.parts]
    if missing:
        have = ", ".join(sorted(f.parts.values()))
        raise InvalidFileError(f"MXFP4 weight lacks its {missing[0]} tensor (found only {have})", tensor=f.name)
    p = ckpt.entry(f.parts["packed"])
    s = ckpt.entry(f.parts["scale"])
    if f.source_format == "gpt-oss-mxfp4":
        ok = len(p.shape) == 4 and p.shape[-1] == 16 and p.dtype == "U8" and s.shape == p.shape[:-1]
        logical = tuple(p.shape[:-2]) + (p.shape[-2] * 32,) if len(p.shape) >= 2 else ()
        want = "_blocks U8 [E, N, K/32, 16] and _scales U8 [E, N, K/32]"
    else:
        ok = len(p.shape) == 2 and len(s.shape) == 2 and p.shape[0] == s.shape[0] and p.shape[1] == 16 * s.shape[1]
        ok = ok and p.dtype == "U8" and s.dtype == "U8"
        logical = (p.shape[0], 2 * p.shape[1]) if len(p.shape) == 2 else ()
        want = "weight_packed U8 [N, K/2] and weight_scale U8 [N, K/32] (K a multiple of 32)"
    if not ok or s.dtype != "U8":
        raise ShapeError(f"MXFP4 parts do not fit 32-element blocks: expected {want}, found "
                         f"{p.dtype} {list(p.shape)} and {s.dtype} {list(s.shape)}", tensor=f.name)
    return logical


def _check_experts(found: list[_Found]) -> None:
    """Every routed expert of a layer has the same projections (per-expert layouts only)."""
    per_layer: dict[int | None, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for f in found:
        if f.expert is not None and f.projection is not None:
            per_layer[f.layer][f.expert].add(f.projection)
    for layer, experts in per_layer.items():
        every = set().union(*experts.values())
        for e, projs in sorted(experts.items()):
            if projs != every:
                lacking = sorted(every - projs)
                raise InvalidFileError(f"layer {layer} expert {e} lacks projection(s) {lacking} that the "
                                       f"layer's other experts have ({sorted(every)})")


def _choose(name: str, default: FormatChoice, overrides, selected: bool) -> FormatChoice | None:
    for rx, choice in overrides:
        if re.search(rx, name):
            return choice
    return default if selected else None


def plan_requant(ckpt, *, format: str = DEFAULT_FORMAT, experts=None, tensor_type=(),
                 keep: Collection[str] = ()) -> RequantPlan:
    """The plan for ``ckpt`` (headers only); see the module docstring.  ``keep``: logical
    weight names left in MXFP4 whatever else selects them (``--target-bpw``'s allocation)."""
    from ..formats import get_format

    default = parse_format(format)
    keep_choice = FormatChoice(KEEP, KEEP, None)
    keep = frozenset(keep)
    rx, projections = parse_experts(experts)
    overrides = parse_tensor_types(tensor_type)
    found, _ = _find(ckpt, [r for r, _ in overrides])
    _check_experts(found)

    weights: list[PlannedWeight] = []
    kept: list[str] = []
    by_first: dict[str, list[PlannedWeight]] = {}
    consumed: set[str] = set()
    order = {n: i for i, n in enumerate(ckpt.tensors)}
    for f in found:
        logical = _check_parts(ckpt, f)
        fused = f.source_format == "gpt-oss-mxfp4"
        slices = range(logical[0]) if fused else [None]
        stem, _, proj_word = f.name.rpartition(".")
        picks = []
        for e in slices:
            name = f"{stem}.{e}.{proj_word}.weight" if fused else f.name
            # non-routed MXFP4 weights are touched only when a --tensor-type names them
            sel = f.routed and (rx is None or re.search(rx, name) is not None) and (
                projections is None or f.projection in projections)
            picks.append((e, name, keep_choice if name in keep else _choose(name, default, overrides, sel)))
        chosen = [c for _, _, c in picks if c is not None and not c.keep]
        if fused and chosen and len(chosen) != len(picks):
            raise UsageError(f"gpt-oss stores every expert of {f.name} in one tensor: select all of its "
                             f"{len(picks)} experts or none (found {len(chosen)} selected)")
        if not chosen:
            kept.append(f.name)
            continue
        first = min(f.parts.values(), key=order.__getitem__)
        for e, name, choice in picks:
            fmt = get_format(choice.format)
            k = logical[-1]
            n = logical[-2]
            if k % fmt.info.block:
                raise ShapeError(f"{choice.format} stores blocks of {fmt.info.block}; K = {k} is not a multiple",
                                 tensor=name)
            base = f"{stem}.{e}.{proj_word}" if fused else f.name[: -len(".weight")]
            specs = fmt.part_specs((n, k), name=name)
            outputs = tuple((role, base + spec.suffix) for role, spec in specs.items())
            w = PlannedWeight(
                index=len(weights), name=name, layer=f.layer, expert=e if fused else f.expert,
                projection=f.projection, source_format=f.source_format, packed=f.parts["packed"],
                scale=f.parts["scale"], expert_slice=e, shape=(n, k), format=choice.format, method=choice.method,
                outputs=outputs, out_bytes=sum(s.nbytes for s in specs.values()))
            weights.append(w)
            by_first.setdefault(first, []).append(w)
        consumed.update(f.parts.values())
    if experts is not None and not weights:
        raise UsageError(f"--experts {experts!r} selects no routed-expert MXFP4 weight")

    specs: list[TensorSpec] = []
    copies: list[str] = []
    for name, e in ckpt.tensors.items():
        if name in by_first:
            for w in by_first[name]:
                fmt = get_format(w.format)
                for (role, out), spec in zip(w.outputs, fmt.part_specs(w.shape).values()):
                    specs.append(TensorSpec(out, spec.dtype, spec.shape))
        elif name not in consumed:
            specs.append(TensorSpec(name, e.dtype, e.shape))
            copies.append(name)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:   # e.g. a source that already holds a per-expert name gpt-oss outputs use
            raise InvalidFileError("an output tensor name is also a source tensor name", tensor=spec.name)
        seen.add(spec.name)
    return RequantPlan(tuple(weights), tuple(specs), tuple(copies), tuple(kept))
