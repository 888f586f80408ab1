"""``k3ckpt dequant FILE.gguf DST``: a GGUF file (or split set) as plain safetensors.

Every tensor keeps its GGUF name (``blk.1.ffn_up_exps.weight``, not the checkpoint's
names: mapping back is per architecture and lossy where the converter fused tensors)
and its numpy-order shape (the reverse of GGUF's fastest-first ``ne``).  Quantized
tensors (IQ2_XS, MXFP4, Q8_0, ...) are decoded by ``gguf.quants.dequantize``, the gguf
package's own numpy decoders, in row chunks straight into the output (an expert tensor
of one K3 layer is GBs), then cast to ``dtype``; F32 / F16 / BF16 and integer tensors are
copied byte for byte in their own dtype.  DST has no config.json: the GGUF metadata
(every key, arrays in full) and each tensor's GGUF type and file go to
``k3ckpt_gguf_metadata.json`` beside the shards, so nothing is lost.  DST gets a run
manifest, as the checkpoint dequant's, so ``k3ckpt verify DST`` checks its files.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import OutputExistsError, UnsupportedError, UsageError
from ..formats import ids
from ..io.writer import TensorSpec
from .reader import GGUFSet, GGUFTensor, metadata_json

METADATA_NAME = "k3ckpt_gguf_metadata.json"
METADATA_FORMAT = "k3ckpt-gguf-metadata"
METADATA_VERSION = 1
CHUNK_BYTES = 64 << 20        # decoded float32 (or copied) bytes per chunk
# ggml types that are plain arrays: copied in their own dtype (ggml and safetensors spell them alike)
PLAIN = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})


@dataclass(frozen=True)
class GGUFDequantResult:
    """What ``dequant`` of a GGUF wrote (or, with ``dry_run``, would write)."""

    dst: str
    source: tuple[str, ...]                  # the GGUF files read, in split order
    decoded: tuple[str, ...]                 # quantized tensors decoded to the output dtype
    copied: int                              # plain tensors copied in their own dtype
    left_out: tuple[str, ...]                # tensors --tensors did not select (not written)
    inexact: dict[str, int] = field(default_factory=dict)     # tensor -> values the out dtype rounded
    nonfinite: dict[str, int] = field(default_factory=dict)   # tensor -> decoded NaN / Inf values
    shards: tuple[str, ...] = ()
    bytes_written: int = 0                   # tensor bytes
    tensors: int = 0                         # output tensors
    dry_run: bool = False
    free_bytes: int | None = None            # dry run: free space where DST goes
    max_shard_bytes: int = 0
    metadata_file: str = METADATA_NAME

    @property
    def fits(self) -> bool | None:
        """Dry run: whether DST's filesystem has room for the output (None after a run)."""
        return None if self.free_bytes is None else self.bytes_written <= self.free_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits, "format": "gguf"}


@dataclass(frozen=True)
class _Plan:
    tensors: tuple[GGUFTensor, ...]          # selected, in file order
    specs: tuple[TensorSpec, ...]
    left_out: tuple[str, ...]
    out_dtype: str

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def _check_decoder(t: GGUFTensor) -> None:
    """A quantized type the gguf package cannot decode is refused before anything is written."""
    import gguf

    qtype = gguf.GGMLQuantizationType(t.ggml_type)
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), qtype)
    except NotImplementedError:
        raise UnsupportedError(f"the gguf package has no decoder for {t.type_name}", tensor=t.name) from None


def plan_gguf_dequant(gs: GGUFSet, *, dtype: str = ids.BF16, pattern: str | None = None) -> _Plan:
    from ..dequant import OUT_DTYPES

    if dtype not in OUT_DTYPES:
        raise UsageError(f"--dtype must be one of {sorted(OUT_DTYPES)}, got {dtype!r}")
    try:
        rx = re.compile(pattern) if pattern else None
    except re.error as exc:
        raise UsageError(f"bad --tensors regular expression {pattern!r}: {exc}") from None
    chosen = [t for t in gs.tensors.values() if rx is None or rx.search(t.name)]
    if rx is not None and not chosen:
        raise UsageError(f"--tensors {pattern!r} matches no tensor of the GGUF")
    checked: set[int] = set()
    specs = []
    for t in chosen:
        if t.type_name in PLAIN:
            specs.append(TensorSpec(t.name, t.type_name, t.shape))
            continue
        if t.ggml_type not in checked:
            _check_decoder(t)
            checked.add(t.ggml_type)
        specs.append(TensorSpec(t.name, OUT_DTYPES[dtype], t.shape))
    picked = {t.name for t in chosen}
    return _Plan(tuple(chosen), tuple(specs), tuple(n for n in gs.tensors if n not in picked), OUT_DTYPES[dtype])


def dequant_gguf(gs: GGUFSet, dst, *, dtype: str = ids.BF16, pattern: str | None = None, progress: bool = False,
                 max_shard_bytes: int, dry_run: bool = False) -> GGUFDequantResult:
    """Write ``dst`` from the open GGUF ``gs`` (module docstring).  A failed run removes what it created."""
    from ..dequant import shard_names
    from ..dequant_run import _created_by_us, _free_bytes
    from ..io.writer import free_space_for, is_fresh_output

    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes <= 0:
        raise UsageError(f"--max-shard-size must be a positive size, got {max_shard_bytes!r}")
    plan = plan_gguf_dequant(gs, dtype=dtype, pattern=pattern)
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise OutputExistsError(f"destination {dst} exists and is not an empty folder")
    base = dict(dst=str(dst), source=tuple(str(p) for p in gs.paths),
                decoded=tuple(t.name for t in plan.tensors if t.type_name not in PLAIN),
                left_out=plan.left_out, bytes_written=plan.total_bytes, tensors=len(plan.specs),
                max_shard_bytes=max_shard_bytes)
    copied = sum(1 for t in plan.tensors if t.type_name in PLAIN)
    if dry_run:
        return GGUFDequantResult(copied=copied, shards=tuple(shard_names(plan.specs, max_shard_bytes)),
                                 dry_run=True, free_bytes=_free_bytes(dst), **base)
    if is_fresh_output(dst, False):
        free_space_for(dst, plan.total_bytes)   # before DST exists, so a refused run leaves nothing behind
    with _created_by_us(dst):
        shards, inexact, nonfinite = _write(gs, plan, dst, dtype=dtype, pattern=pattern, progress=progress,
                                            max_shard_bytes=max_shard_bytes)
    return GGUFDequantResult(copied=copied, inexact=inexact, nonfinite=nonfinite, shards=shards, **base)


def _rows(t: GGUFTensor) -> int:
    return math.prod(t.shape[:-1])


def _write(gs: GGUFSet, plan: _Plan, dst: Path, *, dtype, pattern, progress, max_shard_bytes):
    import gguf
    from tqdm import tqdm

    from ..dequant import JOB, _convert
    from ..io.manifest import RunManifest
    from ..io.writer import ShardedWriter, atomic_write_json

    manifest = RunManifest.begin(dst, job=JOB, options={"dtype": dtype, "tensors": pattern, "source_format": "gguf",
                                                        "max_shard_bytes": max_shard_bytes},
                                 source={"gguf_files": {f.name: f.size for f in gs.files},
                                         "tensors": len(gs.tensors)}, resume=False)
    inexact: dict[str, int] = {}
    nonfinite: dict[str, int] = {}

    def on_final(path: Path) -> None:
        manifest.record(path.name, sha256=writer.sha256[path.name])

    with ShardedWriter(dst, list(plan.specs), max_shard_bytes=max_shard_bytes, on_shard_final=on_final,
                       hash_shards=True) as writer, \
            tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="dequant", disable=not progress) as bar:
        for t in plan.tensors:
            rows, k = _rows(t), t.shape[-1]
            if t.type_name in PLAIN or not t.nbytes:
                step = max(1, CHUNK_BYTES // max(t.row_bytes, 1))
                for r0 in range(0, rows if t.nbytes else 0, step):
                    data = gs.read_rows(t, r0, min(rows, r0 + step))
                    writer.write_chunk(t.name, r0 * t.row_bytes, data)
                    bar.update(len(data))
                continue
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            step = max(1, CHUNK_BYTES // (4 * k))
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                q = np.frombuffer(gs.read_rows(t, r0, r1), np.uint8).reshape(r1 - r0, t.row_bytes)
                x = gguf.quants.dequantize(q, qtype)
                bad = int(np.count_nonzero(~np.isfinite(x)))
                if bad:
                    nonfinite[t.name] = nonfinite.get(t.name, 0) + bad
                y, changed = _convert(x, plan.out_dtype)
                if changed:
                    inexact[t.name] = inexact.get(t.name, 0) + changed
                writer.write_chunk(t.name, r0 * k * y.itemsize, np.ascontiguousarray(y))
                bar.update(y.nbytes)
        written = writer.close()
    atomic_write_json(dst / METADATA_NAME, metadata_document(gs, plan))
    for p in sorted(dst.iterdir()):   # the index and the metadata
        if p.is_file() and not p.name.startswith(".") and p.name not in manifest.records and \
                p.name != manifest.path.name:
            manifest.record(p.name)
    manifest.finish(decoded=sum(1 for t in plan.tensors if t.type_name not in PLAIN),
                    copied=sum(1 for t in plan.tensors if t.type_name in PLAIN), bytes_out=plan.total_bytes)
    return tuple(p.name for p in written), inexact, nonfinite


def metadata_document(gs: GGUFSet, plan: _Plan) -> dict:
    """``k3ckpt_gguf_metadata.json``: the GGUF's metadata and, per tensor, its GGUF type, numpy-order
    shape, file and the dtype it was written as (``null``: left out by ``--tensors``)."""
    out_dtype = {s.name: s.dtype for s in plan.specs}
    return {
        "format": METADATA_FORMAT, "version": METADATA_VERSION,
        "gguf_version": gs.version, "alignment": gs.alignment,
        "files": [asdict(f) for f in gs.files],
        "metadata": metadata_json(gs),
        "tensors": {t.name: {"ggml_type": t.type_name, "shape": list(t.shape), "file": t.file,
                             "written_as": out_dtype.get(t.name)} for t in gs.tensors.values()},
    }
