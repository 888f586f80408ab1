"""``k3ckpt dequant``'s run: the plan (``k3ckpt.dequant.plan_dequant``) streamed into DST.

DST gets a run manifest (``k3ckpt-manifest.json``: every file with its size and sha256), so
``k3ckpt verify DST [--source SRC]`` checks a dequant output as it checks the other writers'.
There is no ``--resume``: a run that fails or is interrupted removes what it created.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from .dequant import (HF_QUANT_CONFIG, JOB, SHARD_BYTES, DequantPlan, DequantResult, _check_tensor_scales,
                      _convert, _decode_chunks, _nan_blocks, _narrow_hf_quant_config,
                      _narrow_quant_config, plan_dequant, shard_names)
from .checkpoint.identity import source_identity
from .checkpoint.side_files import copy_side_files, is_weight_file
from .errors import InvalidFileError, OutputExistsError, UsageError
from .formats import ids
from .io.manifest import MANIFEST_NAME
from .io.reader import Checkpoint
from .io.writer import ShardedWriter, atomic_write_json


def dequant_checkpoint(ckpt: Checkpoint, dst, *, dtype: str = ids.BF16, pattern: str | None = None,
                       progress: bool = False, max_shard_bytes: int = SHARD_BYTES,
                       dry_run: bool = False) -> DequantResult:
    """Write ``dst``: ``ckpt`` with its (selected) quantized weights decoded to ``dtype``.

    ``dry_run``: plan only (headers), write nothing; the result says what a run would write and
    whether DST's filesystem has room.  A run that fails removes what it created in DST."""
    from .io.writer import free_space_for, is_fresh_output

    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes <= 0:
        raise UsageError(f"--max-shard-size must be a positive size, got {max_shard_bytes!r}")
    plan = plan_dequant(ckpt, dtype=dtype, pattern=pattern)
    _check_tensor_scales(ckpt, plan.decoded)   # refuse before anything is written
    dst = Path(dst)
    if ckpt.root is not None and dst.resolve() == Path(ckpt.root).resolve():
        raise UsageError("destination is the source folder; choose a new folder", file=str(dst))
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise OutputExistsError(f"destination {dst} exists and is not an empty folder")
    if dry_run:
        return _result(plan, dst, max_shard_bytes, dry_run=True, free_bytes=_free_bytes(dst),
                       shards=tuple(shard_names(plan.specs, max_shard_bytes)))
    if is_fresh_output(dst, False):
        free_space_for(dst, plan.total_bytes)   # before DST exists, so a refused run leaves nothing behind
    with _created_by_us(dst):
        written, stats = _write(ckpt, plan, dst, dtype=dtype, pattern=pattern, progress=progress,
                                max_shard_bytes=max_shard_bytes)
    return _result(plan, dst, max_shard_bytes, shards=tuple(p.name for p in written), **stats)


def _free_bytes(dst: Path) -> int:
    p = dst.absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _result(plan: DequantPlan, dst: Path, max_shard_bytes: int, *, shards, dry_run=False, free_bytes=None,
            copied=None, nan_blocks=None, inexact=None) -> DequantResult:
    return DequantResult(
        dst=str(dst), decoded=tuple(w.weight for w in plan.decoded),
        copied=len(plan.copies) if copied is None else copied, skipped=plan.skipped,
        nan_blocks=nan_blocks or {}, inexact=inexact or {}, shards=shards, bytes_written=plan.total_bytes,
        dropped=tuple(n for w in plan.decoded for n in w.extras), dry_run=dry_run, tensors=len(plan.specs),
        free_bytes=free_bytes, max_shard_bytes=max_shard_bytes)


class _created_by_us:
    """On an error (or Ctrl-C) remove what this run created: DST itself and the parents it made,
    or, for a DST that existed (empty), what the run put in it.  A folder that existed stays."""

    def __init__(self, dst: Path):
        self.dst = dst.absolute()
        top = None
        p = self.dst
        while not p.exists():
            top, p = p, p.parent
        self.top = top          # the highest folder this run creates (None: DST exists)

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is None:
            return False
        if self.top is not None:
            shutil.rmtree(self.top, ignore_errors=True)
        elif self.dst.is_dir():
            for p in self.dst.iterdir():   # it was empty when the run began
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        return False


def _write(ckpt: Checkpoint, plan: DequantPlan, dst: Path, *, dtype: str, pattern, progress: bool,
           max_shard_bytes: int):
    """Stream the plan into ``dst`` under a run manifest (so ``k3ckpt verify`` checks it)."""
    from tqdm import tqdm

    from .io.manifest import RunManifest

    manifest = RunManifest.begin(dst, job=JOB, options={"dtype": dtype, "tensors": pattern,
                                                        "max_shard_bytes": max_shard_bytes},
                                 source=source_identity(ckpt), resume=False)
    out_dtype, by_first, fused_bias = plan.out_dtype, plan.by_first, plan.fused_bias
    nan_blocks: dict[str, int] = {}
    inexact: dict[str, int] = {}
    copied = 0

    def on_final(path: Path) -> None:
        manifest.record(path.name, sha256=writer.sha256[path.name])

    with ShardedWriter(dst, list(plan.specs), max_shard_bytes=max_shard_bytes, on_shard_final=on_final,
                       hash_shards=True) as writer, \
            tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="dequant", disable=not progress) as bar:
        for name, e in ckpt.tensors.items():
            if name in by_first:
                w = by_first[name]
                for r0, x, parts in _decode_chunks(ckpt, w):
                    nan_blocks[w.weight] = nan_blocks.get(w.weight, 0) + _nan_blocks(w, parts, x)
                    y, changed = _convert(x, out_dtype)
                    if changed:
                        inexact[w.weight] = inexact.get(w.weight, 0) + changed
                    if w.format == ids.GPT_OSS_MXFP4:
                        _write_unfused(writer, w, r0, y)
                    else:
                        writer.write_chunk(w.outputs[0], r0 * y[0].nbytes, np.ascontiguousarray(y))
                    bar.update(y.nbytes)
            elif name in plan.consumed:
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
    todo, everything = list(plan.decoded), plan.everything
    if ckpt.config is not None:
        atomic_write_json(dst / "config.json", _narrow_quant_config(ckpt.config, todo, everything))
    root = ckpt.root if ckpt.root and ckpt.root.is_dir() else None
    copy_side_files(root, dst, skip=lambda n: is_weight_file(n) or n == HF_QUANT_CONFIG or n == MANIFEST_NAME)
    if root is not None and (root / HF_QUANT_CONFIG).is_file():
        try:
            hqc = json.loads((root / HF_QUANT_CONFIG).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidFileError(f"not valid JSON: {exc}", file=str(root / HF_QUANT_CONFIG)) from None
        narrowed = _narrow_hf_quant_config(hqc, todo, everything)
        if narrowed is not None:
            atomic_write_json(dst / HF_QUANT_CONFIG, narrowed)
    for p in sorted(dst.iterdir()):   # index, config, side files
        if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST_NAME and p.name not in manifest.records:
            manifest.record(p.name)
    manifest.finish(decoded=len(todo), copied=copied, bytes_out=plan.total_bytes)
    return written, {"copied": copied, "nan_blocks": {k: v for k, v in nan_blocks.items() if v},
                     "inexact": inexact}


def _write_unfused(writer: ShardedWriter, w: DecodedWeight, r0: int, y: np.ndarray) -> None:
    """gpt-oss: rows of the fused [E, rows, K] go to per-expert tensors (even rows gate, odd up)."""
    per = len(w.outputs) // w.shape[0]
    for i in range(y.shape[0]):
        expert = r0 + i
        for j in range(per):
            writer.write(w.outputs[expert * per + j], np.ascontiguousarray(y[i, j::per]))
