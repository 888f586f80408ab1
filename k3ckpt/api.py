"""The library entry points the CLI calls; Python users call them directly.

Each function takes plain arguments, returns a frozen dataclass and never prints
or exits.  Errors from bad input are ``k3ckpt.errors.K3ckptError`` kinds.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import NotFoundError
from .io.reader import Checkpoint, open_checkpoint


def open_source(src: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint folder, ``.safetensors`` file or ``hf://ORG/NAME[@REV][/SUB]``."""
    from .hub import is_hub_url

    if is_hub_url(str(src)):
        from .hub import open_hub_checkpoint

        return open_hub_checkpoint(str(src))
    path = Path(src)
    if not path.exists():
        raise NotFoundError(f"no such checkpoint folder or file: {src}")
    return open_checkpoint(path)


def inspect(src: str | os.PathLike, *, scan: bool = False, tensors: bool = False, progress: bool = False):
    """Report what ``src`` holds from headers; ``tensors=True`` lists every
    tensor with its role; ``scan=True`` also reads the data (bounded memory) for
    scale histograms, NaN/Inf counts, zero codes and amax."""
    import dataclasses

    from .inspection import inspect_checkpoint, tensor_rows

    with open_source(src) as ckpt:
        report = inspect_checkpoint(ckpt, source=str(src))
        hub = getattr(ckpt, "hub", None)
        if hub is not None:
            report = dataclasses.replace(report, extra={**report.extra, "hub": hub.facts()})
        if tensors:
            report = dataclasses.replace(report, tensors=tensor_rows(ckpt))
        if scan:
            from .scan import scan_checkpoint

            report = dataclasses.replace(report, scan=scan_checkpoint(ckpt, progress=progress))
        return report


def make_fixture(name: str, dst: str | os.PathLike, **options) -> Path:
    """Generate a synthetic checkpoint (see ``k3ckpt.fixtures.FIXTURES``)."""
    from . import fixtures

    if name == "k3-virtual":
        return fixtures.make_virtual_k3(dst)
    return fixtures.make_fixture(name, dst, **options)


def dequant(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "bf16", tensors: str | None = None,
            progress: bool = False):
    """Write a checkpoint whose selected quantized weights are decoded to ``dtype``."""
    from .dequant import dequant_checkpoint

    with open_source(src) as ckpt:
        return dequant_checkpoint(ckpt, dst, dtype=dtype, pattern=tensors, progress=progress)


def _staged(src, options: dict) -> bool:
    """An hf:// source converted for real is downloaded shard by shard (``k3ckpt.hub.convert``);
    a dry run reads headers by range requests."""
    from .hub import is_hub_url

    return is_hub_url(str(src)) and not options.get("dry_run")


def requant(src: str | os.PathLike, dst: str | os.PathLike, **options):
    """Requantize the routed experts of ``src`` into ``dst`` (``k3ckpt.requant.pipeline.requant_checkpoint``;
    hf:// sources also take ``max_disk``, ``staging``, ``keep_source``, see ``k3ckpt.hub.convert``)."""
    from .requant.pipeline import requant_checkpoint

    if _staged(src, options):
        from .hub.convert import requant_from_hub

        return requant_from_hub(str(src), dst, **options).result
    with open_source(src) as ckpt:
        return requant_checkpoint(ckpt, dst, source_label=str(src), **options)


def plan(src, devices, **options):
    """Plan expert placement or an expert cache for a device set (``k3ckpt.planning.plan``)."""
    from .planning import plan as _plan

    return _plan(src, devices, **options)


def shard(src: str | os.PathLike, plan_path: str | os.PathLike, dst: str | os.PathLike, **options):
    """Write per-rank files and expert packs from a plan (``k3ckpt.shard.materialize.shard_checkpoint``)."""
    from .shard.materialize import shard_checkpoint
    from .shard.plan import Plan

    the_plan = Plan.from_json(Path(plan_path).read_bytes())
    if _staged(src, options):
        from .hub.convert import shard_from_hub

        return shard_from_hub(str(src), the_plan, dst, **options).result
    with open_source(src) as ckpt:
        return shard_checkpoint(ckpt, the_plan, dst, **options)


def verify(dst: str | os.PathLike, *, source: str | os.PathLike | None = None):
    """Re-check a ``shard`` output folder against its manifest (and the source)."""
    from .shard.verify import verify_output

    return verify_output(dst, source=source)
