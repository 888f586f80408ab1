"""``k3ckpt dequant``: decode quantized weights to bf16/f16/f32, copy the rest.

Quantized weights are found by the profile's storage ids and decoded through
the format registry, in row chunks, straight into the output file (bounded
memory).  Output names are the plain ones a float checkpoint would use:
``...w1.weight`` for ``...w1.weight_packed`` + ``...w1.weight_scale``; gpt-oss's
fused ``experts.gate_up_proj_blocks`` becomes per-expert ``experts.E.gate_proj.weight``
and ``experts.E.up_proj.weight`` (even rows gate, odd rows up), [out, in] as on
disk.  Every other tensor is copied byte for byte.  config.json's
``quantization_config`` is dropped, or narrowed to what is still quantized.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .errors import OutputExistsError, UnsupportedError, UsageError
from .io.dtypes import lookup, value_dtype
from .io.reader import Checkpoint
from .io.writer import ShardedWriter, TensorSpec, atomic_write_json
from .profiles import detect

OUT_DTYPES = {"bf16": "BF16", "f16": "F16", "f32": "F32"}
_CHUNK_BYTES = 64 << 20   # decoded float32 bytes per chunk


@dataclass(frozen=True)
class DecodedWeight:
    """One quantized weight to decode: its stored parts and where values go."""

    weight: str                      # logical name (regex matches on this)
    format: str                      # format registry id
    parts: dict[str, str]            # role -> source tensor name
    shape: tuple[int, ...]           # logical decoded shape
    outputs: tuple[str, ...]         # output tensor names (several for gpt-oss unfusing)


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


def _gptoss_outputs(base: str, experts: int) -> tuple[str, ...]:
    stem, fused = base.rsplit(".", 1)             # "model.layers.0.mlp.experts", "gate_up_proj"
    projs = ("gate_proj", "up_proj") if fused == "gate_up_proj" else (fused,)
    return tuple(f"{stem}.{e}.{p}.weight" for e in range(experts) for p in projs)


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
        fmt = get_format(tr.storage)
        for part in fmt.info.parts:
            if name.endswith(part.suffix) and len(name) > len(part.suffix):
                base = name[: len(name) - len(part.suffix)]
                groups.setdefault((tr.storage, base), {})[part.role] = name
                break
        else:
            undecodable.append(f"{name} ({tr.storage}: unexpected tensor name)")
    weights = []
    for (storage, base), parts in groups.items():
        fmt = get_format(storage)
        missing = [r for r in fmt.info.roles if r not in parts]
        if missing:
            undecodable.extend(f"{n} ({storage}: missing part(s) {missing})" for n in parts.values())
            continue
        first = fmt.info.parts[0]
        pshape = ckpt.entry(parts[first.role]).shape
        ntrail = len(first.per_block)
        shape = tuple(pshape[:-ntrail]) + (pshape[-ntrail] // first.per_block[0] * fmt.info.block,)
        if storage == "gpt-oss-mxfp4":
            outputs = _gptoss_outputs(base, shape[0])
            weight = base
        else:
            weight = base + ".weight" if fmt.info.parts[0].suffix.startswith(".weight") else base
            outputs = (weight,)
        weights.append(DecodedWeight(weight, storage, dict(parts), shape, outputs))
    return weights, undecodable


def _declared(ckpt: Checkpoint, decodable: set[str]):
    """Formats a k3ckpt-written config declares (``k3ckpt.requant.qconfig``): the
    stored suffixes cannot tell moet-w2 from MXFP4, the config's targets can."""
    from .formats import get_format
    from .requant.qconfig import declared_groups

    return [(get_format(fid), pats) for fid, pats in declared_groups(ckpt.config) if fid in decodable]


def _declared_part(declared, name: str) -> tuple[str, str, str] | None:
    """(format id, base, role) when ``name`` is a part of a weight a declared group targets."""
    from .requant.qconfig import logical_weight_name

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
    consumed = {n for w in todo for n in w.parts.values()}
    fused_bias = {}
    for w in todo:
        if w.format == "gpt-oss-mxfp4":
            bias = w.weight + "_bias"
            if bias in ckpt:
                fused_bias[bias] = w
    specs: list[TensorSpec] = []
    for name, e in ckpt.tensors.items():
        if name in by_first:
            w = by_first[name]
            if w.format == "gpt-oss-mxfp4":
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


def _decode_chunks(ckpt: Checkpoint, w: DecodedWeight) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, decoded float32 rows) over the weight's leading dimension."""
    from .formats import get_format

    fmt = get_format(w.format)
    lead = w.shape[0]
    row_elems = math.prod(w.shape[1:])
    step = max(1, _CHUNK_BYTES // (4 * max(row_elems, 1)))
    for r0 in range(0, lead, step):
        r1 = min(lead, r0 + step)
        parts = {}
        tensor_roles = {t.role for t in fmt.info.tensor_parts}
        dtype_of = {p.role: p.dtype for p in fmt.info.parts} | {t.role: t.dtype for t in fmt.info.tensor_parts}
        for role, tensor in w.parts.items():
            # per-weight parts (MX2's levels) have a fixed shape: read whole, not by rows
            raw = ckpt.read_raw(tensor) if role in tensor_roles else ckpt.read_rows(tensor, r0, r1)
            parts[role] = raw.view(np.dtype(lookup(dtype_of[role]).storage))
        yield r0, fmt.decode(parts, out=np.float32, name=w.weight)


def _nan_blocks(ckpt: Checkpoint, w: DecodedWeight, r0: int, r1: int, x: np.ndarray) -> int:
    from .formats import get_format

    info = get_format(w.format).info
    if info.tensor_parts:
        # The scale byte alone does not say it (MX2: offset 63, or base + offset past 254):
        # count the blocks that decoded to NaN.
        return int(np.count_nonzero(np.isnan(x.reshape(-1, info.block)).any(axis=1)))
    scale = w.parts.get("scale") or w.parts.get("scales")
    if scale is None:
        return 0
    return int(np.count_nonzero(ckpt.read_rows(scale, r0, r1) == 0xFF))


def _narrow_quant_config(config: dict, decoded: list[DecodedWeight], everything: bool) -> dict:
    """Drop ``quantization_config`` if nothing quantized is left, else list what we decoded as ignored."""
    config = copy.deepcopy(config)
    holders = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
    modules = sorted({w.weight[: -len(".weight")] if w.weight.endswith(".weight") else w.weight for w in decoded})
    for holder in holders:
        qc = holder.get("quantization_config")
        if not isinstance(qc, dict):
            continue
        if everything:
            del holder["quantization_config"]
            continue
        key = "modules_to_not_convert" if qc.get("quant_method") == "mxfp4" else "ignore"
        existing = list(qc.get(key) or [])
        qc[key] = existing + [m for m in modules if m not in existing]
    return config


def copy_side_files(src_root: Path | None, dst: Path, *, skip: Callable[[str], bool]) -> list[str]:
    """Copy the files beside the weights (tokenizer, generation config, ...) that ``skip`` does not claim."""
    if src_root is None or not src_root.is_dir():
        return []
    copied = []
    for p in sorted(src_root.iterdir()):
        if p.is_file() and not p.is_symlink() and not p.name.startswith(".") and not skip(p.name):
            tmp = dst / f".{p.name}.partial"
            shutil.copyfile(p, tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, dst / p.name)
            copied.append(p.name)
    return copied


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json") or name == "config.json"


def prepare_dst(dst: str | os.PathLike) -> Path:
    """An empty (or new) destination folder; refuses to write into a non-empty one."""
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise OutputExistsError(f"destination {dst} exists and is not an empty folder")
    dst.mkdir(parents=True, exist_ok=True)
    return dst


def dequant_checkpoint(ckpt: Checkpoint, dst, *, dtype: str = "bf16", pattern: str | None = None,
                       progress: bool = False, max_shard_bytes: int = 5_000_000_000) -> DequantResult:
    """Write ``dst``: ``ckpt`` with its (selected) quantized weights decoded to ``dtype``."""
    from tqdm import tqdm

    if dtype not in OUT_DTYPES:
        raise UsageError(f"--dtype must be one of {sorted(OUT_DTYPES)}, got {dtype!r}")
    out_dtype = OUT_DTYPES[dtype]
    try:
        rx = re.compile(pattern) if pattern else None
    except re.error as exc:
        raise UsageError(f"bad --tensors regular expression {pattern!r}: {exc}") from None
    weights, undecodable = find_quantized(ckpt)
    todo = [w for w in weights if rx is None or rx.search(w.weight)]
    if rx is not None and not todo:
        raise UsageError(f"--tensors {pattern!r} matches no decodable quantized weight")
    if rx is not None:
        picked = [u for u in undecodable if rx.search(u.split(" ", 1)[0])]
        if picked:
            raise UnsupportedError(f"cannot decode {picked[0]}")
    skipped = tuple(undecodable + [f"{w.weight} (not selected)" for w in weights if w not in todo])

    specs, fused_bias = _output_specs(ckpt, todo, out_dtype)
    dst = prepare_dst(dst)
    total = sum(s.nbytes for s in specs)
    nan_blocks: dict[str, int] = {}
    inexact: dict[str, int] = {}
    by_first = _first_parts(ckpt, todo)
    consumed = {n for w in todo for n in w.parts.values()}
    copied = 0
    with ShardedWriter(dst, specs, max_shard_bytes=max_shard_bytes) as writer, \
            tqdm(total=total, unit="B", unit_scale=True, desc="dequant", disable=not progress) as bar:
        for name, e in ckpt.tensors.items():
            if name in by_first:
                w = by_first[name]
                for r0, x in _decode_chunks(ckpt, w):
                    r1 = r0 + x.shape[0]
                    nan_blocks[w.weight] = nan_blocks.get(w.weight, 0) + _nan_blocks(ckpt, w, r0, r1, x)
                    y, changed = _convert(x, out_dtype)
                    if changed:
                        inexact[w.weight] = inexact.get(w.weight, 0) + changed
                    if w.format == "gpt-oss-mxfp4":
                        _write_unfused(writer, w, r0, y)
                    else:
                        writer.write_chunk(w.outputs[0], r0 * y[0].nbytes, np.ascontiguousarray(y))
                    bar.update(y.nbytes)
            elif name in consumed:
                continue
            elif name in fused_bias:
                w = fused_bias[name]
                raw = ckpt.read_raw(name)
                per = len(w.outputs) // raw.shape[0]
                for i, out in enumerate(w.outputs):
                    expert, j = divmod(i, per)
                    writer.write(out[: -len(".weight")] + ".bias", np.ascontiguousarray(raw[expert, j::per]))
                bar.update(raw.nbytes)
            else:
                offset = 0
                for chunk in ckpt.iter_chunks(name):
                    writer.write_chunk(name, offset, chunk)
                    offset += len(chunk)
                    bar.update(len(chunk))
                copied += 1
        written = writer.close()
    everything = not any(True for w in weights if w not in todo) and not undecodable
    if ckpt.config is not None:
        _write_json_atomic(dst / "config.json", _narrow_quant_config(ckpt.config, todo, everything))
    copy_side_files(ckpt.root if ckpt.root and ckpt.root.is_dir() else None, dst, skip=_is_weight_file)
    return DequantResult(
        dst=str(dst),
        decoded=tuple(w.weight for w in todo),
        copied=copied,
        skipped=skipped,
        nan_blocks={k: v for k, v in nan_blocks.items() if v},
        inexact=inexact,
        shards=tuple(p.name for p in written),
        bytes_written=total,
    )


def _write_unfused(writer: ShardedWriter, w: DecodedWeight, r0: int, y: np.ndarray) -> None:
    """gpt-oss: rows of the fused [E, rows, K] go to per-expert tensors (even rows gate, odd up)."""
    per = len(w.outputs) // w.shape[0]
    for i in range(y.shape[0]):
        expert = r0 + i
        for j in range(per):
            writer.write(w.outputs[expert * per + j], np.ascontiguousarray(y[i, j::per]))


def _write_json_atomic(path: Path, obj) -> None:
    atomic_write_json(path, obj)
