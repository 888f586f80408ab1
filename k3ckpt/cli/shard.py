"""``k3ckpt shard SRC DST --plan plan.json``: per-rank files and NVMe expert packs from a plan."""

from __future__ import annotations

import sys

import click

from .render import echo_json, human_bytes, ray_line, table
from .source import hub_option, source_argument


def _ranks(text: str | None):
    if text is None:
        return None
    out = set()
    try:
        for part in text.split(","):
            a, _, b = part.strip().partition("-")
            out.update(range(int(a), int(b or a) + 1))
    except ValueError:
        from ..errors import UsageError

        raise UsageError(f"--ranks takes rank ids and ranges like 0,2-5, found {text!r}") from None
    return sorted(out)


def _print_dry_run(r, dst, as_json) -> None:
    """``--dry-run``: headers only (an hf:// source is read by range requests), nothing written."""
    from dataclasses import asdict

    from ..errors import DiskSpaceError

    if as_json:
        echo_json({**asdict(r), "files": r.files, "dry_run": True})
    else:
        rows = [(x.rank, x.folder, x.tensors, x.shards, human_bytes(x.tensor_bytes),
                 (x.packs[0] + (f" (+{len(x.packs) - 1} more)" if len(x.packs) > 1 else "")) if x.packs else "-",
                 x.pack_records, human_bytes(x.pack_bytes)) for x in r.ranks[:16]]
        click.echo(table(rows, ["rank", "folder", "tensors", "shards", "tensor bytes", "packs", "records",
                                "pack bytes"], "rlrrrlrr"))
        if len(r.ranks) > 16:
            click.echo(f"... {len(r.ranks) - 16} more rank(s)")
        click.echo(f"would write {r.dst}: {r.mode} plan, layout {r.layout}, {len(r.ranks)} rank(s), {r.files} file(s), "
                   f"{human_bytes(r.total_bytes)}; {human_bytes(r.free_bytes)} free there; nothing written (--dry-run)")
    if not r.fits:
        raise DiskSpaceError(f"output needs {r.total_bytes:,} bytes but only {r.free_bytes:,} are free", file=dst)


@click.command("shard")
@source_argument
@click.argument("dst")
@hub_option
@click.option("--plan", "plan_path", required=True, metavar="PLAN.json", help="A plan from `k3ckpt plan`.")
@click.option("--layout", type=click.Choice(["k3ckpt", "moet"]), default="k3ckpt", show_default=True,
              help="Expert pack layout: k3ckpt (verbatim source records) or moet (vLLM-Moet 2.25-bpw pack).")
@click.option("--resume", is_flag=True, help="Continue an interrupted run in DST.")
@click.option("--ranks", metavar="LIST", default=None, help="Write only these ranks, e.g. 0-7 (default: all).")
@click.option("--ckpt-id", default=None, help="moet: the pack identity's ckpt_id (set VLLM_MOE_W2_CKPT_ID to it).")
@click.option("--tag", default="base", show_default=True, help="moet: pack tag.")
@click.option("--zero-mode", type=click.Choice(["auto", "sign", "alt"]), default="auto", show_default=True,
              help="moet: the runtime's VLLM_MOE_W2_ZERO_MODE (identity only; MXFP4 keeps zero signs).")
@click.option("--tp", type=int, default=1, show_default=True,
              help="moet: TP ranks per pipeline stage (one pack each; K3 kernels exist for TP4 and TP8).")
@click.option("--max-shard-size", "max_shard", default="5GB", show_default=True, help="Safetensors shard size.")
@click.option("--max-disk", "max_disk", default=None, metavar="SIZE",
              help="hf:// source: bound downloaded shards plus output to SIZE (e.g. 1TB, 500G).")
@click.option("--staging", default=None, metavar="DIR",
              help="hf:// source: download shards here (default DST/.k3ckpt-staging).")
@click.option("--keep-source", is_flag=True, help="hf:// source: keep the downloaded shards.")
@click.option("--ray", "ray", default=None, metavar="ADDRESS|auto",
              help="Write the files on a Ray cluster (its head's HOST:PORT, or auto), a task per safetensors shard "
                   "or pack layer; SRC and DST must be paths every node sees. Same bytes as a local run. Needs "
                   "pip install 'k3ckpt[ray]'.")
@click.option("--dry-run", is_flag=True, help="Print what each rank would get (files, bytes) and check DST's free "
              "space; write nothing (with --ray: no cluster is joined).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def command(src, dst, plan_path, layout, resume, ranks, ckpt_id, tag, zero_mode, tp, max_shard, max_disk, staging,
            keep_source, ray, dry_run, as_json, quiet):
    """Write DST from SRC as PLAN says: rank-NNNNN/ folders (safetensors + index), NVMe
    expert packs for cache plans, a manifest of sizes and sha256 (see docs/shard.md).

    Examples:

    \b
      k3ckpt shard K3 out --plan plan.json --dry-run
      k3ckpt shard K3 out --plan plan.json --layout moet --tp 4 --ckpt-id k3-base
    """
    from .. import api

    plan = api.load_plan(plan_path)
    r = api.shard(src, dst, plan=plan, layout=layout, resume=resume, ranks=_ranks(ranks), ckpt_id=ckpt_id, tag=tag,
                  zero_mode=zero_mode, tp=tp, max_shard_size=max_shard, max_disk=max_disk, staging=staging,
                  keep_source=keep_source, dry_run=dry_run, progress=not quiet and sys.stderr.isatty(), ray=ray)
    if dry_run:
        return _print_dry_run(r, dst, as_json)
    if as_json:
        echo_json(r.to_dict())
        return
    click.echo(f"wrote {r.dst}: {r.mode} plan, layout {r.layout}, {len(r.ranks)} rank(s), {len(r.files)} file(s), "
               f"{human_bytes(r.bytes_written)}" + (f" ({r.files_resumed} kept from the earlier run)"
                                                    if r.files_resumed else ""))
    rows = [(s.rank, s.folder, s.tensors, s.experts,
             (s.pack or "-") + (f" (+{s.more_packs} more)" if s.more_packs else ""), s.pack_records)
            for s in r.ranks[:16]]
    click.echo(table(rows, ["rank", "folder", "tensors", "experts", "pack", "records"], "rllrlr"))
    if len(r.ranks) > 16:
        click.echo(f"... {len(r.ranks) - 16} more rank(s)")
    if r.hub is not None:
        from .requant import hub_summary

        click.echo(hub_summary(r.hub))
    if r.cluster is not None:
        click.echo(ray_line(r.cluster))
    if r.layout == "moet":
        env = plan.cache.vllm_pp_partition()
        pp = f"; run vLLM with VLLM_PP_LAYER_PARTITION={env} (the plan's stages)" if env else ""
        click.echo("moet packs are in moet-store/: point VLLM_MOE_W2_STORE_DIR at it, set VLLM_MOE_W2_CKPT_ID "
                   "to the ckpt_id in rank-*/rank.json, VLLM_MOE_W2=1 and VLLM_MOE_W2_BASE_CACHE_GB above 0 (the "
                   f"runtime reads packs only then){pp}")
