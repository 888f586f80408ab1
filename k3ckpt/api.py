"""The library entry points the CLI calls; Python users call them directly.

Each function takes plain arguments, returns a frozen dataclass and never prints
or exits.  Errors from bad input are ``k3ckpt.errors.K3ckptError`` kinds.

Parameters are the CLI's options under their Python names (``--target-bpw X`` is
``target_bpw=X``; SIZE options take bytes or a string with a unit, ``"5GB"``).
Progress: every function that can run long takes ``progress=``, off by default
here; the CLI turns it on when stderr is a terminal and ``-q`` is not given.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

from .errors import K3ckptError, NotFoundError, UsageError
from .formats import ids
from .io.reader import Checkpoint, open_checkpoint

# Boolean CLI flags and what a Python caller passes instead; other ``--name`` become ``name=``.
_FLAGS = {"--resume": "resume=True", "--dry-run": "dry_run=True", "--keep-source": "keep_source=True",
          "--private": "private=True", "--overwrite": "overwrite=True"}
_OPTION = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)(?: (?=[\d'\"]))?")


def _python_terms(text: str) -> str:
    """``pass --resume`` -> ``pass resume=True``, ``--target-bpw 5`` -> ``target_bpw=5``."""
    def one(m: re.Match) -> str:
        flag = "--" + m.group(1)
        if flag in _FLAGS:
            return _FLAGS[flag] + (" " if m.group(0).endswith(" ") else "")
        return m.group(1).replace("-", "_") + ("=" if m.group(0).endswith(" ") else "")
    return _OPTION.sub(one, text)


def _in_cli() -> bool:
    click = sys.modules.get("click")
    return click is not None and click.get_current_context(silent=True) is not None


def _for_python(fn):
    """Errors worded for Python callers: the library's messages name CLI flags (the CLI is
    their main reader), which mean nothing to a script; inside the CLI they pass unchanged."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except K3ckptError as e:
            if _in_cli() or "--" not in e.detail:
                raise
            try:
                again = type(e)(_python_terms(e.detail), file=e.file, tensor=e.tensor, hint=e.hint)
            except TypeError:   # a kind with its own constructor: keep it as it is
                raise e from None
            raise again.with_traceback(e.__traceback__) from None
    return wrapper


def _size(value, what: str) -> int | None:
    """Bytes from an int or a string with a unit (``"5GB"``); None stays None."""
    if value is None or isinstance(value, int):
        return value
    from .placement.devices import parse_bytes

    return parse_bytes(str(value), what)


@_for_python
def open_source(src: str | os.PathLike, *, complete: bool = True) -> Checkpoint:
    """Open a checkpoint folder, ``.safetensors`` file or ``hf://ORG/NAME[@REV][/SUB]``;
    ``complete``: refuse one with no tensors or MoE layers without experts (k3ckpt.completeness)."""
    from .completeness import require_complete
    from .hub import is_hub_url

    if is_hub_url(str(src)):
        from .hub import open_hub_checkpoint

        return require_complete(open_hub_checkpoint(str(src)), complete)
    path = Path(src)
    if not path.exists():
        raise NotFoundError(f"no such checkpoint folder or file: {src}")
    return require_complete(open_checkpoint(path), complete)


def _is_gguf(src) -> bool:
    """A local GGUF file (``.gguf``, or the GGUF magic) rather than a checkpoint."""
    from .hub import is_hub_url
    from .gguf.reader import is_gguf_path

    return not is_hub_url(str(src)) and is_gguf_path(src)


@_for_python
def inspect(src: str | os.PathLike, *, scan: bool = False, tensors: bool = False, progress: bool = False):
    """Report what ``src`` holds from headers (``InspectReport``; for a GGUF,
    ``k3ckpt.gguf.inspect.GGUFInspectReport``).

    Args:
        src: checkpoint folder, ``.safetensors`` file or ``hf://`` URL; or a ``.gguf``
            file (any split of a set: the whole set is read).
        scan: also read the data (bounded memory) for scale histograms, NaN/Inf
            counts, zero codes and amax (not for a GGUF).
        tensors: list every tensor with its role.
        progress: a tqdm bar on stderr while scanning.
    """
    import dataclasses

    if _is_gguf(src):
        from .gguf.inspect import inspect_gguf
        from .gguf.reader import open_gguf

        if scan:
            raise UsageError("--scan reads safetensors checkpoints; a GGUF is inspected from its headers")
        with open_gguf(src) as gs:
            return inspect_gguf(gs, source=str(src), tensors=tensors)
    from .inspection import inspect_checkpoint, tensor_rows

    with open_source(src, complete=False) as ckpt:   # inspect reports what is missing as warnings
        report = inspect_checkpoint(ckpt, source=str(src))
        if not ckpt.origin.is_local():
            report = dataclasses.replace(report, extra={**report.extra, "hub": ckpt.hub.facts()})
        if tensors:
            report = dataclasses.replace(report, tensors=tensor_rows(ckpt))
        if scan:
            from .scan import scan_checkpoint

            report = dataclasses.replace(report, scan=scan_checkpoint(ckpt, progress=progress))
        return report


@_for_python
def make_fixture(name: str, dst: str | os.PathLike, *, seed: int = 0, layers: int | None = None,
                 experts: int | None = None, overwrite: bool = False, progress: bool = False) -> Path:
    """Generate synthetic checkpoint ``name`` in folder ``dst``; returns the checkpoint folder.

    Args:
        name: a fixture of ``k3ckpt.fixtures.FIXTURES`` (``k3-tiny``, ...), a source
            fixture, or ``k3-virtual`` (the full-size K3 as headers over sparse files).
        seed: seed of the generated values (same arguments, same bytes).
        layers: decoder layers (fixture default if None).
        experts: routed experts per MoE layer (fixture default if None).
        overwrite: replace what ``dst`` holds.
        progress: a tqdm bar on stderr while writing.
    """
    from . import fixtures

    if name == "k3-virtual":
        return fixtures.make_virtual_k3(dst, overwrite=overwrite)
    return fixtures.make_fixture(name, dst, seed=seed, layers=layers, experts=experts, overwrite=overwrite,
                                 progress=progress)


@_for_python
def dequant(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = ids.BF16, tensors: str | None = None,
            max_shard_size: int | str | None = None, dry_run: bool = False, progress: bool = False):
    """Write ``dst``: ``src`` with its (selected) quantized weights decoded to ``dtype`` (``DequantResult``).

    A ``.gguf`` ``src`` (any split of a set) gives ``k3ckpt.gguf.dequant.GGUFDequantResult``: every
    tensor under its GGUF name, quantized ones decoded by the gguf package, the metadata in
    ``k3ckpt_gguf_metadata.json``; ``tensors`` then chooses which tensors are written at all.

    Args:
        dtype: ``bf16``, ``f16`` or ``f32``.
        tensors: a regex on tensor names choosing which weights to decode (default: all).
        max_shard_size: largest output shard, bytes or a size with a unit (default ``"5GB"``).
        dry_run: plan from headers and write nothing; the result says what a run would write.
        progress: a tqdm bar on stderr.
    """
    from .dequant import SHARD_BYTES
    from .dequant_run import dequant_checkpoint

    shard = SHARD_BYTES if max_shard_size is None else _size(max_shard_size, "--max-shard-size")
    if _is_gguf(src):
        from .gguf.dequant import dequant_gguf
        from .gguf.reader import open_gguf

        with open_gguf(src) as gs:
            return dequant_gguf(gs, dst, dtype=dtype, pattern=tensors, progress=progress, max_shard_bytes=shard,
                                dry_run=dry_run)
    with open_source(src) as ckpt:
        return dequant_checkpoint(ckpt, dst, dtype=dtype, pattern=tensors, progress=progress,
                                  max_shard_bytes=shard, dry_run=dry_run)


@_for_python
def gguf(src: str | os.PathLike, out: str | os.PathLike, *, expert_type: str = "iq2_xs", outtype: str | None = None,
         split_max_size: int | str | None = "48GB", tensor_type=(), target_bpw: float | None = None,
         target_types=None, fallback_type: str | None = None, chat_template: str | os.PathLike | None = None,
         workers: int | None = None, resume: bool = False, dry_run: bool = False,
         max_disk: int | str | None = None, staging: str | os.PathLike | None = None, keep_source: bool = False,
         report: str | os.PathLike | None = None, progress: bool = False,
         imatrix: str | os.PathLike | None = None, ray: str | None = None):
    """Write a GGUF file (or splits) that llama.cpp runs (``kimi-k3``; ``deepseek2`` from Kimi K2 /
    DeepSeek-V3), with ``PREFIX.k3ckpt-manifest.json`` beside it (``GGUFResult``; docs/gguf.md).

    Args:
        src: checkpoint folder, ``.safetensors`` file or ``hf://ORG/NAME[@REV][/SUB]``.
        expert_type: ggml type of the routed experts: ``iq2_xs``, ``iq2_xxs``, ``iq2_s``, ``iq1_s``, ``iq1_m``, ``q2_k``, ``iq3_xxs``
            (our encoders),
            ``mxfp4`` (a lossless repack, as llama.cpp's converter writes it), ``q8_0``, ``bf16``,
            ``f16``, ``f32``; any case.
        outtype: ``bf16``, ``f16``, ``q8_0`` or ``f32`` for every other tensor that is not kept in
            float32 (default: as the converter writes them: BF16 stays BF16, byte for byte).
        split_max_size: most tensor bytes per file, bytes or a size with a unit; ``None``: one file.
            Several files are named ``OUT-00001-of-0000N.gguf``, as llama.cpp's gguf-split names them.
        tensor_type: ``["REGEX=TYPE", ...]`` per-tensor types, first match wins.
        target_bpw: mixed precision: each stacked expert tensor's type chosen by measured error
            (importance-weighted with ``imatrix``) so that the experts average this many bits.
        target_types: the types ``target_bpw`` chooses from (ggml names, a list or ``"a,b"``);
            default: ``iq1_s``, ``iq1_m``, ``iq2_xxs``, ``iq2_xs``, ``iq2_s``, ``q2_k``, ``iq3_xxs`` and, for MXFP4 experts,
            ``mxfp4`` (their lossless repack).
        fallback_type: the type of a tensor whose rows the asked-for type cannot hold.
        chat_template: a file whose text becomes ``tokenizer.chat_template`` (for a source
            without one, or to replace it).
        workers: processes encoding routed experts (default: CPU count; 1: in this process).
            The files are the same bytes for any count.
        resume: continue an interrupted run writing ``out`` (same options and source): finished
            splits are kept, the others written again.
        dry_run: plan from headers and write nothing; the result lists the files and bytes, the free
            space, a time estimate and, with ``max_disk``, whether the budget works.
        max_disk, staging, keep_source: ``hf://`` sources only (as ``requant``): bound staged shards
            plus output, where shards are staged (default ``.k3ckpt-staging`` beside ``out``), keep them.
        report: folder for the routed experts' ``requant_report.{json,md,svg}`` (default:
            ``PREFIX-report`` beside ``out``; docs/requant-report.md).
        progress: a tqdm bar on stderr.
        imatrix: a llama.cpp importance matrix (as ``requant``'s): every encoder of the
            llama.cpp family (every expert type above but ``mxfp4``, ``q8_0`` and the float
            types) weighs its error by it; the report gives weighted errors beside plain ones.
        ray: encode the routed experts on a Ray cluster (``HOST:PORT`` or ``auto``; as ``requant``'s);
            the file is the same bytes.  An ``hf://`` source is staged by this process, which sends the
            experts' weights to the tasks as Ray objects (docs/ray.md).
    """
    import dataclasses

    from .gguf.convert import write_gguf
    from .hub.options import hub_run_options

    stage = hub_run_options(str(src), max_disk=max_disk, staging=staging, keep_source=keep_source, push_to=None,
                            private=False, revision=None, dry_run=dry_run)
    options = dict(expert_type=expert_type, outtype=outtype, split_max_bytes=_size(split_max_size, "--split-max-size"),
                   tensor_type=list(tensor_type), target_bpw=target_bpw, target_types=target_types,
                   fallback_type=fallback_type, chat_template=chat_template)
    if imatrix is not None:
        options["imatrix"] = imatrix
    if stage is not None:   # hf:// source: download shard by shard, convert, delete
        from .hub.convert import gguf_from_hub

        run = gguf_from_hub(str(src), out, resume=resume, dry_run=dry_run, workers=workers, progress=progress,
                            report=report, ray=ray, **stage, **options)
        return dataclasses.replace(run.result, hub={**run.facts(), "side_files": list(run.side_files)})
    with open_source(src) as ckpt:
        return write_gguf(ckpt, out, workers=workers, resume=resume, dry_run=dry_run, report=report,
                          progress=progress, ray=ray, **options)


@_for_python
def requant(src: str | os.PathLike, dst: str | os.PathLike, *, format: str = ids.MOET_W2, layout: str | None = None,
            experts: str | list[str] | None = None, tensor_type=(), target_bpw: float | None = None,
            workers: int | None = None, report: str | os.PathLike | None = None, dry_run: bool = False,
            resume: bool = False, max_shard_size: int | str | None = None, max_disk: int | str | None = None,
            staging: str | os.PathLike | None = None, keep_source: bool = False, push_to: str | None = None,
            private: bool = False, push_revision: str | None = None, progress: bool = False,
            on_compile=None, imatrix: str | os.PathLike | None = None, ray: str | None = None):
    """Requantize the routed experts of ``src`` into ``dst`` (``RequantResult``; docs/requant.md).

    Args:
        src: checkpoint folder, ``.safetensors`` file or ``hf://ORG/NAME[@REV][/SUB]``.
        format: ``moet-w2`` (refit), ``moet-w2:keep-scales``, ``k3ckpt-mx2``, ``mxfp4``
            or another target of ``k3ckpt formats``.
        layout: ``format="mxfp4"`` only: ``compressed-tensors`` (default) or ``gpt-oss``.
        experts: which routed-expert weights: a regex on logical names, or projections
            (``"gate,up"`` or ``["down"]``); None: all.
        tensor_type: ``["REGEX=FORMAT", ...]`` per-weight overrides, first match wins
            (``keep`` leaves a weight in MXFP4).
        target_bpw: mixed precision: keep the weights with the most error per byte in
            MXFP4 so the average is this many bits per weight.
        workers: worker processes (default: CPU count; 1 computes in this process).
        report: folder for ``requant_report.{json,md,svg}`` (default: ``dst``).
        dry_run: plan only (weights, bytes, time estimate); write nothing.
        resume: continue an interrupted run in ``dst`` (same options).
        max_shard_size: largest output shard, bytes or ``"5GB"`` (default 5 GB, as
            transformers' ``save_pretrained``; the source's sharding is not kept).
        max_disk, staging, keep_source: ``hf://`` sources only (``k3ckpt.hub.convert``):
            bound downloaded shards plus output, where shards are staged, keep them.  With
            ``dry_run``, ``max_disk`` is checked against the plan (``result.budget``).
        push_to, private, push_revision: upload ``dst`` to this Hub repo when done
            (``result.pushed``).
        progress: a tqdm bar on stderr.
        on_compile: called with the expected seconds when kernels must compile first.
        imatrix: a llama.cpp importance matrix (``llama-imatrix`` GGUF or legacy ``.dat``):
            the encoders of the llama.cpp family (``gguf-iq1_s`` ... ``gguf-iq3_xxs``) weigh their error by
            it, and
            the report gives each weight's weighted SNR beside the plain one.
        ray: run the weights on a Ray cluster: its head's ``HOST:PORT`` or ``auto``
            (``pip install 'k3ckpt[ray]'``; docs/ray.md). Source and ``dst`` must be paths every
            node sees; the bytes are those of a local run.  ``result.cluster`` has per-node figures.

    The result carries what happened around the pipeline: ``hub`` (staging facts of an
    ``hf://`` run), ``budget`` and ``pushed``.
    """
    import dataclasses

    from .hub.options import hub_run_options
    from .requant.pipeline import requant_checkpoint

    stage = hub_run_options(str(src), max_disk=max_disk, staging=staging, keep_source=keep_source,
                            push_to=push_to, private=private, revision=push_revision, dry_run=dry_run)
    options = dict(format=format, layout=layout, experts=experts, tensor_type=list(tensor_type),
                   target_bpw=target_bpw, workers=workers, report_path=report, progress=progress,
                   max_shard_bytes=_size(max_shard_size, "--max-shard-size"))
    if on_compile is not None:
        options["on_compile"] = on_compile
    if imatrix is not None:
        options["imatrix"] = imatrix
    if ray is not None:
        options["ray"] = ray
    if stage is not None and not dry_run:   # hf:// source: download shard by shard, convert, delete
        from .hub.convert import requant_from_hub

        run = requant_from_hub(str(src), dst, resume=resume, **stage, **options)
        result = dataclasses.replace(run.result, hub=run)
    else:
        with open_source(src) as ckpt:
            result = requant_checkpoint(ckpt, dst, dry_run=dry_run, resume=resume, source_label=str(src), **options)
            if stage is not None and stage["max_disk"] is not None:   # dry run: would the budget work?
                from .hub.staged import budget_check

                extra = result.plan.in_bytes - result.plan.out_bytes if target_bpw is not None else 0
                result = dataclasses.replace(result, budget=budget_check(
                    {n: ckpt.shard_size(n) for n in ckpt.shards}, len(ckpt.tensors),
                    result.plan.total_bytes + max(0, extra), stage["max_disk"], keep_source=stage["keep_source"]))
    if push_to is not None:
        from .hub.push import push_output

        result = dataclasses.replace(result, pushed=push_output(dst, push_to, private=private,
                                                                revision=push_revision))
    return result


def format_spec(spec: str) -> str:
    """A ``--format`` value with its format spelled as the registry's id (``IQ2_XS`` ->
    ``gguf-iq2_xs``, ``MoeT-W2:keep-scales`` -> ``moet-w2:keep-scales``)."""
    from .formats import canonical_format_spec

    return canonical_format_spec(spec)


@_for_python
def plan(src, devices, *, format: str | None = None, requant_report=None, loads=None, trace=None, heldout=None,
         redundant: int | None = None, slots_per_gpu: int | None = None, mode: str = "auto", dense: str = "hbm",
         model_id: str | None = None, seed: int = 1, pp_partition=None, include_vision: bool = False,
         synthetic_tokens: int | None = None, synthetic_trace_tokens: int | None = None):
    """Plan expert placement or an expert cache of ``src`` on ``devices`` (``Plan``; docs/planner.md).

    Args:
        src: checkpoint folder / file / ``hf://`` URL, an open ``Checkpoint`` or a ``MoEGeometry``.
        devices: a ``DeviceSet`` or a shorthand (``"64xGB200"``, ``"2x8xH100"``).
        format: on-device expert format (sets the bytes per expert); ``stored``: as the
            checkpoint stores each expert; None: MXFP4, or ``stored`` for mixed experts.
        requant_report: a requant report (file or folder): bytes per expert as it wrote them.
        loads: ``[moe_layers, experts]`` per-expert loads, array or .npy / .json / .csv file.
        trace: planning routing trace ``[tokens, moe_layers, top_k]`` (array or .npy).
        heldout: held-out trace for the traffic figures and the cache simulation.
        redundant: redundant expert slots per layer (placement mode).
        slots_per_gpu: expert slots per GPU (placement mode).
        mode: ``auto``, ``placement`` or ``cache``.
        dense: ``hbm`` (dense weights on the GPUs) or ``host`` (in host DRAM).
        model_id: name recorded in the plan.
        seed: seed of the synthetic loads and trace.
        pp_partition: cache mode: decoder layers per GPU, a list or ``"2,2"`` (``VLLM_PP_LAYER_PARTITION``).
        include_vision: count the vision tower among the dense weights.
        synthetic_tokens, synthetic_trace_tokens: tokens behind the synthetic loads and the
            synthetic held-out trace (None: 200,000 and 1,024).
    """
    from .placement.inputs import SYNTHETIC_TOKENS, SYNTHETIC_TRACE_TOKENS, plan_inputs
    from .placement.stages import parse_partition

    if isinstance(pp_partition, str):   # "2,2", as VLLM_PP_LAYER_PARTITION spells it
        pp_partition = parse_partition(pp_partition)

    def run(source):
        return plan_inputs(source, devices, format_id=format, requant_report=requant_report, loads=loads,
                           trace=trace, heldout=heldout, redundant=redundant, slots_per_gpu=slots_per_gpu, mode=mode,
                           dense=dense, model_id=model_id, seed=seed, pp_partition=pp_partition,
                           include_vision=include_vision,
                           synthetic_tokens=synthetic_tokens or SYNTHETIC_TOKENS,
                           synthetic_trace_tokens=synthetic_trace_tokens or SYNTHETIC_TRACE_TOKENS)

    if isinstance(src, (str, os.PathLike)):
        with open_source(src) as ckpt:
            return run(ckpt)
    return run(src)


def save_plan(p, path: str | os.PathLike) -> Path:
    """Write plan ``p`` as plan.json (``p.to_json()``) atomically: a reader finds the old file or
    the whole new one."""
    from .io.writer import atomic_write_bytes

    atomic_write_bytes(path, p.to_json().encode("utf-8"))
    return Path(path)


def load_plan(plan):
    """A ``Plan`` as it is, or read from a plan.json (``k3ckpt plan -o``)."""
    from .placement.spec import Plan

    if isinstance(plan, Plan):
        return plan
    p = Path(plan)
    if not p.is_file():
        raise NotFoundError("no such plan file (a plan.json from k3ckpt plan)", file=str(p))
    return Plan.from_json(p.read_bytes())


@_for_python
def shard(src: str | os.PathLike, dst: str | os.PathLike, *, plan, layout: str = "k3ckpt", resume: bool = False,
          ranks=None, ckpt_id: str | None = None, tag: str = "base", zero_mode: str = "auto", tp: int = 1,
          max_shard_size: int | str = 5_000_000_000, max_disk: int | str | None = None,
          staging: str | os.PathLike | None = None, keep_source: bool = False, dry_run: bool = False,
          progress: bool = False, ray: str | None = None):
    """Write per-rank files and expert packs of ``src`` into ``dst`` as ``plan`` says
    (``ShardResult``; docs/shard.md).  The order is the CLI's: ``k3ckpt shard SRC DST --plan P``.

    Args:
        plan: a plan.json path (from ``k3ckpt plan -o``) or a ``Plan``.
        layout: ``k3ckpt`` (packs of verbatim source records) or ``moet`` (vLLM-Moet's
            2.25-bpw pack).
        resume: continue an interrupted run in ``dst``.
        ranks: write only these rank ids (default: all).
        ckpt_id, tag, zero_mode: moet: the pack's identity.
        tp: moet: tensor-parallel ranks per pipeline stage.
        max_shard_size: safetensors shard size, bytes or ``"5GB"``.
        max_disk, staging, keep_source: ``hf://`` sources only (see ``requant``).
        dry_run: what each rank would get (``shard.dryrun.ShardDryRun``: files, bytes, whether
            ``dst`` has the room), from headers alone; nothing written (``ray`` is not joined).
        progress: a tqdm bar on stderr.
        ray: write the files on a Ray cluster, a task per safetensors shard or pack layer
            (``HOST:PORT`` or ``auto``; docs/ray.md). ``src`` and ``dst`` must be paths every node
            sees (not ``hf://``); the bytes are those of a local run; ``result.cluster`` has per-node
            figures.

    An ``hf://`` run's result carries its staging facts (``result.hub``).
    """
    import dataclasses

    from .hub.options import hub_run_options
    from .shard.materialize import shard_checkpoint

    the_plan = load_plan(plan)
    stage = hub_run_options(str(src), max_disk=max_disk, staging=staging, keep_source=keep_source,
                            push_to=None, private=False, revision=None)
    options = dict(layout=layout, ranks=ranks, ckpt_id=ckpt_id, tag=tag, zero_mode=zero_mode, tp=tp,
                   max_shard_bytes=_size(max_shard_size, "--max-shard-size"))
    if dry_run:
        from .shard.dryrun import shard_dry_run

        with open_source(src) as ckpt:
            return shard_dry_run(ckpt, the_plan, dst, **options)
    options["progress"] = progress
    if ray is not None:
        if stage is not None:
            # Every task reads its file's tensors from all over the source, while staging keeps
            # only a window of shards, on this machine.
            raise UsageError("shard --ray reads the source by path on every node; an hf:// source is staged "
                             "on this machine only: download it to a path every node sees first")
        options["ray"] = ray
    if stage is not None:   # hf:// source: download shard by shard, convert, delete
        from .hub.convert import shard_from_hub

        run = shard_from_hub(str(src), the_plan, dst, resume=resume, **stage, **options)
        return dataclasses.replace(run.result, hub=run)
    with open_source(src) as ckpt:
        return shard_checkpoint(ckpt, the_plan, dst, resume=resume, **options)


@_for_python
def verify(dst: str | os.PathLike, *, source: str | os.PathLike | None = None):
    """Re-check a ``shard`` output folder against its manifest (and ``source``, when given); a
    ``.gguf`` (``OUT`` or any split) against its GGUF manifest (``k3ckpt.gguf.verify``)."""
    if str(dst).endswith(".gguf"):
        from .gguf.verify import verify_gguf

        if source is None or isinstance(source, Checkpoint):
            return verify_gguf(dst, source=source)
        with open_source(source, complete=False) as ckpt:
            return verify_gguf(dst, source=ckpt)
    from .shard.verify import verify_output

    if isinstance(source, (str, os.PathLike)):
        with open_source(source) as ckpt:
            return verify_output(dst, source=ckpt)
    return verify_output(dst, source=source)


# what the CLI asks besides the runs (lookups.py)
from .lookups import (VIRTUAL_K3, FormatEntry, ReportView, device_set, fixtures, formats, plan_ceiling,  # noqa: E402
                      plan_fits_placement, plan_stages, report, snr_by_group, snr_reference, source_url,
                      weighted_snr)

__all__ = ["inspect", "make_fixture", "dequant", "gguf", "requant", "format_spec", "plan", "save_plan", "load_plan",
           "shard", "verify", "open_source", "VIRTUAL_K3", "FormatEntry", "ReportView", "device_set", "fixtures",
           "formats", "plan_ceiling", "plan_fits_placement", "plan_stages", "report", "snr_by_group", "snr_reference",
           "source_url", "weighted_snr"]


def __getattr__(name: str):
    """The result types a caller tells apart (``isinstance(r, api.GGUFInspectReport)``),
    imported on first use: the gguf package is not needed to start the CLI."""
    if name == "GGUFInspectReport":
        from .gguf.inspect import GGUFInspectReport

        return GGUFInspectReport
    if name == "GGUFDequantResult":
        from .gguf.dequant import GGUFDequantResult

        return GGUFDequantResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
