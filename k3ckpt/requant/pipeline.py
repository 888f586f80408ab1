"""``k3ckpt requant``: the streaming, resumable conversion (docs/requant.md).

``requant_checkpoint(ckpt, dst, ...)`` plans from headers (``plan.py``), then
streams: every output tensor has a fixed place in a fixed shard layout
(``ShardedWriter``), copies go through in chunks, and requantized weights are
computed by a process pool (``worker.py``) at most ``2 x workers`` at a time,
so memory stays at about that many expert tensors whatever the checkpoint
size.  Results are written in plan order, so the bytes never depend on the
worker count or on timing.

Resume: ``k3ckpt-manifest.json`` (``RunManifest``) records the job's options
and source, each final shard with its sha256, and beside each shard a file
with the per-weight results of the weights whose outputs lie in it.  A rerun with ``resume=True``
skips final shards (``done_shards``) and recomputes only what is missing;
the output is byte-identical to an uninterrupted run.  Different options or
another source: ``ResumeMismatchError``.  Nothing partial ever carries a final
name (the writer's temporaries are hidden ``.*.partial`` files).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..checkpoint.identity import source_identity
from ..errors import UsageError
from .plan import DEFAULT_FORMAT, RequantPlan, parse_experts, parse_tensor_types, plan_requant
from .results import TensorResult, _float_out

JOB = "requant"
_SHARD_BYTES = 5_000_000_000


@dataclass(frozen=True)
class RequantResult:
    """What a run did (or, with ``dry_run``, would do).

    Its repr is a one-line summary; the per-weight tables (``results``, ``plan``) are
    attributes, printed only when asked for (at K3's size they hold ~250k rows)."""

    dst: str
    dry_run: bool
    plan: RequantPlan
    results: tuple[TensorResult, ...]     # one per planned weight, in plan order (empty for a dry run)
    copied: int                           # source tensors copied byte for byte
    shards: tuple[str, ...]               # output shard file names
    resumed_shards: tuple[str, ...]       # shards an earlier run had finished
    seconds: float
    estimated_seconds: float
    report: str | None                    # folder holding requant_report.{json,md,svg}
    allocation: dict | None = None        # --target-bpw: Allocation.to_dict() (kept names, achieved bpw)
    compile_seconds: float = 0.0          # of estimated_seconds: compiling kernels (a cold numba cache)
    bytes_written: int = 0                # size of the output's weight shards (0 for a dry run)
    # what api.requant did around the pipeline (None when it did not apply):
    hub: Any = None                       # an hf:// source: hub.convert.HubRun (staging facts)
    budget: Any = None                    # a dry run with max_disk: hub.staged's disk budget check
    pushed: Any = None                    # push_to: hub.push's upload outcome
    cluster: dict | None = None           # --ray: the address and, per node, tasks / busy s / source bytes

    @property
    def bits_per_weight(self) -> float:
        """Average bits per weight over the results (requantized and, with --target-bpw, kept);
        over the plan for a dry run."""
        if self.results:
            p = sum(r.params for r in self.results)
            return 8.0 * sum(r.bytes for r in self.results) / p if p else 0.0
        p = self.plan.params
        return 8.0 * self.plan.out_bytes / p if p else 0.0

    @property
    def bpw(self) -> float:
        """Bits per weight of the selected routed experts as written (``bits_per_weight``)."""
        return self.bits_per_weight

    @property
    def snr_db(self) -> float:
        """Overall SNR in dB of the selected expert weights, pooled (``metrics.pooled_snr_db``);
        NaN for a dry run (nothing measured)."""
        from .metrics import pooled_snr_db

        return pooled_snr_db(r.stats for r in self.results) if self.results else math.nan

    @property
    def paths(self) -> tuple[str, ...]:
        """The output shard files."""
        return tuple(str(Path(self.dst) / s) for s in self.shards)

    @property
    def report_paths(self) -> tuple[str, ...]:
        """requant_report.json, .md and .svg (empty when no report was written)."""
        if self.report is None:
            return ()
        from .report import JSON_NAME, MARKDOWN_NAME, SVG_NAME

        return tuple(str(Path(self.report) / n) for n in (JSON_NAME, MARKDOWN_NAME, SVG_NAME))

    def __repr__(self) -> str:
        formats = sorted({f"{w.format}:{w.method}" if w.method else w.format for w in self.plan.weights})
        head = f"RequantResult(dst={self.dst!r}, {len(self.plan.weights)} weights to {'/'.join(formats) or '-'}"
        if self.dry_run:
            return (f"{head}, {self.bits_per_weight:.4f} bpw, would write {self.plan.total_bytes:,} bytes, "
                    f"estimated {self.estimated_seconds:.0f} s, dry run)")
        return (f"{head}, {self.bits_per_weight:.4f} bpw, SNR {self.snr_db:.2f} dB, {self.bytes_written:,} bytes "
                f"in {len(self.shards)} shard(s), {self.seconds:.1f} s, report={self.report!r}; "
                f"per-weight rows: .results)")

    def to_dict(self) -> dict:
        snr = self.snr_db
        return {
            "dst": self.dst, "dry_run": self.dry_run, "weights": len(self.plan.weights),
            "params": self.plan.params, "bytes_in": self.plan.in_bytes, "bytes_out": self.plan.out_bytes,
            "total_bytes": self.plan.total_bytes, "bits_per_weight": self.bits_per_weight,
            "snr_db": None if math.isnan(snr) else _float_out(snr),
            "bytes_written": self.bytes_written, "paths": list(self.paths), "report_paths": list(self.report_paths),
            "copied": self.copied, "kept": list(self.plan.kept), "shards": list(self.shards),
            "resumed_shards": list(self.resumed_shards), "seconds": self.seconds,
            "estimated_seconds": self.estimated_seconds, "compile_seconds": self.compile_seconds,
            "report": self.report, "allocation": self.allocation,
            "plan": [w.to_dict() for w in self.plan.weights] if self.dry_run else [],
            "results": [r.to_dict() for r in self.results],
            **self._around_dict(),
        }

    def _around_dict(self) -> dict:
        out: dict = {}
        if self.budget is not None:
            b = self.budget
            out["max_disk"] = {"max_disk": b.max_disk, "need": b.need, "ok": b.ok, "output_estimate": b.output_bytes,
                               "largest_shard_bytes": b.largest_shard_bytes}
        if self.hub is not None:
            out["hub"] = self.hub.facts()
        if self.pushed is not None:
            out["pushed"] = self.pushed.to_dict()
        if self.cluster is not None:
            out["ray"] = self.cluster
        return out


def _local_path(ckpt) -> str | None:
    """A path pool workers can reopen the source from (None for remote sources)."""
    if not ckpt.origin.is_local() or ckpt.root is None:
        return None
    root = Path(ckpt.root)
    if (root / "model.safetensors.index.json").is_file() or len(ckpt.shards) > 1:
        return str(root)
    return str(root / ckpt.shards[0])


def requant_checkpoint(ckpt, dst, *, format: str = DEFAULT_FORMAT, experts=None, tensor_type=(),
                       workers: int | None = None, dry_run: bool = False, resume: bool = False,
                       report_path=None, progress: bool = True, max_shard_bytes: int | None = None,
                       source_label: str | None = None, target_bpw: float | None = None,
                       on_result: Callable[[TensorResult], None] | None = None,
                       layout: str | None = None,
                       on_compile: Callable[[float], None] | None = None, imatrix=None,
                       ray: str | None = None) -> RequantResult:
    """Write ``dst``: ``ckpt`` with its routed-expert weights in ``format``.

    Sources: MXFP4, block FP8, INT4 pack-quantized, NVFP4 or BF16/F16/F32
    routed experts (``sources.py``); non-MXFP4 ones are decoded to float32 and
    the error is measured against those values.  ``format``: ``moet-w2``
    (refit), ``moet-w2:keep-scales``, ``k3ckpt-mx2``, ``mxfp4`` (with
    ``layout`` ``compressed-tensors`` or ``gpt-oss``), or another registered
    format; ``experts``: a regex on logical weight names or
    a list of projections; ``tensor_type``: ``[(regex, format)]`` overrides
    (first match wins; ``keep`` leaves a weight in MXFP4).  ``target_bpw``:
    measure every selected weight first, then keep in MXFP4 those whose error
    per extra byte is largest so the average meets the target (``allocate.py``).
    ``on_result`` is called in the parent after each weight's result is written
    (in plan order); ``on_compile(seconds)`` once before the data pass when numba's cache
    lacks the plan's kernels (the CLI says "compiling kernels (first run only)").
    ``imatrix``: a llama.cpp importance-matrix file (``importance.py``): weighted encoders
    (``FormatInfo.weighted``) weigh their error by it, and every weight it has an entry for
    reports its weighted error beside the plain one; checked against the plan before anything
    is written.  ``ray``: a Ray cluster's address (or ``auto``) to compute the weights on
    (``raypool``); the source and ``dst`` must be paths every node sees.  The bytes are the same.
    """
    t0 = time.perf_counter()
    max_shard_bytes = _SHARD_BYTES if max_shard_bytes is None else int(max_shard_bytes)
    if max_shard_bytes <= 0:
        raise UsageError(f"--max-shard-size must be above zero, found {max_shard_bytes} bytes")
    if ray is not None and not dry_run:
        from ..raypool import join

        workers = join(ray, workers)
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise UsageError(f"workers must be >= 1, found {workers}")
    if not dry_run and ray is None:
        from ._stream import start_pool_server

        start_pool_server(workers)
    plan = plan_requant(ckpt, format=format, experts=experts, tensor_type=tensor_type, layout=layout)
    importance = None
    if imatrix is not None:
        from .importance import load_importance

        importance = load_importance(imatrix, plan.weights)
    from .kernels import compile_seconds

    compiling = compile_seconds(plan)   # numba's cache is cold: the first run compiles
    estimate = plan.estimated_seconds(workers) + compiling
    if target_bpw is not None:
        other = next((w for w in plan.weights if not w.from_mxfp4 or w.out_offsets is not None), None)
        if other is not None:
            raise UsageError(f"--target-bpw mixes the 2.25 formats with the source's MXFP4; {other.name} is "
                             f"stored as {other.source_format}", tensor=other.name)
        low = 8.0 * plan.out_bytes / plan.params if plan.params else 0.0
        high = 8.0 * plan.in_bytes / plan.params if plan.params else 0.0
        if not (low - 1e-9 <= float(target_bpw) <= high + 1e-9):   # also refuses NaN
            # Above the source's own bpw every weight stays MXFP4: a copy, not a requant.
            raise UsageError(f"--target-bpw {target_bpw:g} is outside the range that works here: {low:.4f} "
                             f"(every selected weight in {format}) to {high:.4f} (all kept as the source's MXFP4)")
    if dry_run:
        return RequantResult(str(dst), True, plan, (), len(plan.copies), (), (), time.perf_counter() - t0,
                             estimate, None, compile_seconds=compiling)
    dst = Path(dst)
    if ckpt.root is not None and dst.resolve() == Path(ckpt.root).resolve():
        raise UsageError("destination is the source folder; choose a new folder", file=str(dst))

    from ..io.manifest import MANIFEST_NAME, RunManifest

    rx, projections = parse_experts(experts)
    options = {"format": format, "experts": rx, "projections": sorted(projections) if projections else None,
               "tensor_type": [[r, c.spec] for r, c in parse_tensor_types(tensor_type)],
               "max_shard_bytes": max_shard_bytes, "target_bpw": target_bpw}
    if layout is not None:   # only when given, so manifests of earlier runs still match
        options["layout"] = layout
    if importance is not None:   # the file's name and size: a resume must use the same one
        options["imatrix"] = importance.identity()
    from ..io.writer import free_space_for, is_fresh_output

    if is_fresh_output(dst, resume):
        free_space_for(dst, plan.total_bytes)
    source = source_identity(ckpt)
    if resume:
        _check_resume(dst, options, source)
    manifest = RunManifest.begin(dst, job=JOB, options=options, source=source, resume=resume)
    allocation = None
    kept_results: list[TensorResult] = []
    source_order = {w.name: w.index for w in plan.weights}
    if target_bpw is not None:
        plan, allocation, kept_results = _allocate(ckpt, plan, manifest, target_bpw, workers=workers,
                                                   progress=progress, importance=importance, ray=ray is not None,
                                                   format=format, experts=experts, tensor_type=tensor_type,
                                                   layout=layout)
    if compiling and on_compile is not None:
        on_compile(compiling)
    from ._stream import saved_results, stream

    results: dict[int, TensorResult] = {}
    by_name = {w.name: w.index for w in plan.weights}
    done = []
    for shard in (n for n in manifest.records if n.endswith(".safetensors") and manifest.done(n)):
        saved = saved_results(manifest, shard)
        if saved is None:
            continue     # its results are gone: write the shard again
        done.append(shard)
        for r in saved:
            if r.name in by_name:
                results[by_name[r.name]] = r

    nodes: list = []
    shards = stream(ckpt, plan, dst, manifest, results, done_shards=done, workers=workers,
                    src_path=_local_path(ckpt), progress=progress, max_shard_bytes=max_shard_bytes,
                    resume=resume, on_result=on_result, importance=importance, ray=ray is not None,
                    node_stats=nodes)
    ordered = tuple(sorted([results[w.index] for w in plan.weights] + kept_results,
                           key=lambda r: source_order[r.name]))
    _finish_side_files(ckpt, dst, plan, manifest)
    report = _write_report(ordered, Path(report_path) if report_path else dst, source_label or str(ckpt.root),
                           format, options, commit=ckpt.origin.commit,
                           imatrix=None if importance is None else importance.describe())
    for p in sorted(dst.iterdir()):
        if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST_NAME and p.name not in manifest.records:
            manifest.record(p.name)
    elapsed = time.perf_counter() - t0
    manifest.finish(weights=len(ordered), params=plan.params, bytes_out=plan.out_bytes,
                    bits_per_weight=8.0 * plan.out_bytes / plan.params if plan.params else 0.0)
    return RequantResult(str(dst), False, plan, ordered, len(plan.copies), tuple(shards), tuple(done), elapsed,
                         estimate, report, allocation, compile_seconds=compiling,
                         bytes_written=sum((dst / n).stat().st_size for n in shards),
                         cluster=None if ray is None else {"address": ray, "workers": workers, "nodes": nodes})


# Manifest option keys and the flags that set them (the mismatch message names the flag).
_OPTION_FLAGS = {"format": "--format", "experts": "--experts", "projections": "--experts",
                 "tensor_type": "--tensor-type", "max_shard_bytes": "--max-shard-size", "target_bpw": "--target-bpw",
                 "layout": "--layout", "imatrix": "--imatrix"}


def _show(key: str, value) -> str:
    if value is None or value == []:
        return "not given"
    if key == "tensor_type":
        return " ".join(f"{r}={f}" for r, f in value)
    if key == "projections":
        return ",".join(value)
    return str(value)


def _check_resume(dst: Path, options: dict, source: dict) -> None:
    """A resumed run with other settings: one line naming the first differing flag(s), in the
    user's terms (the manifest's own check would list the whole option and source dicts)."""
    import json as _json

    from ..errors import ResumeMismatchError
    from ..io.manifest import MANIFEST_NAME, RunManifest

    if not (dst / MANIFEST_NAME).is_file():
        return
    old = RunManifest.load(dst)
    if old._data.get("job") != JOB:
        return   # another job's folder: the manifest's own check says so
    new_opts = _json.loads(_json.dumps(options, sort_keys=True))
    diffs = []
    for key in sorted(set(old.options) | set(new_opts), key=lambda k: (k not in _OPTION_FLAGS, k)):
        a, b = old.options.get(key), new_opts.get(key)
        if a != b:
            flag = _OPTION_FLAGS.get(key, key)
            if not any(d.startswith(flag + " ") for d in diffs):
                diffs.append(f"{flag} was {_show(key, a)}, now {_show(key, b)}")
    if diffs:
        more = f" (and {len(diffs) - 2} more)" if len(diffs) > 2 else ""
        raise ResumeMismatchError(f"cannot resume: {'; '.join(diffs[:2])}{more}; pass the same options as the "
                                  "first run, or a new DST", file=str(dst))
    new_src = _json.loads(_json.dumps(source, sort_keys=True))
    if old.source != new_src:
        shards_a, shards_b = old.source.get("shards", {}), new_src.get("shards", {})
        changed = sorted(n for n in set(shards_a) | set(shards_b) if shards_a.get(n) != shards_b.get(n))
        what = (f"shard {changed[0]} differs" + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
                if changed else "its config.json or tensor count differs")
        raise ResumeMismatchError(f"cannot resume: SRC is not the checkpoint the first run read ({what}); "
                                  "pass the same SRC, or a new DST", file=str(dst))


def _allocate(ckpt, plan: RequantPlan, manifest, target_bpw: float, *, workers: int, progress: bool,
              importance=None, ray: bool = False, **plan_kw):
    """Measure every planned weight, choose which stay MXFP4, and re-plan with them kept.  The
    error is the importance-weighted one when every weight has an importance entry (weighted and
    plain errors are in different units, so they are never mixed).

    The choice is saved beside the manifest, so a resumed run does not measure again."""
    from ._stream import RESULTS_DIR, load_state, measure, save_state
    from .allocate import Candidate, allocate
    from .metrics import ErrorStats

    state = f"{RESULTS_DIR}/allocation.json"
    saved = load_state(manifest, state)
    if saved is None:
        measured = measure(ckpt, list(plan.weights), workers=workers, src_path=_local_path(ckpt),
                           progress=progress, importance=importance, ray=ray)
        weighted = all(r.weighted is not None for r in measured.values())

        def error(r: TensorResult) -> float:
            return r.weighted[1] if weighted else r.stats.count * r.stats.err_rms ** 2

        cands = []
        for unit, ws in plan.units().items():
            rs = [measured[w.index] for w in ws]
            cands.append(Candidate(unit, sum(w.params for w in ws), sum(w.in_bytes for w in ws),
                                   sum(r.bytes for r in rs), sum(error(r) for r in rs)))
        alloc = allocate(cands, target_bpw)
        kept = [measured[w.index] for unit in sorted(alloc.keep) for w in plan.units()[unit]]
        saved = {**alloc.to_dict(), "kept_results": [r.to_dict() for r in kept]}
        save_state(manifest, state, saved)
    kept_units = set(saved["keep"])
    keep_names = {w.name for unit, ws in plan.units().items() if unit in kept_units for w in ws}
    by_name = {w.name: w for w in plan.weights}
    kept_results = []
    for d in saved["kept_results"]:
        r = TensorResult.from_dict(d)
        w = by_name[r.name]
        exact = ErrorStats(count=r.stats.count, nonfinite=0, snr_db=float("inf"), rel_mse=0.0, rel_rms=0.0,
                           mean_bias=0.0, bias_rel_rms=0.0, max_abs=0.0, cosine=1.0, ref_rms=r.stats.ref_rms,
                           err_rms=0.0)
        kept_results.append(TensorResult(
            name=r.name, layer=r.layer, expert=r.expert, projection=r.projection, format=w.source_format,
            method=None, params=r.params, bytes=w.in_bytes, stats=exact, max_row_bias=0.0,
            source_zero_fraction=r.source_zero_fraction, code_histogram=(), scale_changes=None,
            weighted=None if r.weighted is None else (r.weighted[0], 0.0)))
    new_plan = plan_requant(ckpt, keep=keep_names, **plan_kw)
    allocation = {k: v for k, v in saved.items() if k != "kept_results"}
    return new_plan, allocation, kept_results


def _finish_side_files(ckpt, dst: Path, plan: RequantPlan, manifest) -> None:
    """config.json with the new quantization_config, and the side files (tokenizer, ...)."""
    from ..checkpoint.side_files import copy_side_files, is_weight_file
    from ..io.writer import atomic_write_json
    from ..io.manifest import MANIFEST_NAME
    from .plan import GPT_OSS_MXFP4, MXFP4
    from ..checkpoint.qconfig import build_config, with_config
    from .mxfp4_config import mxfp4_config

    # Always a config.json: without one a reader could not tell moet-w2 parts from MXFP4's.
    groups = plan.groups()
    if not groups:
        config = ckpt.config or {}      # nothing re-encoded (e.g. MXFP4 to MXFP4): the source's own config
    elif set(groups) <= {(MXFP4, None), (GPT_OSS_MXFP4, None)}:
        config = with_config(ckpt.config or {}, mxfp4_config(ckpt, plan))
    else:
        config = with_config(ckpt.config or {}, build_config(ckpt.config, groups))
    atomic_write_json(dst / "config.json", config)
    src_root = Path(ckpt.root) if ckpt.root is not None and Path(ckpt.root).is_dir() else None
    if ckpt.origin.is_local():
        copy_side_files(src_root, dst, skip=lambda n: is_weight_file(n) or n == MANIFEST_NAME
                        or n.startswith("requant_report."))


def _write_report(results: tuple[TensorResult, ...], folder: Path, source: str, format: str,
                  options: dict, commit: str | None = None, imatrix: dict | None = None) -> str | None:
    if not results:
        return None
    from .report import write_report

    formats = tuple(dict.fromkeys([format] + [f for _, f in options.get("tensor_type", [])]))
    write_report(results, folder, meta={"source": source, "formats": formats, "options": options,
                                        "source_commit": commit, "imatrix": imatrix})
    return str(folder)
