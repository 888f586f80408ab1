"""One ``k3ckpt gguf`` run: plan, estimate, then write resumably with experts from a worker pool.

``plan_job`` fixes everything from headers (and the vocabulary files): the
tensors, every file's layout, the options and the source identity the
manifest records.  ``estimate`` times the expert encoder on a small synthetic
sample (the dry run's time estimate).  ``run_job`` writes: tensors in plan
order, routed experts produced by ``pool.ExpertRunner`` when ``workers`` > 1,
each split final as soon as its last byte is in (``writer.GGUFWriter``) and
then recorded in the manifest with its sha256 (``manifest.GGUFManifest``).
A resumed run keeps the splits the manifest lists (their header bytes are
checked against the plan) and writes the others again, so its files are the
same bytes as an uninterrupted run's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import UnsupportedError, UsageError
from ..formats import ids
from . import container as C
from ..checkpoint.identity import source_identity
from .manifest import GGUFManifest, manifest_path
from .tensors import IQ2_XS, Planned
from .writer import partial_path, plan_files

# IQ2_XS weights encoded per second on one core when the dry run cannot time it (the kernel is not
# compiled yet: timing it would compile it, ~33 s). 9-12 M/s per core in docs/BENCHMARKS.md
# (`python tools/bench_iq2xs.py`); the low end, since a real run also decodes and writes.
ENCODE_RATE = 9e6
# Bytes per second for everything but the routed experts (read, convert, write): 0.16 GB/s measured
# on 2 shared cores by writing a 0.94 GB BF16 tensor (65536 x 7168) through produce.tensor_pieces and
# GGUFWriter (fsync and sha256 included): 5.9 s.
COPY_RATE = 160e6
SAMPLE_ROWS = 256          # rows of one expert the dry run encodes to time the encoder


@dataclass(frozen=True)
class Job:
    """What a run writes, fixed before anything is written."""

    out: Path
    kvs: tuple
    planned: tuple[Planned, ...]
    skipped: tuple[str, ...]
    files: tuple[tuple[Path, C.FileLayout], ...]
    split_max_bytes: int | None
    options: dict
    source: dict
    importance: object | None = None    # requant.importance.Importance (--imatrix) or None
    allocation: dict | None = None      # --target-bpw: the types chosen (Allocation.to_dict())

    @property
    def paths(self) -> tuple[Path, ...]:
        return tuple(p for p, _ in self.files)

    @property
    def total_size(self) -> int:
        return sum(lay.size for _, lay in self.files)

    def bytes_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.planned:
            name = C.type_name(p.info.ggml_type)
            out[name] = out.get(name, 0) + p.info.nbytes
        return out

    def split_plan(self) -> dict[str, list[list]]:
        return {path.name: [[t.name, C.type_name(t.ggml_type), list(t.shape)] for t in lay.tensors]
                for path, lay in self.files}


@dataclass(frozen=True)
class Estimate:
    """How long a run should take: expert encoding spread over the workers, plus copying."""

    seconds: float
    workers: int
    encode: tuple[dict, ...]        # per (source, ggml type): weights, weights_per_s, measured
    copy_bytes: int
    copy_rate: float
    compile_seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "workers": self.workers, "encode": list(self.encode),
                "copy_bytes": self.copy_bytes, "copy_bytes_per_s": self.copy_rate,
                "compile_seconds": self.compile_seconds}


class _Rooted:
    """``ckpt`` with another ``root``: the folder holding the vocabulary files (an ``hf://``
    source's fetched side files); everything else is ``ckpt``'s."""

    def __init__(self, ckpt, root: Path):
        self._ckpt = ckpt
        self.root = root

    def __getattr__(self, name):
        return getattr(self._ckpt, name)


def with_root(ckpt, root: str | os.PathLike | None):
    return ckpt if root is None else _Rooted(ckpt, Path(root))


def job_options(*, expert_type: str = "iq2_xs", outtype: str | None = None, split_max_bytes: int | None = None,
                tensor_type=(), target_bpw: float | None = None, target_types=None,
                fallback_type: str | None = None, chat_template: str | os.PathLike | None = None,
                imatrix: str | os.PathLike | None = None) -> dict:
    """The options a manifest records (those that change the bytes; not ``workers``); an
    importance matrix by its file's name and size, and only when given (earlier manifests match);
    with ``target_bpw``, the types it chooses from."""
    out = {"expert_type": expert_type.strip().lower(), "outtype": outtype.strip().lower() if outtype else None,
           "split_max_bytes": split_max_bytes, "tensor_type": list(tensor_type), "target_bpw": target_bpw,
           "fallback_type": fallback_type.strip().lower() if fallback_type else None,
           "chat_template": str(chat_template) if chat_template is not None else None}
    if target_bpw is not None:
        from .choose import TARGET_FAMILY
        from .convert import parse_target_types

        out["target_types"] = [C.type_name(t).lower() for t in parse_target_types(target_types) or TARGET_FAMILY]
    if imatrix is not None:
        p = Path(imatrix)
        out["imatrix"] = {"name": p.name, "bytes": p.stat().st_size if p.is_file() else None}
    return out


def precheck(ckpt, out: str | os.PathLike, *, resume: bool, **options) -> None:
    """Refuse, before planning, what ``GGUFManifest.begin`` would refuse after it (``precheck``)."""
    GGUFManifest.precheck(out, options=job_options(**options), source=source_identity(ckpt), resume=resume)


def plan_job(ckpt, out: str | os.PathLike, *, expert_type: str = "iq2_xs", outtype: str | None = None,
             split_max_bytes: int | None = None, tensor_type=(), target_bpw: float | None = None,
             target_types=None, fallback_type: str | None = None, chat_template: str | os.PathLike | None = None,
             measure: bool = True, progress: bool = False, imatrix: str | os.PathLike | None = None) -> Job:
    """Everything a run of these options writes (``Job``), from ``ckpt``'s headers and vocabulary
    (``measure``: with ``target_bpw``, measure the experts to choose their types; a dry run does not).
    ``imatrix``: an importance matrix, checked here against the expert tensors (``importance``)."""
    from .convert import load_importance, plan_gguf_types

    kvs, planned, skipped, choice = plan_gguf_types(
        ckpt, expert_type=expert_type, outtype=outtype, measure=measure, progress=progress,
        tensor_type=list(tensor_type), target_bpw=target_bpw, target_types=target_types,
        fallback_type=fallback_type, chat_template=chat_template, imatrix=imatrix)
    importance = load_importance(imatrix, planned)
    files = plan_files(out, kvs, [p.info for p in planned], split_max_bytes=split_max_bytes)
    options = job_options(expert_type=expert_type, outtype=outtype, split_max_bytes=split_max_bytes,
                          tensor_type=tensor_type, target_bpw=target_bpw, target_types=target_types,
                          fallback_type=fallback_type, chat_template=chat_template, imatrix=imatrix)
    alloc = None if choice.allocation is None else choice.allocation.to_dict()
    return Job(Path(out), tuple(kvs), tuple(planned), tuple(skipped), tuple(files), split_max_bytes, options,
               source_identity(ckpt), importance, alloc)


# -- the dry run's time estimate -------------------------------------------------------------


def _sample_arrays(ckpt, srcs: tuple[str, ...], rows: int, n: int, rng) -> dict[str, np.ndarray]:
    """Random stored values shaped like the first ``n`` of ``rows`` rows of each source tensor
    (finite: no 0xFF E8M0 scale, no FP8 NaN), so the timing needs no source bytes."""
    from ..io import dtypes

    out = {}
    for name in srcs:
        e = ckpt.tensors[name]
        shape = (max(1, -(-n * int(e.shape[0]) // rows)),) + tuple(int(d) for d in e.shape[1:])
        st = np.dtype(dtypes.lookup(e.dtype).storage)
        if e.dtype == "U8" and name.endswith("scale"):
            a = rng.integers(118, 125, shape, dtype=np.uint8)       # E8M0 exponents around 2^-6
        elif e.dtype == "F8_E4M3":                                  # any sign, never the NaN codes 0x7F / 0xFF
            a = rng.integers(0, 0x7F, shape, dtype=np.uint8) | (rng.integers(0, 2, shape, dtype=np.uint8) << 7)
        elif e.dtype == "BF16":
            a = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        elif st.kind == "f":                                        # float weights, or block-FP8 scales
            a = rng.uniform(1e-3, 2e-3, shape).astype(st)
        elif st.kind in "iu":
            a = rng.integers(0, 256, shape + (st.itemsize,), dtype=np.uint8).view(st).reshape(shape)
        else:
            raise UnsupportedError(f"no sample for {e.dtype}")
        out[name] = a
    return out


def _rate(ckpt, p: Planned) -> float:
    """Weights per second one core turns into ``p``'s type, timed on ``SAMPLE_ROWS`` rows of its first
    expert (random values of the source's layout), after a one-row warm-up (kernel loading)."""
    rows, k = int(p.info.shape[1]), int(p.info.shape[2])
    _timed(ckpt, p, 1)
    n = min(rows, SAMPLE_ROWS)
    return n * k / max(_timed(ckpt, p, n), 1e-9)


def _timed(ckpt, p: Planned, n: int) -> float:
    """Seconds to produce ``n`` rows of random values laid out as ``p``'s first expert."""
    from .pool import _Arrays, one_expert
    from .produce import expert_piece

    sub = one_expert(p, 0)
    sample = _Arrays(_sample_arrays(ckpt, sub.recipe.sources, int(p.info.shape[1]), n, np.random.default_rng(0)))
    part = replace(sub, info=C.TensorInfo(p.info.name, p.info.ggml_type, (1, n, int(p.info.shape[2]))))
    t0 = time.perf_counter()
    expert_piece(sample, part, 0)
    return time.perf_counter() - t0


# what an IQ2_XS expert from MXFP4 runs (requant.kernels names them so; its other kernels are requant's)
_IQ2XS_KERNELS = ("k3ckpt.requant.iq2xs._encode_kernel", "k3ckpt.formats.mxfp4:_kernels.decode_f32")


def _iq2xs_cold() -> bool:
    """numba's cache lacks the IQ2_XS encoder: timing it would first compile it (``COMPILE_SECONDS``)."""
    from ..requant.kernels import _cached, _dispatcher

    try:
        return any(not _cached(_dispatcher(where)) for where in _IQ2XS_KERNELS)
    except Exception:     # an estimate only
        return False


def estimate(ckpt, job: Job, workers: int) -> Estimate:
    """Seconds a run should take (``Estimate``): the encoder timed per (source, type), or
    ``ENCODE_RATE`` where timing would first compile it; other bytes at ``COPY_RATE``."""
    from ..requant.kernels import COMPILE_SECONDS

    groups: dict[tuple, list[Planned]] = {}
    copy = 0
    for p in job.planned:
        if p.recipe.kind == "experts":
            groups.setdefault((p.source_dtype, p.info.ggml_type, tuple(p.info.shape[1:])), []).append(p)
        else:
            copy += p.info.nbytes
    cold = any(t == IQ2_XS for _, t, _ in groups) and _iq2xs_cold()
    compile_s = COMPILE_SECONDS[ids.GGUF_IQ2_XS] if cold else 0.0
    rows, encode_s = [], 0.0
    for (src, t, _), ps in groups.items():
        weights = sum(int(np.prod(p.info.shape)) for p in ps)
        measured = not (cold and t == IQ2_XS)
        rate = ENCODE_RATE
        if measured:
            try:
                rate = _rate(ckpt, ps[0])
            except Exception:     # an estimate only: never fail a dry run over it
                measured = False
        rows.append({"source": src, "type": C.type_name(t), "weights": weights, "weights_per_s": rate,
                     "measured": measured})
        encode_s += weights / rate
    cores = max(1, min(workers, os.cpu_count() or 1))
    seconds = encode_s / cores + copy / COPY_RATE + compile_s
    return Estimate(seconds, workers, tuple(rows), copy, COPY_RATE, compile_s)


# -- the run ----------------------------------------------------------------------------------


def results_dir(out: str | os.PathLike) -> Path:
    """``PREFIX.k3ckpt-results/``: each finished split's report rows, so a resumed run's report is whole."""
    return manifest_path(out).with_name(manifest_path(out).name.replace("-manifest.json", "-results"))


def default_report_dir(out: str | os.PathLike) -> Path:
    """``PREFIX-report/`` beside OUT: ``requant_report.{json,md,svg}`` of the routed experts."""
    from .manifest import prefix_of

    return Path(out).with_name(prefix_of(out) + "-report")


def _save_rows(folder: Path, split: str, rows: list) -> None:
    import json

    from ..io.writer import atomic_write_bytes

    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / (split + ".json"),
                       json.dumps([r.to_dict() for r in rows], allow_nan=False).encode("utf-8"))


def _load_rows(folder: Path, split: str) -> list:
    import json

    from ..errors import InvalidFileError
    from ..requant.results import TensorResult

    path = folder / (split + ".json")
    try:
        return [TensorResult.from_dict(d) for d in json.loads(path.read_text())]
    except FileNotFoundError:
        raise InvalidFileError(f"cannot resume: {path.name} (the report rows of finished split {split}) is "
                               f"missing from {folder.name}; rerun without --resume") from None
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidFileError(f"cannot resume: {path} is damaged ({e}); rerun without --resume") from None


def _report(ckpt, job: Job, rows: list, folder: Path):
    """(report folder, the experts' pooled SNR, their importance-weighted SNR or None)."""
    from ..requant.report import ReportMeta, build_report, write_report

    hub = job.source.get("repo_id")
    source = f"hf://{hub}" if hub else str(ckpt.root)
    meta = ReportMeta(source=source, source_commit=job.source.get("commit"), options=dict(job.options),
                      imatrix=None if job.importance is None else job.importance.describe())
    report = build_report(sorted(rows, key=lambda r: (r.layer or 0, r.projection or "", r.expert or 0)), meta)
    write_report(report, folder)
    return folder, report.overall.snr_db, report.overall.weighted_snr_db


def output_files(job: Job) -> list[Path]:
    """Every file a run writes or may leave: the splits, their partial files, the manifest."""
    out = [manifest_path(job.out)]
    for p in job.paths:
        out += [p, partial_path(p)]
    return out


def run_job(ckpt, job: Job, *, resume: bool = False, workers: int = 1, report: str | os.PathLike | None = None,
            progress: bool = False, after_tensor: Callable[[int], None] | None = None, ray: str | None = None):
    """Write ``job``'s files (module docstring) and the routed experts' error report (``report``:
    its folder, default ``default_report_dir``); ``after_tensor(i)`` is called once planned tensor
    ``i`` is written (or kept from an earlier run), so a staged source can release what only it read.
    ``ray``: the address of a joined Ray cluster (``raypool.connect``) that computes the experts."""
    from tqdm import tqdm

    from ..io.writer import free_space_for
    from .convert import GGUFResult
    from .pool import expert_importance
    from .produce import expert_piece, tensor_pieces
    from .writer import GGUFWriter

    t0 = time.perf_counter()
    out = job.out
    manifest = GGUFManifest.begin(out, options=job.options, source=job.source, splits=job.split_plan(),
                                  resume=resume)
    sizes = {p.name: lay.size for p, lay in job.files}
    done = [n for n in manifest.done_splits() if n in sizes] if resume else []
    free_space_for(out, job.total_size - sum(sizes[n] for n in done))
    writer = None
    rows_dir = results_dir(out)
    in_split = {path.name: [t.name for t in lay.tensors] for path, lay in job.files}
    rows: dict[str, list] = {}          # GGUF expert tensor -> its experts' report rows
    kept_rows = [r for n in done for r in _load_rows(rows_dir, n)]

    def final(path: Path) -> None:
        # the split's report rows first: once the manifest lists it, a resume reads them back
        _save_rows(rows_dir, path.name, [r for t in in_split[path.name] for r in rows.get(t, ())])
        manifest.record(path.name, writer.sha256[path.name])

    writer = GGUFWriter(out, job.kvs, [p.info for p in job.planned], split_max_bytes=job.split_max_bytes,
                        done_splits=done, overwrite=resume, on_split_final=final)
    planned = job.planned
    after = after_tensor or (lambda i: None)
    runner = None
    if (workers > 1 or ray is not None) and any(p.recipe.kind == "experts" for p in planned):
        from .pool import ExpertRunner

        first = next((p for p in planned if p.recipe.kind == "experts" and p.info.ggml_type == IQ2_XS), None)
        if first is not None and ray is None and _iq2xs_cold():
            # compiled here once and cached (about 33 s), not by every worker at once on a first run
            _timed(ckpt, first, 1)
        runner = ExpertRunner(ckpt, workers, measure=True, importance=job.importance, ray=ray is not None)
    kept = sum(sizes[n] for n in done)
    try:
        with writer, tqdm(total=job.total_size, initial=kept, unit="B", unit_scale=True, desc="gguf",
                          disable=not progress) as bar:
            i = 0
            while i < len(planned):
                p = planned[i]
                if not writer.needs(p.info.name):
                    after(i)
                    i += 1
                    continue
                if runner is not None and p.recipe.kind == "experts":
                    j = i
                    while j < len(planned) and planned[j].recipe.kind == "experts" \
                            and writer.needs(planned[j].info.name):
                        j += 1
                    index = {q.info.name: i + n for n, q in enumerate(planned[i:j])}
                    for q, e, piece in runner.run(list(planned[i:j])):
                        rows.setdefault(q.info.name, []).append(piece.result)
                        writer.write(q.info.name, piece.data)
                        bar.update(len(piece.data))
                        if e == q.recipe.arg - 1:
                            after(index[q.info.name])
                    i = j
                    continue
                if p.recipe.kind == "experts":
                    for e in range(p.recipe.arg):
                        piece = expert_piece(ckpt, p, e, measure=True, imatrix=expert_importance(job.importance, p, e))
                        rows.setdefault(p.info.name, []).append(piece.result)
                        writer.write(p.info.name, piece.data)
                        bar.update(len(piece.data))
                else:
                    for data in tensor_pieces(ckpt, p):
                        writer.write(p.info.name, data)
                        bar.update(len(data))
                after(i)
                i += 1
        nodes = runner.node_stats() if runner is not None else []
    finally:
        if runner is not None:
            runner.close()
    every = kept_rows + [r for t in rows.values() for r in t]
    report_dir, snr, wsnr = _report(ckpt, job, every, Path(report) if report is not None
                                    else default_report_dir(out)) if every else (None, None, None)
    seconds = time.perf_counter() - t0
    manifest.finish(splits=len(job.files), tensors=len(planned), bytes=job.total_size, seconds=round(seconds, 3))
    return GGUFResult(job.paths, len(planned), job.total_size, job.bytes_by_type(), job.skipped,
                      resumed=tuple(done), seconds=seconds, workers=workers, manifest=manifest.path,
                      report=report_dir, snr_db=snr, weighted_snr_db=wsnr, allocation=job.allocation,
                      cluster=None if ray is None else {"address": ray, "workers": workers, "nodes": nodes})


def resolve_workers(workers: int | None) -> int:
    n = (os.cpu_count() or 1) if workers is None else int(workers)
    if n < 1:
        raise UsageError(f"--workers must be at least 1, found {n}")
    return n


def dry_result(job: Job, est: Estimate | None, **extra):
    from ..io.writer import free_bytes
    from .convert import GGUFResult

    return GGUFResult(job.paths, len(job.planned), job.total_size, job.bytes_by_type(), job.skipped, dry_run=True,
                      free_bytes=free_bytes(job.out.parent), estimate=est,
                      estimated_seconds=est.seconds if est is not None else None, manifest=manifest_path(job.out),
                      **extra)
