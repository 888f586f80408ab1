"""``k3ckpt requant SRC DST --format F``: routed experts to a ~2.25-bpw format, with an error report."""

from __future__ import annotations

import sys
from collections import defaultdict

import click

from .. import api
from .render import echo_json, fmt_db, human_bytes, human_count, human_duration, ray_line, table
from .source import hub_option, source_argument


def hub_summary(run) -> str:
    """One line on what staging did (shared with ``k3ckpt shard``)."""
    st, pf = run.stage, run.preflight
    budget = f", --max-disk {human_bytes(pf.max_disk)}" if pf.max_disk else ""
    return (f"source {run.source}: {st.downloads} shard(s) staged ({st.refetches} more than once), "
            f"{human_bytes(st.bytes_downloaded)} downloaded, peak disk {human_bytes(st.peak_disk)}{budget}")


@click.command("requant")
@source_argument
@click.argument("dst")
@hub_option
@click.option("--format", "fmt", default="moet-w2", show_default=True, metavar="FORMAT",
              help="moet-w2 (refit), moet-w2:keep-scales, k3ckpt-mx2, mxfp4, or another format from "
                   "`k3ckpt formats`.")
@click.option("--layout", type=click.Choice(["compressed-tensors", "gpt-oss"]), default=None,
              help="MXFP4 output layout (--format mxfp4): compressed-tensors pairs per weight (default) or "
                   "gpt-oss's fused per-layer _blocks/_scales.")
@click.option("--experts", default=None, metavar="REGEX|PROJ,...",
              help="Which routed-expert weights: a regex on logical names, or projections (gate,up,down). "
                   "Default: all.")
@click.option("--tensor-type", "tensor_type", multiple=True, metavar="REGEX=FORMAT",
              help="Per-weight override, first match wins (FORMAT 'keep' leaves MXFP4). Repeatable.")
@click.option("--target-bpw", "target_bpw", type=float, default=None, metavar="X",
              help="Mixed precision: keep the weights with the most error per byte in MXFP4 so the average "
                   "is X bits per weight (measures every weight first). X lies between FORMAT's bpw and the "
                   "source experts' bpw.")
@click.option("--imatrix", "imatrix", default=None, metavar="FILE",
              help="llama.cpp importance matrix (llama-imatrix's GGUF or legacy .dat): the encoders of "
                   "the llama.cpp family (gguf-iq1_s ... gguf-iq3_xxs) weigh their error by it, and the report gives the weighted SNR "
                   "of every weight it covers beside the plain one.")
@click.option("--workers", type=int, default=None, help="Worker processes (default: CPU count).")
@click.option("--ray", "ray", default=None, metavar="ADDRESS|auto",
              help="Compute the weights on a Ray cluster (its head's HOST:PORT, or auto); SRC and DST must be "
                   "paths every node sees. Same bytes as a local run. Needs pip install 'k3ckpt[ray]'.")
@click.option("--max-shard-size", "max_shard_size", default="5GB", show_default=True, metavar="SIZE",
              help="Largest output shard (tensor bytes), with a unit (5GB, 500MB, 2GiB). The output is "
                   "re-sharded to this size, as transformers' save_pretrained does; the source's shard "
                   "boundaries are not kept.")
@click.option("--report", "report_path", default=None, metavar="DIR",
              help="Folder for requant_report.{json,md,svg} (default: DST).")
@click.option("--dry-run", is_flag=True,
              help="Print the plan (weights, formats, bytes, time estimate); write nothing.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run in DST (same options).")
@click.option("--max-disk", "max_disk", default=None, metavar="SIZE",
              help="hf:// source: bound downloaded shards plus output to SIZE (e.g. 1TB, 500G).")
@click.option("--staging", default=None, metavar="DIR",
              help="hf:// source: download shards here (default DST/.k3ckpt-staging).")
@click.option("--keep-source", is_flag=True, help="hf:// source: keep the downloaded shards.")
@click.option("--push-to-hub", "push_to", default=None, metavar="ORG/NAME",
              help="Upload DST to this Hub repo with a generated model card (resumable: rerun to finish).")
@click.option("--private", is_flag=True, help="--push-to-hub: create the repo private.")
@click.option("--push-revision", "push_revision", default=None, metavar="BRANCH",
              help="--push-to-hub: branch to commit to (default: main). The source's revision is "
                   "hf://ORG/NAME@REV or --revision REV.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no kernel-compile note.")
def command(src, dst, fmt, layout, experts, tensor_type, target_bpw, imatrix, workers, ray, max_shard_size,
            report_path, dry_run, resume, max_disk, staging, keep_source, push_to, private, push_revision, as_json,
            quiet):
    """Write DST: SRC with its routed-expert weights requantized to FORMAT.

    SRC's routed experts may be MXFP4, block FP8, INT4 pack-quantized, NVFP4
    or BF16/F16/F32; non-MXFP4 ones are decoded to float32 first and the
    error is measured against those values.

    Every other tensor is copied byte for byte; config.json gets a
    quantization_config naming the new format (docs/requant.md); side files
    are copied; an error report is written beside the weights. Interrupted
    runs continue with --resume and give the same bytes.

    \b
    Examples:
      k3ckpt requant /models/Kimi-K3 k3-w2 --dry-run
      k3ckpt requant hf://moonshotai/Kimi-K3@main k3-w2 --target-bpw 2.5 --max-disk 1TB
    """
    spec = api.format_spec(fmt)
    result = api.requant(src, dst, format=spec, experts=experts, tensor_type=list(tensor_type), workers=workers,
                         report=report_path, target_bpw=target_bpw, layout=layout, max_shard_size=max_shard_size,
                         dry_run=dry_run, resume=resume, max_disk=max_disk, staging=staging,
                         keep_source=keep_source, push_to=push_to, private=private, push_revision=push_revision,
                         progress=not quiet and not as_json and sys.stderr.isatty(),
                         on_compile=None if quiet else _compile_note, imatrix=imatrix, ray=ray)
    budget, hub_run, pushed = result.budget, result.hub, result.pushed
    if as_json:
        echo_json(result.to_dict())
        return
    if dry_run:
        _print_plan(result)
        if target_bpw is not None:
            click.echo(f"--target-bpw {target_bpw:g}: which weights stay MXFP4 is decided by measuring them "
                       "during the run; the plan above shows every selected weight in the 2.25 format")
    else:
        _print_summary(result, spec)
    if budget is not None:
        click.echo(budget.message() if not budget.ok else
                   f"--max-disk {human_bytes(budget.max_disk)} works: a run needs {human_bytes(budget.need)} "
                   f"(output {human_bytes(budget.output_bytes)} + largest source shard "
                   f"{human_bytes(budget.largest_shard_bytes)})")
    if hub_run is not None:
        click.echo(hub_summary(hub_run))
    if pushed is not None:
        click.echo(pushed.summary())


def _compile_note(seconds: float) -> None:
    # numba compiles on a first run (tens of seconds) and says nothing itself
    click.echo(f"compiling kernels (first run only, about {human_duration(seconds)})", err=True)


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
    click.echo(table(rows, ["format", "projection", "weights", "params", "source bytes", "new bytes", "bpw"],
                     align="llrrrrr"))
    click.echo(f"plan: {len(plan.weights)} weight(s) requantized, {len(plan.copies)} tensor(s) copied, "
               f"{len(plan.kept)} expert weight(s) left as stored; output {human_bytes(plan.total_bytes)} "
               f"({result.bits_per_weight:.4f} bits per requantized weight); "
               f"estimated about {human_duration(result.estimated_seconds)}"
               + (f" (of it {human_duration(result.compile_seconds)} compiling kernels, first run only)"
                  if result.compile_seconds else "") + "; nothing written (--dry-run)")


def _print_summary(result, spec: str) -> None:
    res = result.results
    plan = result.plan
    rows = [(f, p, human_count(params), fmt_db(snr)) for f, p, params, snr in api.snr_by_group(res)]
    if rows:
        click.echo(table(rows, ["format", "projection", "params", "SNR dB"], align="llrr"))
    worst = min(res, key=lambda r: r.stats.snr_db, default=None)
    rate = plan.in_bytes / result.seconds if result.seconds > 0 else 0.0
    click.echo(f"wrote {result.dst}: {len(plan.weights)} weight(s) requantized, {result.bits_per_weight:.4f} bpw "
               f"({human_bytes(plan.in_bytes)} -> {human_bytes(plan.out_bytes)}), {result.copied} tensor(s) "
               f"copied, {len(result.shards)} shard(s) ({len(result.resumed_shards)} from an earlier run), "
               f"{result.seconds:.1f} s ({human_bytes(rate)}/s of source)")
    if res:
        click.echo(f"SNR {fmt_db(result.snr_db)} dB overall" + _reference(result, spec))
        weighted = api.weighted_snr(res)
        if weighted is not None:
            db, n = weighted
            click.echo(f"importance-weighted SNR {fmt_db(db)} dB over {n:,} of {len(res):,} weight(s) (--imatrix)")
    if result.allocation is not None:
        a = result.allocation
        click.echo(f"--target-bpw {a['target_bpw']:g}: {len(a['keep'])} source tensor(s) kept in MXFP4, "
                   f"average {a['bpw']:.4f} bits per weight")
    if worst is not None:
        click.echo(f"worst: {worst.name} {worst.stats.snr_db:.2f} dB")
    if result.cluster is not None:
        click.echo(ray_line(result.cluster))
    if result.report:
        click.echo(f"report: {result.report}/requant_report.md (picture: requant_report.svg)")


def _reference(result, spec: str) -> str:
    """The format's reference figures beside the overall SNR (as the report gives them)."""
    ref = api.snr_reference(result, spec)
    return f": {ref}" if ref else ""
