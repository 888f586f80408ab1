"""What ``k3ckpt requant`` will do, from headers alone: the per-weight plan.

``plan_requant`` finds the routed-expert weights (through the model profile's
roles and ``sources.find_weights``), applies ``--experts`` and
``--tensor-type``, checks the shapes and the expert structure, and returns a
``RequantPlan``: which weights become which format, which output tensors they
produce, and the output layout (source order; a requantized weight takes the
place of its first stored part).  No tensor data is read.

Sources (``sources.py``): MXFP4 -- the compressed-tensors pair layout
(``<w>.weight_packed`` U8 [N, K/2] + ``<w>.weight_scale`` U8 [N, K/32]; any
``<w>.weight_shape`` is copied unchanged) or gpt-oss's fused
``<p>_blocks`` / ``<p>_scales`` (each expert slice one weight, written per
expert as ``<stem>.<e>.<proj>.weight_packed`` ...; the fused ``_bias`` is
copied) -- and block FP8, INT4 pack-quantized, NVFP4 and BF16/F16/F32, decoded
to float32 first.  An MXFP4 source asked for MXFP4 stays as it is (a copy).

``--format mxfp4`` (= ``mxfp4-pack-quantized``) writes the compressed-tensors
pair layout per weight, or with ``layout="gpt-oss"`` gpt-oss's fused
``<stem>.gate_up_proj_blocks`` U8 [E, 2I, H/32, 16] (rows interleaved: 2i gate,
2i+1 up) and ``<stem>.down_proj_blocks`` [E, H, I/32, 16] with their
``_scales``; each expert's slice is one planned weight written at its byte
offset (``out_offsets``).
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Collection, Iterable

from ..errors import InvalidFileError, ShapeError, UsageError
from ..formats import ids
from ..io.writer import TensorSpec
from ..checkpoint.qconfig import logical_weight_name
from .sources import MXFP4_SOURCES, SourceSlice, SourceWeight, find_weights

SOURCE_FORMATS = MXFP4_SOURCES   # sources the 2.25 formats encode from directly (their codes)
KEEP = "keep"
DEFAULT_FORMAT = ids.MOET_W2
MXFP4 = ids.MXFP4_PACK
GPT_OSS_MXFP4 = ids.GPT_OSS_MXFP4   # what --format mxfp4 --layout gpt-oss writes
FORMAT_ALIASES = {"mxfp4": MXFP4}
LAYOUTS = ("compressed-tensors", "gpt-oss")
# Projection words users may pass to --experts (profile's PROJECTIONS keys plus values).
_PROJECTION_WORDS = {"w1": "gate", "w3": "up", "w2": "down", "gate": "gate", "up": "up", "down": "down",
                     "gate_up": "gate_up", "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                     "gate_up_proj": "gate_up"}
# Single-core rates (weights/s) of the whole per-weight job (codes plus every report number)
# for --dry-run's time estimate, from docs/BENCHMARKS.md (bench_requant, K3 expert shapes):
# moet-w2 refit+report one pass 847-997 Mw/s (keep-scales runs the same one-pass kernel),
# MX2 110-244, IQ2_XS 9.0-11.6; the low ends, since the job adds a decode and the metric.
_RATE = {"keep-scales": 800e6, "refit": 800e6, ids.MX2: 100e6, ids.GGUF_IQ2_XS: 9e6,
         MXFP4: 40e6, GPT_OSS_MXFP4: 40e6}   # MXFP4 from floats: encode, decode, metric
_RATE_OTHER = 3e6
_IO_RATE = 500e6   # bytes/s read + written, a conservative local-disk figure
_STARTUP = 1.0     # s: starting the pool and loading cached kernels (k3-tiny runs take 1.6-1.7 s)


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
    """``moet-w2`` (= ``moet-w2:refit``), ``moet-w2:keep-scales``, ``k3ckpt-mx2``, ``keep``, ``mxfp4``
    (= ``mxfp4-pack-quantized``), or any registered format that encodes from MXFP4 codes or from floats
    (``FormatInfo.encodes_from``); a method only where the format lists it (``FormatInfo.methods``)."""
    from ..formats import target_format

    if not isinstance(spec, str) or not spec.strip():
        raise UsageError(f"--format must be a format id, found {spec!r}")
    spec = spec.strip()
    if spec == KEEP:
        return FormatChoice(spec, KEEP, None)
    fid, _, method = spec.partition(":")
    fmt = target_format(FORMAT_ALIASES.get(fid, fid))   # any case, llama.cpp names, did-you-mean
    fid = fmt.id
    if not fmt.info.methods and method:
        raise UsageError(f"format {fid} takes no method, found {spec!r}")
    if fmt.info.methods and method and method not in fmt.info.methods:
        raise UsageError(f"{fid} method must be {' or '.join(fmt.info.methods)}, found {method!r} in {spec!r}")
    return FormatChoice(spec, fid, fmt.check_method(method or None))


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


@dataclass(frozen=True, slots=True)
class PlannedWeight:
    """One weight to requantize: where its values come from and what it becomes."""

    index: int
    name: str                            # logical name, e.g. "...experts.17.w1.weight" (report key)
    layer: int | None
    expert: int | None
    projection: str | None
    source_format: str                   # registry id of the source storage (sources.ACCEPTED)
    packed: str                          # MXFP4: tensor of the codes; else the first source tensor
    scale: str                           # MXFP4: tensor of the E8M0 scales; else the second one (or the first)
    expert_slice: int | None             # fused source: index into its first axis
    shape: tuple[int, int]               # logical [N, K] written
    format: str
    method: str | None
    outputs: tuple[tuple[str, str], ...]  # (role, output tensor name) in the format's part order
    out_bytes: int
    sources: tuple[SourceSlice, ...] = ()   # float path: slices decoded and joined (gate, up interleaved)
    source_bytes: int | None = None         # stored source bytes (None: the MXFP4 pair's)
    out_offsets: tuple[int, ...] | None = None  # byte offset of each output inside a fused tensor

    @property
    def params(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def from_mxfp4(self) -> bool:
        """The source is MXFP4: the encoders start from its codes, not from decoded floats."""
        return self.source_format in MXFP4_SOURCES

    @property
    def source_tensors(self) -> tuple[str, ...]:
        """Every source tensor this weight reads (gate and up both, for a fused gpt-oss output)."""
        if not self.sources:
            return (self.packed, self.scale)
        return tuple(dict.fromkeys(t for s in self.sources for _, t in s.parts))

    @property
    def in_bytes(self) -> int:
        if self.source_bytes is not None:
            return self.source_bytes
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
    kept: tuple[str, ...]                # routed-expert weights left as stored ("keep" or not selected)
    layout: str = "compressed-tensors"   # how MXFP4 output is laid out (LAYOUTS)

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
        """Wall-time estimate: the measured per-core rates shared by ``workers``, plus disk
        traffic (compiling kernels on a first run is added by the caller)."""
        cpu = sum(w.params / _RATE.get(w.method or w.format, _RATE_OTHER) for w in self.weights)
        startup = _STARTUP if self.weights else 0.0
        return startup + cpu / max(1, workers) + (self.in_bytes + self.total_bytes) / _IO_RATE

    def groups(self) -> dict[tuple[str, str | None], list[str]]:
        """(format, method) -> logical names of the output weights (for quantization_config)."""
        out: dict[tuple[str, str | None], list[str]] = defaultdict(list)
        for w in self.weights:
            out[(w.format, w.method)].append(self._output_weight(w))
        return {k: list(dict.fromkeys(v)) for k, v in out.items()}   # fused outputs: one name per tensor

    @staticmethod
    def _output_weight(w: PlannedWeight) -> str:
        from ..formats import get_format

        fmt = get_format(w.format)
        first = w.outputs[0][1]
        return logical_weight_name(first[: len(first) - len(fmt.info.parts[0].suffix)], fmt.info.parts[0].suffix)


def _check_mxfp4(ckpt, f: SourceWeight) -> tuple[int, ...]:
    """An MXFP4 weight's logical shape ([N, K], or [E, N, K] fused), after checking its two parts agree."""
    fused = f.format == ids.GPT_OSS_MXFP4
    p = ckpt.entry(f.part("blocks" if fused else "packed"))
    s = ckpt.entry(f.part("scales" if fused else "scale"))
    if fused:
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


def _check_experts(found: list[SourceWeight]) -> None:
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


def _source_layout(fid: str) -> str:
    return "gpt-oss" if fid == ids.GPT_OSS_MXFP4 else "compressed-tensors"


_EXPERT_NAME = re.compile(r"^(?P<stem>.*\.experts)\.(?P<e>\d+)\.")
_GPTOSS_PROJ = {"gate": "gate_up_proj", "up": "gate_up_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


class _Builder:
    """Collects planned weights and where their output tensors go (source order)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.order = {n: i for i, n in enumerate(ckpt.tensors)}
        self.weights: list[PlannedWeight] = []
        self.emit: dict[str, list[TensorSpec]] = {}
        self.consumed: set[str] = set()

    def place(self, sources: Iterable[SourceWeight], specs: Iterable[TensorSpec]) -> None:
        """Output ``specs`` go where the earliest part of ``sources`` was; all their parts are consumed."""
        tensors = [t for f in sources for _, t in f.parts]
        self.emit.setdefault(min(tensors, key=self.order.__getitem__), []).extend(specs)
        self.consumed.update(tensors)

    def add(self, f: SourceWeight, *, name: str, expert: int | None, projection: str | None,
            slices: tuple[SourceSlice, ...], shape: tuple[int, int], choice: FormatChoice,
            outputs: tuple[tuple[str, str], ...], out_bytes: int, offsets=None, slice_index=None) -> None:
        if f.mxfp4:
            packed, scale = (f.part("blocks"), f.part("scales")) if f.fused else (f.part("packed"), f.part("scale"))
            src_bytes = None
        else:
            first = slices[0].parts
            packed, scale = first[0][1], first[min(1, len(first) - 1)][1]
            src_bytes = sum(s.stored_bytes(self.ckpt) for s in slices)
        self.weights.append(PlannedWeight(
            index=len(self.weights), name=name, layer=f.layer, expert=expert, projection=projection,
            source_format=f.format, packed=packed, scale=scale, expert_slice=slice_index, shape=shape,
            format=choice.format, method=choice.method, outputs=outputs, out_bytes=out_bytes,
            sources=() if f.mxfp4 else slices, source_bytes=src_bytes, out_offsets=offsets))


def _fmt_for(fmt_id: str, n: int, k: int, name: str | None):
    from ..formats import get_format

    fmt = get_format(fmt_id)
    if k % fmt.info.block:
        raise ShapeError(f"{fmt_id} stores blocks of {fmt.info.block}; K = {k} is not a multiple", tensor=name)
    return fmt


def _output_parts(choice: FormatChoice, n: int, k: int, name: str):
    """(part specs, their bytes) of one [n, k] weight in ``choice``'s format; the same for every
    weight of a shape, so kept once per (format, shape) (a K3 plan asks 247,296 times)."""
    try:
        return _output_parts_of(choice.format, n, k)
    except ShapeError:
        _fmt_for(choice.format, n, k, name).part_specs((n, k), name=name)   # the error again, naming the weight
        raise


@functools.lru_cache(maxsize=1024)
def _output_parts_of(fmt_id: str, n: int, k: int):
    pspecs = tuple(_fmt_for(fmt_id, n, k, None).part_specs((n, k)).values())
    return pspecs, sum(x.nbytes for x in pspecs)


def _per_weight(b: _Builder, f: SourceWeight, logical, picks) -> None:
    """Outputs per weight (and per expert of a fused source), in the format's own part names."""
    fused = len(logical) == 3
    stem, _, proj_word = f.name.rpartition(".")
    specs = []
    for e, name, choice in picks:
        sl = f.slice(e)
        n, k = (logical[-2], logical[-1]) if f.mxfp4 else sl.out_shape
        pspecs, out_bytes = _output_parts(choice, n, k, name)
        base = f"{stem}.{e}.{proj_word}" if fused else (f.name[: -len(".weight")] if f.name.endswith(".weight")
                                                        else f.name)
        outputs = tuple((spec.role, base + spec.suffix) for spec in pspecs)
        b.add(f, name=name, expert=e if fused else f.expert, projection=f.projection, slices=(sl,), shape=(n, k),
              choice=choice, outputs=outputs, out_bytes=out_bytes, slice_index=e)
        specs += [TensorSpec(out, spec.dtype, spec.shape) for (_, out), spec in zip(outputs, pspecs)]
    b.place([f], specs)


def _fused_output(b: _Builder, out_base: str, members: list[tuple[int, tuple[SourceWeight, ...], str]],
                  choice: FormatChoice, projection: str) -> None:
    """gpt-oss layout: one ``<out_base>_blocks`` / ``_scales`` pair for all experts; ``members``
    are (expert, source weights joined by row, logical name) in expert order."""
    from ..formats import get_format

    fmt = get_format(GPT_OSS_MXFP4)
    n_e = len(members)
    shapes = set()
    for e, fs, name in members:
        sl = tuple(f.slice(e if f.fused else None) for f in fs)
        n, k = sl[0].out_shape
        if any(s.out_shape != (n, k) for s in sl):
            raise ShapeError(f"gate and up of expert {e} differ in shape: {[list(s.out_shape) for s in sl]}",
                             tensor=name)
        shapes.add((n * len(sl), k))
    if len(shapes) != 1:
        raise ShapeError(f"gpt-oss layout stacks experts of one shape; {out_base} has {sorted(shapes)}")
    ((n, k),) = shapes
    choice = FormatChoice(choice.spec, GPT_OSS_MXFP4, None)
    _fmt_for(choice.format, n, k, out_base)
    one = fmt.part_specs((n, k), name=out_base)
    full = fmt.part_specs((n_e, n, k), name=out_base)
    outputs = tuple((role, out_base + spec.suffix) for role, spec in one.items())
    for e, fs, name in members:
        sl = tuple(f.slice(e if f.fused else None) for f in fs)
        b.add(fs[0], name=name, expert=e, projection=projection, slices=sl, shape=(n, k), choice=choice,
              outputs=outputs, out_bytes=sum(x.nbytes for x in one.values()),
              offsets=tuple(e * spec.nbytes for spec in one.values()), slice_index=e if fs[0].fused else None)
    seen, uniq = set(), []
    for f in (f for _, fs, _ in members for f in fs):
        if id(f) not in seen:
            seen.add(id(f))
            uniq.append(f)
    b.place(uniq, [TensorSpec(out_base + spec.suffix, spec.dtype, spec.shape) for spec in full.values()])


def _gptoss_layout(b: _Builder, picked: list) -> None:
    """Group the chosen weights into gpt-oss's fused per-layer tensors (see the module docstring)."""
    groups: dict[tuple[str, str], dict[int, dict[str, tuple[SourceWeight, FormatChoice | None]]]] = {}
    for f, logical, picks in picked:
        if f.fused:   # one fused float tensor already: its experts are its slices
            chosen = [c for _, _, c in picks if c is not None and not c.keep]
            if chosen:
                stem, _, proj_word = f.name.rpartition(".")
                members = [(e, (f,), name) for e, name, _ in picks]
                _fused_output(b, f.name, members, chosen[0], f.projection or proj_word)
            continue
        m = _EXPERT_NAME.match(f.name)
        out_proj = _GPTOSS_PROJ.get(f.projection or "")
        if m is None or out_proj is None:
            raise UsageError("--layout gpt-oss fuses routed experts per layer; cannot place "
                             f"{f.name} (projection {f.projection})")
        (_, _, choice), = picks
        groups.setdefault((m["stem"], out_proj), {}).setdefault(int(m["e"]), {})[f.projection] = (f, choice)
    for (stem, out_proj), experts in groups.items():
        choices = {(c.format, c.method) if c is not None and not c.keep else None
                   for per in experts.values() for _, c in per.values()}
        if choices == {None}:
            continue
        if len(choices) != 1:
            raise UsageError(f"--layout gpt-oss stores every expert of {stem}.{out_proj} in one tensor: select all "
                             "of its experts and projections or none")
        if sorted(experts) != list(range(len(experts))):
            raise InvalidFileError(f"--layout gpt-oss needs experts 0..E-1 of {stem}; found {sorted(experts)}")
        members = []
        for e in range(len(experts)):
            per = experts[e]
            order = ("gate_up",) if "gate_up" in per else (("gate", "up") if out_proj == "gate_up_proj" else ("down",))
            if any(p not in per for p in order):
                raise InvalidFileError(f"--layout gpt-oss needs {order} of expert {e} in {stem}; found {sorted(per)}")
            members.append((e, tuple(per[p][0] for p in order), f"{stem}.{e}.{out_proj}.weight"))
        choice = next(c for per in experts.values() for _, c in per.values())
        _fused_output(b, f"{stem}.{out_proj}", members, choice, "gate_up" if out_proj == "gate_up_proj" else "down")


def plan_requant(ckpt, *, format: str = DEFAULT_FORMAT, experts=None, tensor_type=(),
                 keep: Collection[str] = (), layout: str | None = None) -> RequantPlan:
    """The plan for ``ckpt`` (headers only); see the module docstring.  ``keep``: logical
    weight names left as stored whatever else selects them (``--target-bpw``'s allocation).
    ``layout``: ``compressed-tensors`` (default) or ``gpt-oss``, for MXFP4 output only."""
    default = parse_format(format)
    if layout is not None and layout not in LAYOUTS:
        raise UsageError(f"--layout must be one of {', '.join(LAYOUTS)}, found {layout!r}")
    keep_choice = FormatChoice(KEEP, KEEP, None)
    keep = frozenset(keep)
    rx, projections = parse_experts(experts)
    overrides = parse_tensor_types(tensor_type)
    if layout == "gpt-oss":
        bad = [c.spec for c in [default] + [c for _, c in overrides] if not c.keep and c.format != MXFP4]
        if bad:
            raise UsageError(f"--layout gpt-oss writes MXFP4 only (--format mxfp4), found {bad[0]!r}")
    found = find_weights(ckpt, [r for r, _ in overrides])
    _check_experts(found)

    kept: list[str] = []
    picked = []
    selected_any = False
    for f in found:
        logical = _check_mxfp4(ckpt, f) if f.mxfp4 else f.shape
        fused = len(logical) == 3
        stem, _, proj_word = f.name.rpartition(".")
        picks = []
        for e in (range(logical[0]) if fused else [None]):
            name = f"{stem}.{e}.{proj_word}.weight" if fused else f.name
            # non-routed MXFP4 weights are touched only when a --tensor-type names them
            sel = f.routed and (rx is None or re.search(rx, name) is not None) and (
                projections is None or f.projection in projections)
            choice = keep_choice if name in keep else _choose(name, default, overrides, sel)
            selected_any |= choice is not None
            if choice is not None and choice.format == MXFP4 and f.mxfp4:
                if layout is not None and layout != _source_layout(f.format):
                    raise UsageError(f"{f.name} is MXFP4 in the {_source_layout(f.format)} layout already; "
                                     f"k3ckpt does not move MXFP4 between layouts (--layout {layout})")
                choice = keep_choice   # MXFP4 to MXFP4 is a copy: the bytes stay as they are
            picks.append((e, name, choice))
        chosen = [c for _, _, c in picks if c is not None and not c.keep]
        if fused and chosen and len(chosen) != len(picks):
            raise UsageError(f"{f.name} stores every expert in one tensor: select all of its "
                             f"{len(picks)} experts or none (found {len(chosen)} selected)")
        if not chosen:
            kept.append(f.name)
            if layout != "gpt-oss" or f.fused:
                continue
        picked.append((f, logical, picks))
    if experts is not None and not selected_any:
        raise UsageError(f"--experts {experts!r} selects no routed-expert weight")

    b = _Builder(ckpt)
    if layout == "gpt-oss":
        _gptoss_layout(b, picked)
        parts_of = {f.name: f.parts for f in found}
        kept = [n for n in kept if not any(t in b.consumed for _, t in parts_of[n])]
    else:
        for f, logical, picks in picked:
            _per_weight(b, f, logical, picks)

    specs: list[TensorSpec] = []
    copies: list[str] = []
    for name, e in ckpt.tensors.items():
        if name in b.emit:
            specs.extend(b.emit[name])
        elif name not in b.consumed:
            specs.append(TensorSpec(name, e.dtype, e.shape))
            copies.append(name)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:   # e.g. a source that already holds a per-expert name gpt-oss outputs use
            raise InvalidFileError("an output tensor name is also a source tensor name", tensor=spec.name)
        seen.add(spec.name)
    return RequantPlan(tuple(b.weights), tuple(specs), tuple(copies), tuple(kept), layout or "compressed-tensors")
