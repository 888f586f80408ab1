"""``k3ckpt requant SRC DST --format F``: routed experts to a ~2.25-bpw format, with an error report."""

from __future__ import annotations

import math
import sys
from collections import defaultdict

import click

from .render import echo_json, human_bytes, human_count, table


@click.command("requant")
@click.argument("src")
@click.argument("dst")
@click.option("--format", "fmt", default="moet-w2", show_default=True, metavar="FORMAT",
              help="moet-w2 (refit), moet-w2:keep-scales, k3ckpt-mx2, or another format from `k3ckpt formats`.")
@click.option("--experts", default=None, metavar="REGEX|PROJ,...",
              help="Which routed-expert weights: a regex on logical names, or projections (gate,up,down). "
                   "Default: all.")
@click.option("--tensor-type", "tensor_type", multiple=True, metavar="REGEX=FORMAT",
              help="Per-weight override, first match wins (FORMAT 'keep' leaves MXFP4). Repeatable.")
@click.option("--target-bpw", "target_bpw", type=float, default=None, metavar="X",
              help="Mixed precision: keep the weights with the most error per byte in MXFP4 so the average "
                   "is X bits per weight (measures every weight first).")
@click.option("--workers", type=int, default=None, help="Worker processes (default: CPU count).")
@click.option("--report", "report_path", default=None, metavar="DIR",
              help="Folder for requant_report.{json,md,svg} (default: DST).")
@click.option("--dry-run", is_flag=True, help="Print the plan (weights, formats, bytes, time estimate); write nothing.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run in DST (same options).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def command(src, dst, fmt, experts, tensor_type, target_bpw, workers, report_path, dry_run, resume, as_json, quiet):
    """Write DST: SRC with its routed-expert MXFP4 weights requantized to FORMAT.

    Every other tensor is copied byte for byte; config.json gets a
    quantization_config naming the new format (docs/requant.md); side files
    are copied; an error report is written beside the weights. Interrupted
    runs continue with --resume and give the same bytes.
    """
    from .. import api
    from ..requant.pipeline import requant_checkpoint

    with api.open_source(src) as ckpt:
        result = requant_checkpoint(
            ckpt, dst, format=fmt, experts=experts, tensor_type=list(tensor_type), workers=workers,
            dry_run=dry_run, resume=resume, report_path=report_path, target_bpw=target_bpw,
            progress=not quiet and not as_json and sys.stderr.isatty(), source_label=src)
    if as_json:
        echo_json(result.to_dict())
        return
    if dry_run:
        _print_plan(result)
        if target_bpw is not None:
            click.echo(f"--target-bpw {target_bpw:g}: which weights stay MXFP4 is decided by measuring them "
                       "during the run; the plan above shows every selected weight in the 2.25 format")
    else:
        _print_summary(result)


def _groups(weights):
    g = defaultdict(lambda: [0, 0, 0, 0])
    for w in weights:
        row = g[(w.format + (f":{w.method}" if w.method else ""), w.projection or "-")]
        row[0] += 1
        row[1] += w.params
        row[2] += w.in_bytes
        row[3] += w.out_bytes
    return g


def _print_plan(result) -> None:
    plan = result.plan
    rows = [(f, p, n, human_count(params), human_bytes(b_in), human_bytes(b_out),
             f"{8 * b_out / params:.4f}" if params else "-")
            for (f, p), (n, params, b_in, b_out) in sorted(_groups(plan.weights).items())]
    click.echo(table(rows, ["format", "projection", "weights", "params", "MXFP4 bytes", "new bytes", "bpw"],
                     align="llrrrrr"))
    click.echo(f"plan: {len(plan.weights)} weight(s) requantized, {len(plan.copies)} tensor(s) copied, "
               f"{len(plan.kept)} expert weight(s) left in MXFP4; output {human_bytes(plan.total_bytes)} "
               f"({result.bits_per_weight:.4f} bits per requantized weight); "
               f"estimated {result.estimated_seconds:.0f} s; nothing written (--dry-run)")


def _print_summary(result) -> None:
    res = result.results
    plan = result.plan
    by = defaultdict(lambda: [0, 0.0, 0.0])
    for r in res:
        row = by[(r.format + (f":{r.method}" if r.method else ""), r.projection or "-")]
        row[0] += r.params
        row[1] += r.stats.count * r.stats.ref_rms ** 2
        row[2] += r.stats.count * r.stats.err_rms ** 2
    rows = [(f, p, human_count(n), _snr(sx, se)) for (f, p), (n, sx, se) in sorted(by.items())]
    if rows:
        click.echo(table(rows, ["format", "projection", "params", "SNR dB"], align="llrr"))
    worst = min(res, key=lambda r: r.stats.snr_db, default=None)
    rate = plan.in_bytes / result.seconds if result.seconds > 0 else 0.0
    click.echo(f"wrote {result.dst}: {len(plan.weights)} weight(s) requantized, {result.bits_per_weight:.4f} bpw "
               f"({human_bytes(plan.in_bytes)} -> {human_bytes(plan.out_bytes)}), {result.copied} tensor(s) "
               f"copied, {len(result.shards)} shard(s) ({len(result.resumed_shards)} from an earlier run), "
               f"{result.seconds:.1f} s ({human_bytes(rate)}/s of MXFP4)")
    if result.allocation is not None:
        a = result.allocation
        click.echo(f"--target-bpw {a['target_bpw']:g}: {len(a['keep'])} source tensor(s) kept in MXFP4, "
                   f"average {a['bpw']:.4f} bits per weight")
    if worst is not None:
        click.echo(f"worst: {worst.name} {worst.stats.snr_db:.2f} dB")
    if result.report:
        click.echo(f"report: {result.report}/requant_report.md (picture: requant_report.svg)")


def _snr(sx: float, se: float) -> str:
    if se == 0:
        return "inf"
    if sx == 0:
        return "-inf"
    return f"{10 * math.log10(sx / se):.2f}"
