"""A checkpoint to a GGUF file (or splits) that llama.cpp loads (``kimi-k3``, ``deepseek2``).

One streaming pass: the plan (``arch.plan``: the layout's tensors) and metadata are fixed
first, then each tensor is produced in pieces (``produce.tensor_pieces``) and
written at its final offset (``writer.GGUFWriter``), so memory is bounded by one
expert, never a layer or the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnsupportedError, UsageError
from . import container as C
from .produce import tensor_pieces
from .tensors import BF16, F16, F32, IQ2_XS, MXFP4, Q8_0
from .vocab import tokenizer_metadata  # noqa: F401  (re-exported: the vocabulary keys of a folder)
from .writer import GGUFWriter

# --expert-type / --outtype spellings (ggml's names, any case) -> ggml type
EXPERT_TYPES = {"mxfp4": MXFP4, "iq2_xs": IQ2_XS, "q8_0": Q8_0, "bf16": BF16, "f16": F16, "f32": F32}
OUT_TYPES = {k: EXPERT_TYPES[k] for k in ("bf16", "f16", "q8_0", "f32")}
# llama.cpp's llama_ftype for a file labelled by its expert type (LlamaFileType)
FILE_TYPES = {MXFP4: 38, IQ2_XS: 20, Q8_0: 7, BF16: 32, F16: 1, F32: 0}


def ggml_type(name: str, table: dict[str, int], option: str) -> int:
    key = name.strip().lower()
    if key not in table:
        raise UsageError(f"{option} {name!r} is not one of {', '.join(sorted(table))}")
    return table[key]


DEFAULT_SPLIT_BYTES = 48 * 10**9     # below the Hub's 50 GB per-file limit; K3 at IQ2_XS is 20 files


@dataclass(frozen=True)
class GGUFResult:
    """What ``gguf`` wrote (or, with ``dry_run``, would write)."""

    paths: tuple[Path, ...]
    tensors: int
    bytes_written: int
    bytes_by_type: dict[str, int] = field(repr=False)
    skipped: tuple[str, ...] = field(repr=False)
    dry_run: bool = False
    free_bytes: int | None = None      # on the output's filesystem, for a dry run

    def __repr__(self) -> str:
        verb = "would write" if self.dry_run else "wrote"
        return (f"GGUFResult({verb} {len(self.paths)} file(s), {self.tensors} tensors, {self.bytes_written:,} bytes, "
                f"{len(self.skipped)} source tensors skipped)")

    def to_dict(self) -> dict:
        return {"dry_run": self.dry_run, "paths": [str(p) for p in self.paths], "tensors": self.tensors,
                "bytes": self.bytes_written, "bytes_by_type": dict(self.bytes_by_type),
                "skipped": list(self.skipped), "free_bytes": self.free_bytes}


def plan_gguf(ckpt, *, expert_type: str = "iq2_xs", outtype: str | None = None):
    """(metadata, planned tensors, skipped source names) for a checkpoint ``arch`` maps."""
    from .arch import plan

    et = ggml_type(expert_type, EXPERT_TYPES, "--expert-type")
    ot = None if outtype is None else ggml_type(outtype, OUT_TYPES, "--outtype")
    kvs, planned, skipped, text = plan(ckpt, expert_type=et, outtype=ot, file_type=FILE_TYPES[et])
    if ckpt.root is None:
        raise UnsupportedError("the vocabulary is read from the checkpoint's folder; pass a local folder")
    return kvs + tokenizer_metadata(ckpt.root, int(text["vocab_size"])), planned, skipped


def write_gguf(ckpt, out: str | os.PathLike, *, expert_type: str = "iq2_xs", outtype: str | None = None,
               split_max_bytes: int | None = DEFAULT_SPLIT_BYTES, dry_run: bool = False,
               progress: bool = False) -> GGUFResult:
    """Write ``out`` (or its ``-0000i-of-0000N`` splits) from ``ckpt``; see the module docstring.
    ``dry_run``: the files, tensors and bytes it would write, checked against the free space."""
    from tqdm import tqdm

    from ..io.writer import free_bytes, free_space_for

    kvs, planned, skipped = plan_gguf(ckpt, expert_type=expert_type, outtype=outtype)
    by_type: dict[str, int] = {}
    for p in planned:
        name = C.type_name(p.info.ggml_type)
        by_type[name] = by_type.get(name, 0) + p.info.nbytes
    infos = [p.info for p in planned]
    w = GGUFWriter(out, kvs, infos, split_max_bytes=split_max_bytes)
    if dry_run:
        return GGUFResult(tuple(w.paths), len(infos), w.total_size, by_type, tuple(skipped), dry_run=True,
                          free_bytes=free_bytes(Path(out).parent))
    free_space_for(out, w.total_size)
    with w, tqdm(total=w.total_size, unit="B", unit_scale=True, desc="gguf", disable=not progress) as bar:
        for p in planned:
            for piece in tensor_pieces(ckpt, p):
                w.write(p.info.name, piece)
                bar.update(len(piece))
    return GGUFResult(tuple(w.paths), len(infos), w.total_size, by_type, tuple(skipped))
