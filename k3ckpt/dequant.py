"""``k3ckpt dequant``: decode quantized weights to bf16/f16/f32, copy the rest.

Quantized weights are found by the profile's storage ids (which are format
registry ids) and decoded through the format registry, in row chunks, straight
into the output file (bounded memory): MXFP4 (compressed-tensors and gpt-oss
layouts), block FP8 (DeepSeek-V3 / Kimi K2; chunks start on 128-row tiles),
INT4 pack-quantized (Kimi K2-Thinking), NVFP4 (compressed-tensors and ModelOpt
naming) and the k3ckpt formats a k3ckpt config declares.  Output names are the
plain ones a float checkpoint would use: ``...w1.weight`` for
``...w1.weight_packed`` + ``...w1.weight_scale``; gpt-oss's fused
``experts.gate_up_proj_blocks`` becomes per-expert ``experts.E.gate_proj.weight``
and ``experts.E.up_proj.weight`` (even rows gate, odd rows up), [out, in] as on
disk.  A decoded module's activation scales (``input_scale``,
``input_global_scale``) are dropped and listed.  Every other tensor is copied
byte for byte.  config.json's ``quantization_config`` (and ModelOpt's
``hf_quant_config.json``) is dropped, or narrowed to what is still quantized.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .errors import InvalidFileError, NaNScaleError, ShapeError, UnsupportedError, UsageError
from .formats import ids
from .io.dtypes import lookup, value_dtype
from .io.reader import Checkpoint
from .io.writer import TensorSpec
from .profiles import detect

OUT_DTYPES = {ids.BF16: "BF16", ids.F16: "F16", ids.F32: "F32"}
_CHUNK_BYTES = 64 << 20   # decoded float32 bytes per chunk


@dataclass(frozen=True)
class DecodedWeight:
    """One quantized weight to decode: its stored parts and where values go."""

    weight: str                      # logical name (regex matches on this)
    format: str                      # format registry id
    parts: dict[str, str]            # role -> source tensor name
    shape: tuple[int, ...]           # logical decoded shape
    outputs: tuple[str, ...]         # output tensor names (several for gpt-oss unfusing)
    extras: tuple[str, ...] = ()     # the module's activation scales, dropped with the decoded weight


@dataclass(frozen=True)
class DequantResult:
    dst: str
    decoded: tuple[str, ...]                 # logical weights decoded
    copied: int                              # tensors copied unchanged
    skipped: tuple[str, ...]                 # quantized weights left as they were (with reason)
    nan_blocks: dict[str, int] = field(default_factory=dict)   # weight -> blocks with a NaN scale
    inexact: dict[str, int] = field(default_factory=dict)      # weight -> values the out dtype rounded
    shards: tuple[str, ...] = ()
    bytes_written: int = 0
    dropped: tuple[str, ...] = ()            # activation scales of decoded modules (input_scale, ...)
    dry_run: bool = False                    # planned only: nothing was written
    tensors: int = 0                         # output tensors
    free_bytes: int | None = None            # dry run: free space where DST goes
    max_shard_bytes: int = 0

    @property
    def fits(self) -> bool | None:
        """Dry run: whether DST's filesystem has room for the output (None after a run)."""
        return None if self.free_bytes is None else self.bytes_written <= self.free_bytes

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {**asdict(self), "fits": self.fits}


def _gptoss_outputs(base: str, experts: int) -> tuple[str, ...]:
    stem, fused = base.rsplit(".", 1)             # "model.layers.0.mlp.experts", "gate_up_proj"
    projs = ("gate_proj", "up_proj") if fused == "gate_up_proj" else (fused,)
    return tuple(f"{stem}.{e}.{p}.weight" for e in range(experts) for p in projs)


# Activation scales that belong to a quantized module (ModelOpt W4A4, static FP8,
# compressed-tensors NVFP4 W4A4): meaningless once its weight is plain floats.
_ACTIVATION_SCALES = (".input_scale", ".input_global_scale")


def find_quantized(ckpt: Checkpoint) -> tuple[list[DecodedWeight], list[str]]:
    """Group quantized tensors into decodable weights; also list those we cannot decode."""
    from .formats import get_format, list_formats

    decodable = {info.id for info in list_formats() if info.can_decode}

    profile = detect(ckpt.config, ckpt.tensors.keys())
    declared = _declared(ckpt, decodable)
    groups: dict[tuple[str, str], dict[str, str]] = {}
    undecodable: list[str] = []
    for name, e in ckpt.tensors.items():
        hit = _declared_part(declared, name)
        if hit is not None:
            storage, base, role = hit
            groups.setdefault((storage, base), {})[role] = name
            continue
        tr = profile.classify(name, e.dtype)
        if not tr.quantized:
            continue
        if tr.storage not in decodable:
            undecodable.append(f"{name} ({tr.storage}: no decoder yet)")
            continue
        part = get_format(tr.storage).match_name(name)
        if part is None:
            undecodable.append(f"{name} ({tr.storage}: unexpected tensor name)")
            continue
        base, role = part
        groups.setdefault((tr.storage, base), {})[role] = name
    weights = []
    for (storage, base), parts in groups.items():
        fmt = get_format(storage)
        missing = [r for r in fmt.info.roles if r not in parts]
        if missing:
            undecodable.extend(f"{n} ({storage}: missing part(s) {missing})" for n in parts.values())
            continue
        try:
            shape = _logical_shape(ckpt, fmt, parts)
        except (InvalidFileError, ShapeError) as exc:  # left as stored, with the reason
            undecodable.extend(f"{n} ({storage}: {exc.detail})" for n in parts.values())
            continue
        if storage == ids.GPT_OSS_MXFP4:
            outputs = _gptoss_outputs(base, shape[0])
            weight = base
        else:
            weight = base + ".weight" if fmt.info.parts[0].suffix.startswith(".weight") else base
            outputs = (weight,)
        extras = tuple(base + s for s in _ACTIVATION_SCALES if base + s in ckpt.tensors)
        weights.append(DecodedWeight(weight, storage, dict(parts), shape, outputs, extras))
    return weights, undecodable


def _logical_shape(ckpt: Checkpoint, fmt, parts: dict[str, str]) -> tuple[int, ...]:
    """The decoded shape from the parts' headers, after checking every part's
    dtype and shape against the format (``InvalidFileError`` naming what differs)."""
    shapes = {role: tuple(ckpt.entry(n).shape) for role, n in parts.items()}
    first = fmt.info.parts[0]
    if hasattr(fmt, "logical_shape_from_shapes"):  # block FP8: 2-D tiles fix nothing per row
        shape = fmt.logical_shape_from_shapes(shapes)
    else:
        pshape = shapes[first.role]
        ntrail = len(first.per_block)
        if len(pshape) < ntrail or pshape[-ntrail] % first.per_block[0]:
            raise InvalidFileError(f"{fmt.id} part {first.role!r} has shape {list(pshape)}",
                                   tensor=parts[first.role])
        shape = tuple(pshape[:-ntrail]) + (pshape[-ntrail] // first.per_block[0] * fmt.info.block,)
    specs = fmt.part_specs(shape)
    tensor_roles = {t.role for t in fmt.info.tensor_parts}
    for role, name in parts.items():
        e, spec = ckpt.entry(name), specs[role]
        if role in tensor_roles:
            # fixed-size per-weight tensors: ModelOpt writes scalars as [] (we write [1]);
            # INT4 weight_shape is I64 today, I32 in some checkpoints
            ok = math.prod(e.shape) == math.prod(spec.shape) and (
                e.dtype == spec.dtype or (spec.dtype == "I64" and e.dtype == "I32"))
        else:
            ok = tuple(e.shape) == spec.shape and e.dtype == spec.dtype
        if not ok:
            raise InvalidFileError(f"{fmt.id} part {role!r} should be {spec.dtype} {list(spec.shape)} for a "
                                   f"weight of shape {list(shape)}, found {e.dtype} {list(e.shape)}", tensor=name)
    return shape


def _declared(ckpt: Checkpoint, decodable: set[str]):
    """Formats a k3ckpt-written config declares (``k3ckpt.checkpoint.qconfig``): the
    stored suffixes cannot tell moet-w2 from MXFP4, the config's targets can."""
    from .formats import get_format
    from .checkpoint.qconfig import declared_groups

    return [(get_format(fid), pats) for fid, pats in declared_groups(ckpt.config) if fid in decodable]


def _declared_part(declared, name: str) -> tuple[str, str, str] | None:
    """(format id, base, role) when ``name`` is a part of a weight a declared group targets."""
    from .checkpoint.qconfig import logical_weight_name

    for fmt, pats in declared:
        hit = fmt.match_name(name)
        if hit is None:
            continue
        base, role = hit
        weight = logical_weight_name(base, fmt.info.parts[0].suffix)
        if any(p.fullmatch(weight) for p in pats):
            return fmt.id, base, role
    return None


def _first_parts(ckpt: Checkpoint, todo: list[DecodedWeight]) -> dict[str, DecodedWeight]:
    """Source tensor -> the weight whose earliest part it is (its output goes there)."""
    order = {n: i for i, n in enumerate(ckpt.tensors)}
    return {min(w.parts.values(), key=order.__getitem__): w for w in todo}


def _output_specs(ckpt: Checkpoint, todo: list[DecodedWeight], out_dtype: str) -> tuple[list[TensorSpec], dict]:
    """Output tensors in source order: a decoded weight takes the place of its first part."""
    by_first = _first_parts(ckpt, todo)
    consumed = {n for w in todo for n in (*w.parts.values(), *w.extras)}
    fused_bias = {}
    for w in todo:
        if w.format == ids.GPT_OSS_MXFP4:
            bias = w.weight + "_bias"
            if bias in ckpt:
                fused_bias[bias] = w
    specs: list[TensorSpec] = []
    for name, e in ckpt.tensors.items():
        if name in by_first:
            w = by_first[name]
            if w.format == ids.GPT_OSS_MXFP4:
                experts, rows, k = w.shape
                per = rows // len(w.outputs) * experts
                specs.extend(TensorSpec(o, out_dtype, (per, k)) for o in w.outputs)
            else:
                specs.append(TensorSpec(w.outputs[0], out_dtype, w.shape))
        elif name in consumed:
            continue
        elif name in fused_bias:
            w = fused_bias[name]
            experts, rows = e.shape[0], e.shape[1]
            per = rows // (len(w.outputs) // experts)
            specs.extend(TensorSpec(o[: -len(".weight")] + ".bias", e.dtype, (per,)) for o in w.outputs)
        else:
            specs.append(TensorSpec(name, e.dtype, e.shape))
    return specs, fused_bias


def _convert(x: np.ndarray, out_dtype: str) -> tuple[np.ndarray, int]:
    """float32 -> output dtype (RNE); also the count of values that changed."""
    if out_dtype == "F32":
        return x, 0
    y = x.astype(value_dtype(out_dtype))
    back = y.astype(np.float32)
    changed = int(np.count_nonzero((back != x) & ~(np.isnan(back) & np.isnan(x))))
    return y, changed


def _row_step(fmt, shape: tuple[int, ...]) -> int:
    """Leading-axis rows per chunk: about ``_CHUNK_BYTES`` of float32, a whole
    number of scale tiles for formats whose scale rows cover several rows (block FP8)."""
    row_elems = math.prod(shape[1:])
    step = max(1, _CHUNK_BYTES // (4 * max(row_elems, 1)))
    tile = getattr(fmt, "tile", 1) if len(shape) == 2 else 1  # [B, N, K]: B is the batch, one scale block each
    return -(-step // tile) * tile


def _part_rows(fmt, shape: tuple[int, ...], role: str, r0: int, r1: int) -> tuple[int, int]:
    if hasattr(fmt, "part_rows") and len(shape) == 2:
        return fmt.part_rows(role, r0, r1, shape[0])
    return r0, r1


def _decode_chunks(ckpt: Checkpoint, w: DecodedWeight) -> Iterator[tuple[int, np.ndarray, dict]]:
    """(first row, decoded float32 rows, the stored parts of those rows) over the
    weight's leading dimension."""
    from .formats import get_format

    fmt = get_format(w.format)
    lead = w.shape[0]
    tensor_roles = {t.role for t in fmt.info.tensor_parts}
    dtype_of = {p.role: p.dtype for p in fmt.info.parts} | {t.role: t.dtype for t in fmt.info.tensor_parts}
    # per-weight parts (MX2's levels, NVFP4's per-tensor scale) have a fixed shape: read once, whole
    fixed = {role: _read_fixed(ckpt, w, role, tensor, dtype_of[role])
             for role, tensor in w.parts.items() if role in tensor_roles}
    step = _row_step(fmt, w.shape)
    for r0 in range(0, lead, step):
        r1 = min(lead, r0 + step)
        parts = dict(fixed)
        for role, tensor in w.parts.items():
            if role not in tensor_roles:
                a, b = _part_rows(fmt, w.shape, role, r0, r1)
                parts[role] = ckpt.read_rows(tensor, a, b).view(np.dtype(lookup(dtype_of[role]).storage))
        yield r0, fmt.decode(parts, out=np.float32, name=w.weight), parts


def _read_fixed(ckpt: Checkpoint, w: DecodedWeight, role: str, tensor: str, dtype: str) -> np.ndarray:
    """A per-weight part; a per-tensor scale that is NaN (or not a positive finite
    number) has nothing to decode to, so the weight is refused."""
    raw = ckpt.read_raw(tensor)
    if role in ("global_scale", "scale_2"):
        v = raw.view(np.float32).reshape(-1)
        if np.isnan(v).any():
            raise NaNScaleError(f"the per-tensor scale is NaN; weight {w.weight} cannot be decoded", tensor=tensor)
        if not (np.isfinite(v) & (v > 0)).all():
            raise InvalidFileError(f"the per-tensor scale must be finite and positive, found {v.tolist()}",
                                   tensor=tensor)
    if dtype == "F32":
        return raw.view(np.float32)
    return raw


# Scale encodings whose NaN we count: one stored scale is one block (a tile for block FP8).
_NAN_SCALE = {
    "U8": lambda a: a == 0xFF,                                   # E8M0: 0xFF is NaN
    "F8_E4M3": lambda a: (a & 0x7F) == 0x7F,                     # E4M3 (fn): S.1111.111
    "BF16": lambda a: (a & 0x7FFF) > 0x7F80,
    "F16": lambda a: (a & 0x7FFF) > 0x7C00,
    "F32": lambda a: np.isnan(a.view(np.float32)),
}
_SCALE_ROLES = ("scale", "scales", "scale_inv")


def _nan_blocks(w: DecodedWeight, parts: dict, x: np.ndarray) -> int:
    """Blocks of this chunk whose stored scale is NaN (they decode to NaN)."""
    from .formats import get_format

    info = get_format(w.format).info
    scale = next((p for p in info.parts if p.role in _SCALE_ROLES), None)
    if scale is None or scale.dtype not in _NAN_SCALE:
        return 0
    if scale.dtype == "U8" and info.tensor_parts:
        # MX2: the scale byte alone does not say it (offset 63, or base + offset past
        # 254): count the blocks that decoded to NaN.
        return int(np.count_nonzero(np.isnan(x.reshape(-1, info.block)).any(axis=1)))
    return int(np.count_nonzero(_NAN_SCALE[scale.dtype](parts[scale.role])))


def _narrow_quant_config(config: dict, decoded: list[DecodedWeight], everything: bool) -> dict:
    """Drop ``quantization_config`` if nothing quantized is left, else list what we decoded as ignored."""
    config = copy.deepcopy(config)
    holders = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
    modules = _modules(decoded)
    for holder in holders:
        qc = holder.get("quantization_config")
        if not isinstance(qc, dict):
            continue
        if everything:
            del holder["quantization_config"]
            continue
        _add_excluded(qc, _EXCLUDE_KEY.get(qc.get("quant_method"), "ignore"), modules)
    return config


# Where each ecosystem lists the modules it leaves unquantized (transformers'
# Mxfp4Config / FineGrainedFP8Config, ModelOpt, compressed-tensors' ``ignore``).
_EXCLUDE_KEY = {"mxfp4": "modules_to_not_convert", "fp8": "modules_to_not_convert", "modelopt": "exclude_modules"}
HF_QUANT_CONFIG = "hf_quant_config.json"   # ModelOpt's own copy of its settings


def _add_excluded(qc: dict, key: str, modules: list[str]) -> None:
    existing = list(qc.get(key) or [])
    qc[key] = existing + [m for m in modules if m not in existing]


def _modules(decoded: list[DecodedWeight]) -> list[str]:
    return sorted({w.weight[: -len(".weight")] if w.weight.endswith(".weight") else w.weight for w in decoded})


def _narrow_hf_quant_config(obj, decoded: list[DecodedWeight], everything: bool):
    """ModelOpt's hf_quant_config.json narrowed like config.json; None when nothing quantized is left."""
    if everything:
        return None
    obj = copy.deepcopy(obj)
    q = obj.get("quantization") if isinstance(obj, dict) else None
    if isinstance(q, dict):
        _add_excluded(q, "exclude_modules", _modules(decoded))
    return obj


JOB = "dequant"
SHARD_BYTES = 5_000_000_000   # save_pretrained's default max_shard_size; the source's own shards do not fit
                              # a decoded output (bf16 is ~3.6x MXFP4), so the source's sharding is not kept


@dataclass(frozen=True)
class DequantPlan:
    """What a run writes, from headers alone (``plan_dequant``)."""

    decoded: tuple[DecodedWeight, ...]   # selected weights, in source order
    skipped: tuple[str, ...]             # quantized weights left as they were (with reason)
    specs: tuple[TensorSpec, ...]        # every output tensor, in output order
    copies: tuple[str, ...]              # source tensors copied byte for byte (same name)
    out_dtype: str
    everything: bool                     # nothing quantized is left (quantization_config is dropped)
    fused_bias: dict = field(default_factory=dict, repr=False)   # gpt-oss bias -> its fused weight
    by_first: dict = field(default_factory=dict, repr=False)     # first part -> weight (output goes there)
    consumed: frozenset = frozenset()    # source tensors replaced by a decoded output

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def plan_dequant(ckpt: Checkpoint, *, dtype: str = ids.BF16, pattern: str | None = None) -> DequantPlan:
    """The plan for ``ckpt``: O(N) in the tensor count (K3 has 497,220 tensors, 247,296 weights)."""
    if dtype not in OUT_DTYPES:
        raise UsageError(f"--dtype must be one of {sorted(OUT_DTYPES)}, got {dtype!r}")
    out_dtype = OUT_DTYPES[dtype]
    try:
        rx = re.compile(pattern) if pattern else None
    except re.error as exc:
        raise UsageError(f"bad --tensors regular expression {pattern!r}: {exc}") from None
    weights, undecodable = find_quantized(ckpt)
    todo = [w for w in weights if rx is None or rx.search(w.weight)]
    if rx is not None:
        picked = [u for u in undecodable if rx.search(u.split(" ", 1)[0])]
        if picked:  # the reason beats "matches nothing"
            raise UnsupportedError(f"cannot decode {picked[0]}")
        if not todo:
            raise UsageError(f"--tensors {pattern!r} matches no decodable quantized weight")
    # by name, not `w not in todo`: a list membership test per weight was O(N^2) (~3 h at K3)
    chosen = {w.weight for w in todo}
    left = [w.weight for w in weights if w.weight not in chosen]
    specs, fused_bias = _output_specs(ckpt, todo, out_dtype)
    by_first = _first_parts(ckpt, todo)
    consumed = frozenset(n for w in todo for n in (*w.parts.values(), *w.extras))
    copies = tuple(n for n in ckpt.tensors if n not in by_first and n not in consumed and n not in fused_bias)
    return DequantPlan(tuple(todo), tuple(undecodable + [f"{n} (not selected)" for n in left]), tuple(specs),
                       copies, out_dtype, not left and not undecodable, fused_bias, by_first, consumed)


def shard_names(specs, max_shard_bytes: int) -> list[str]:
    """The file names ``ShardedWriter`` gives ``specs`` (its greedy rule), without a folder."""
    count, size = (1 if specs else 0), 0
    for s in specs:
        if size and size + s.nbytes > max_shard_bytes:
            count, size = count + 1, 0
        size += s.nbytes
    count = max(count, 1)
    index = ["model.safetensors.index.json"] if count > 1 else []   # the writer's index, as a run lists it
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)] + index


def _check_tensor_scales(ckpt: Checkpoint, todo) -> None:
    """NVFP4's per-tensor scale of every selected weight is a usable number (a NaN raises NaNScaleError)."""
    for w in todo:
        for role in ("global_scale", "scale_2"):
            if role in w.parts:
                _read_fixed(ckpt, w, role, w.parts[role], "F32")
