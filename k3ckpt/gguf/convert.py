"""A checkpoint to a GGUF file (or splits) that llama.cpp loads (``kimi-k3``, ``deepseek2``).

One streaming pass: the plan (``arch.plan``: the layout's tensors) and metadata are fixed
first, then each tensor is produced in pieces (``produce.tensor_pieces``) and
written at its final offset (``writer.GGUFWriter``), so memory is bounded by one
expert, never a layer or the model.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnsupportedError, UsageError
from ..requant.results import _float_out
from . import container as C
from .tensors import BF16, F16, F32, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_XXS, MXFP4, Q2_K, Q8_0
from .vocab import tokenizer_metadata

# --expert-type / --outtype spellings (ggml's names, any case) -> ggml type
EXPERT_TYPES = {C.type_name(t).lower(): t for t in (MXFP4, IQ2_XS, IQ2_XXS, IQ2_S, IQ1_S, IQ1_M, Q2_K, IQ3_XXS,
                                                    Q8_0, BF16, F16, F32)}
OUT_TYPES = {C.type_name(t).lower(): t for t in (BF16, F16, Q8_0, F32)}
# llama.cpp's llama_ftype for a file labelled by its expert type (LlamaFileType)
FILE_TYPES = {MXFP4: 38, IQ2_XS: 20, IQ2_XXS: 19, IQ2_S: 28, IQ1_S: 24, IQ1_M: 31, Q2_K: 10, IQ3_XXS: 23, Q8_0: 7, BF16: 32,
              F16: 1, F32: 0}


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
    resumed: tuple[str, ...] = ()      # splits an earlier run had finished (kept, not written again)
    seconds: float = 0.0
    workers: int = 1
    estimated_seconds: float | None = None            # a dry run's estimate of a run's time
    estimate: object | None = field(default=None, repr=False)   # run.Estimate: how it was reached
    manifest: Path | None = None       # PREFIX.k3ckpt-manifest.json beside the output
    hub: dict | None = field(default=None, repr=False)      # hf:// sources: pinned source, staging figures
    budget: dict | None = field(default=None, repr=False)   # hf:// with --max-disk: need, ok, message
    report: Path | None = None         # folder of requant_report.{json,md,svg}: the routed experts' error
    snr_db: float | None = None        # the routed experts' pooled SNR against the source values
    weighted_snr_db: float | None = None   # --imatrix: the same, importance-weighted (experts with an entry)
    cluster: dict | None = None        # --ray: the address and, per node, tasks / busy s / source bytes
    allocation: dict | None = None     # --target-bpw: requant.allocate.Allocation.to_dict() (types chosen)

    def __repr__(self) -> str:
        verb = "would write" if self.dry_run else "wrote"
        return (f"GGUFResult({verb} {len(self.paths)} file(s), {self.tensors} tensors, {self.bytes_written:,} bytes, "
                f"{len(self.skipped)} source tensors skipped)")

    def to_dict(self) -> dict:
        return {"dry_run": self.dry_run, "paths": [str(p) for p in self.paths], "tensors": self.tensors,
                "bytes": self.bytes_written, "bytes_by_type": dict(self.bytes_by_type),
                "skipped": list(self.skipped), "free_bytes": self.free_bytes, "resumed": list(self.resumed),
                "seconds": self.seconds, "workers": self.workers, "estimated_seconds": self.estimated_seconds,
                "estimate": self.estimate.to_dict() if self.estimate is not None else None,
                "manifest": str(self.manifest) if self.manifest is not None else None,
                "hub": self.hub, "max_disk": self.budget,
                "report": str(self.report) if self.report is not None else None,
                "snr_db": _float_out(self.snr_db) if self.snr_db is not None else None,
                "weighted_snr_db": _float_out(self.weighted_snr_db) if self.weighted_snr_db is not None else None,
                "allocation": self.allocation,
                **({} if self.cluster is None else {"ray": self.cluster})}


def plan_gguf_types(ckpt, *, expert_type: str = "iq2_xs", outtype: str | None = None, tensor_type=(),
                    fallback_type: str | None = None, target_bpw: float | None = None, target_types=None,
                    chat_template: str | os.PathLike | None = None, measure: bool = True, progress: bool = False,
                    imatrix: str | os.PathLike | None = None):
    """(metadata, planned tensors, skipped source names, ``choose.TypeChoice``) for a checkpoint
    ``arch`` maps. ``tensor_type``: ``["REGEX=TYPE", ...]``; ``fallback_type``: the type of a tensor
    whose rows the asked-for type cannot hold; ``target_bpw``: measured mixed precision over
    ``target_types`` (ggml type names; default ``choose.TARGET_FAMILY``), errors weighted by
    ``imatrix`` where it covers every expert tensor (with ``measure=False``, as for a dry run,
    every expert stays at ``expert_type``); ``chat_template``: a file whose text is written as
    ``tokenizer.chat_template`` (in place of the source's)."""
    from .arch import plan
    from .choose import allocate_experts, assign_types, parse_tensor_types

    et = ggml_type(expert_type, EXPERT_TYPES, "--expert-type")
    ot = None if outtype is None else ggml_type(outtype, OUT_TYPES, "--outtype")
    fb = None if fallback_type is None else ggml_type(fallback_type, EXPERT_TYPES, "--fallback-type")
    overrides = parse_tensor_types(tensor_type, EXPERT_TYPES)
    tts = parse_target_types(target_types)
    if target_bpw is not None and not 0 < float(target_bpw) < 32:
        raise UsageError(f"--target-bpw must be a number of bits per weight, found {target_bpw}")
    # experts planned as F32 (every row size holds it); assign_types gives them their types
    kvs, planned, skipped, text = plan(ckpt, expert_type=F32, outtype=ot, file_type=FILE_TYPES[et])
    planned, choice = assign_types(planned, expert_type=et, overrides=overrides, fallback_type=fb,
                                   types=EXPERT_TYPES)
    if target_bpw is not None and measure:
        planned, alloc = allocate_experts(ckpt, planned, float(target_bpw), types=tts,
                                          pinned={n for n, _ in choice.overridden},
                                          importance=load_importance(imatrix, planned), progress=progress)
        choice = dataclasses.replace(choice, allocation=alloc)
    if ckpt.root is None:
        raise UnsupportedError("the vocabulary is read from the checkpoint's folder; pass a local folder")
    vocab = tokenizer_metadata(ckpt.root, int(text["vocab_size"]))
    if chat_template is not None:
        vocab = [kv for kv in vocab if kv.key != "tokenizer.chat_template"] + \
            [C.KV("tokenizer.chat_template", C.STRING, _read_template(chat_template))]
    return kvs + vocab, planned, skipped, choice


def parse_target_types(names) -> tuple[int, ...] | None:
    """``--target-types``: ggml type names (a list, or one comma-separated string) -> ggml types;
    None or empty: None (the family default)."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    if not names:
        return None
    return tuple(dict.fromkeys(ggml_type(n, EXPERT_TYPES, "--target-types") for n in names))


def load_importance(imatrix: str | os.PathLike | None, planned):
    """``--imatrix``'s ``requant.importance.Importance`` for the planned expert tensors (checked
    against their names and row sizes), or None without one."""
    if imatrix is None:
        return None
    from ..requant.importance import load_gguf_importance

    return load_gguf_importance(imatrix, [(p.info.name, int(p.info.shape[0]), int(p.info.shape[-1]))
                                          for p in planned if p.recipe.kind == "experts"])


def _read_template(path: str | os.PathLike) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--chat-template {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--chat-template {path}: cannot be read as UTF-8 text ({e})") from None
    if not text.strip():
        raise UsageError(f"--chat-template {path} is empty")
    return text


def plan_gguf(ckpt, **options):
    """(metadata, planned tensors, skipped source names); ``plan_gguf_types`` without the choice."""
    kvs, planned, skipped, _ = plan_gguf_types(ckpt, **options)
    return kvs, planned, skipped


def write_gguf(ckpt, out: str | os.PathLike, *, expert_type: str = "iq2_xs", outtype: str | None = None,
               split_max_bytes: int | None = DEFAULT_SPLIT_BYTES, dry_run: bool = False, progress: bool = False,
               resume: bool = False, workers: int | None = 1, tensor_type=(), target_bpw: float | None = None,
               target_types=None, fallback_type: str | None = None, chat_template: str | os.PathLike | None = None,
               vocab_dir: str | os.PathLike | None = None, report: str | os.PathLike | None = None,
               imatrix: str | os.PathLike | None = None, ray: str | None = None) -> GGUFResult:
    """Write ``out`` (or its ``-0000i-of-0000N`` splits) from ``ckpt``, with its manifest beside it
    (``run``: resumable split by split, experts encoded by ``workers`` processes; the bytes depend on
    neither).  ``dry_run``: the files, tensors and bytes it would write, the free space and a time
    estimate; nothing is written.  ``vocab_dir``: the folder holding the vocabulary files when it is
    not ``ckpt.root`` (an ``hf://`` source's fetched side files).  ``imatrix``: a llama.cpp
    importance matrix for the weighted encoders and the report (``requant.importance``); ``ray``:
    a Ray cluster (``HOST:PORT`` or ``auto``) that encodes the experts (``raypool``)."""
    from .run import dry_result, estimate, plan_job, precheck, resolve_workers, run_job, with_root

    if ray is not None and not dry_run:
        from ..raypool import join

        workers = join(ray, workers)
    n = resolve_workers(workers)
    view = with_root(ckpt, vocab_dir)
    if not dry_run:
        precheck(view, out, resume=resume, expert_type=expert_type, outtype=outtype, split_max_bytes=split_max_bytes,
                 tensor_type=tensor_type, target_bpw=target_bpw, target_types=target_types,
                 fallback_type=fallback_type, imatrix=imatrix)
    job = plan_job(view, out, expert_type=expert_type, outtype=outtype, split_max_bytes=split_max_bytes,
                   tensor_type=tensor_type, target_bpw=target_bpw, target_types=target_types,
                   fallback_type=fallback_type, chat_template=chat_template, measure=not dry_run, progress=progress,
                   imatrix=imatrix)
    if dry_run:
        return dry_result(job, estimate(view, job, n))
    return run_job(view, job, resume=resume, workers=n, report=report, progress=progress, ray=ray)
