"""``k3ckpt gguf SRC OUT.gguf``: a K3 checkpoint as a GGUF file (or splits) llama.cpp runs."""

from __future__ import annotations

import sys

import click

from .. import api
from .render import echo_json, fmt_db, human_bytes, human_duration, ray_line
from .source import hub_option, source_argument


@click.command("gguf")
@source_argument
@click.argument("out")
@hub_option
@click.option("--expert-type", default="iq2_xs", show_default=True, metavar="TYPE",
              help="ggml type of the routed experts: iq2_xs, iq2_xxs, iq2_s, iq1_s, iq1_m, q2_k, iq3_xxs, mxfp4 (lossless "
                   "repack), q8_0, bf16, f16, f32 "
                   "(any case, as ggml spells them).")
@click.option("--outtype", default=None, metavar="TYPE",
              help="bf16, f16, q8_0 or f32 for the other tensors llama.cpp does not keep in f32 "
                   "(default: as the source stores them; BF16 stays BF16 byte for byte).")
@click.option("--tensor-type", "tensor_type", multiple=True, metavar="REGEX=TYPE",
              help="Per-tensor ggml type by a regex on GGUF tensor names, first match wins. Repeatable.")
@click.option("--target-bpw", "target_bpw", type=float, default=None, metavar="X",
              help="Mixed precision: each stacked expert tensor's type chosen by measured error (importance-"
                   "weighted with --imatrix) so the experts average X bits per weight.")
@click.option("--target-types", "target_types", default=None, metavar="LIST",
              help="The types --target-bpw chooses from, comma-separated (default: iq1_s, iq1_m, iq2_xxs, iq2_xs, "
                   "iq2_s, q2_k, iq3_xxs and, for MXFP4 experts, mxfp4: their lossless repack).")
@click.option("--imatrix", "imatrix", default=None, metavar="FILE",
              help="llama.cpp importance matrix (llama-imatrix's GGUF or legacy .dat): every "
                   "encoder of the llama.cpp family (iq1_s ... iq3_xxs, q2_k) weighs its error by it; the report gives weighted errors beside plain ones.")
@click.option("--ray", "ray", default=None, metavar="ADDRESS|auto",
              help="Encode the routed experts on a Ray cluster (its head's HOST:PORT, or auto); SRC and OUT must "
                   "be paths every node sees. Same bytes as a local run. Needs pip install 'k3ckpt[ray]'.")
@click.option("--fallback-type", "fallback_type", default=None, metavar="TYPE",
              help="Type of a tensor whose rows the asked-for type cannot hold (IQ2_XS needs multiples of 256).")
@click.option("--chat-template", "chat_template", default=None, metavar="FILE",
              help="Write FILE's text as tokenizer.chat_template (for a source without one, or to replace it).")
@click.option("--split-max-size", default="48GB", show_default=True, metavar="SIZE",
              help="Most tensor bytes per file, with a unit (below the Hub's 50 GB file limit); 'none': one file.")
@click.option("--workers", type=int, default=None,
              help="Processes encoding routed experts (default: CPU count; 1: in this process). Same bytes "
                   "for any count.")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted run writing OUT (same options): finished files are kept.")
@click.option("--max-disk", "max_disk", default=None, metavar="SIZE",
              help="hf:// source: bound downloaded shards plus output to SIZE (e.g. 1TB, 500G).")
@click.option("--staging", default=None, metavar="DIR",
              help="hf:// source: download shards here (default .k3ckpt-staging beside OUT).")
@click.option("--keep-source", is_flag=True, help="hf:// source: keep the downloaded shards.")
@click.option("--report", "report", default=None, metavar="DIR",
              help="Folder for the routed experts' requant_report.{json,md,svg} (default: PREFIX-report beside OUT).")
@click.option("--dry-run", is_flag=True,
              help="Print the files, types, bytes, free space and a time estimate; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def command(src, out, expert_type, outtype, tensor_type, target_bpw, target_types, imatrix, ray, fallback_type,
            chat_template, split_max_size, workers, resume, max_disk, staging, keep_source, report, dry_run, as_json, quiet):
    """Write OUT: the checkpoint SRC as GGUF for llama.cpp: Kimi K3 (MXFP4) as kimi-k3, its text
    model; Kimi K2 / DeepSeek-V3 (block FP8, K2-Thinking's INT4) as deepseek2; gpt-oss (MXFP4).

    Tensor names, shapes, types and metadata are those llama.cpp's own converter
    writes (vision tower skipped); routed experts are stacked per layer and
    written one expert at a time, MXFP4 experts repacked losslessly (mxfp4) or
    requantized by k3ckpt's encoder (iq2_xs) in --workers processes, FP8
    and INT4 decoded tensor by tensor. Each expert's error against the source
    goes into an error report (--report). The vocabulary comes from the
    folder's tiktoken.model or tokenizer.json; no remote code runs. An hf://
    SRC is downloaded shard by shard and each shard deleted once written.
    PREFIX.k3ckpt-manifest.json beside OUT records each file's sha256
    (`k3ckpt verify OUT`) and lets --resume continue a run.
    With more than one file, pass llama.cpp the first (OUT-00001-of-0000N.gguf).

    \b
    Examples:
      k3ckpt gguf Kimi-K3 Kimi-K3-IQ2_XS.gguf --dry-run
      k3ckpt gguf Kimi-K3 Kimi-K3-MXFP4.gguf --expert-type mxfp4
      k3ckpt gguf hf://moonshotai/Kimi-K3 Kimi-K3-IQ2_XS.gguf --max-disk 1.2TB
      llama-server -m Kimi-K3-IQ2_XS-00001-of-00020.gguf
    """
    size = None if split_max_size.strip().lower() == "none" else split_max_size
    result = api.gguf(src, out, expert_type=expert_type, outtype=outtype, split_max_size=size,
                      tensor_type=tensor_type, target_bpw=target_bpw, target_types=target_types,
                      fallback_type=fallback_type,
                      chat_template=chat_template, workers=workers,
                      resume=resume, dry_run=dry_run, report=report, max_disk=max_disk, staging=staging,
                      keep_source=keep_source, progress=not quiet and not dry_run and sys.stderr.isatty(),
                      imatrix=imatrix, ray=ray)
    if as_json:
        echo_json(result.to_dict())
        return
    verb = "would write" if dry_run else "wrote"
    types = ", ".join(f"{t} {human_bytes(n)}" for t, n in sorted(result.bytes_by_type.items(), key=lambda x: -x[1]))
    click.echo(f"{verb} {len(result.paths)} file(s), {result.tensors} tensors, {human_bytes(result.bytes_written)} "
               f"({types})")
    click.echo(f"first file: {result.paths[0]}")
    if dry_run:
        if result.free_bytes is not None:
            room = "enough" if result.free_bytes >= result.bytes_written else "NOT enough"
            click.echo(f"free space: {human_bytes(result.free_bytes)} ({room})")
        est = result.estimate
        if est is not None:
            rates = ", ".join(f"{r['type']} {r['weights_per_s'] / 1e6:.1f} M weights/s a core"
                              + ("" if r["measured"] else " (assumed)") for r in est.encode)
            note = f"; of it {human_duration(est.compile_seconds)} compiling kernels (first run only)" \
                if est.compile_seconds else ""
            click.echo(f"estimated about {human_duration(est.seconds)} with {est.workers} worker(s)"
                       + (f" (experts: {rates})" if rates else "") + note)
        if target_bpw is not None:
            click.echo(f"--target-bpw {target_bpw:g}: which experts take which type is decided by measuring them "
                       "during the run; the sizes above are before that choice")
    else:
        done = f", {len(result.resumed)} kept from an earlier run" if result.resumed else ""
        click.echo(f"{result.seconds:.1f} s with {result.workers} worker(s){done}; manifest: {result.manifest}")
        if result.allocation is not None:
            a = result.allocation
            mix = ", ".join(f"{t} {n}" for t, n in a.get("by_type", {}).items())
            click.echo(f"--target-bpw {target_bpw:g}: routed experts at {a['bpw']:.4f} bpw "
                       f"({mix or 'one type'} stacked tensors; errors "
                       f"{'importance-weighted' if a.get('weighted') else 'unweighted'})")
        if result.report is not None:
            weighted = "" if result.weighted_snr_db is None else \
                f" (importance-weighted {fmt_db(result.weighted_snr_db)} dB)"
            click.echo(f"routed experts: SNR {fmt_db(result.snr_db)} dB against the source{weighted}; "
                       f"report: {result.report}/requant_report.md")
        if result.cluster is not None:
            click.echo(ray_line(result.cluster))
    if result.budget is not None:
        click.echo(result.budget["message"])
    if result.hub is not None and not dry_run:
        h = result.hub
        click.echo(f"source {h['source']}: {h['downloads']} shard(s) staged ({h['refetches']} more than once), "
                   f"{human_bytes(h['bytes_downloaded'])} downloaded, peak disk {human_bytes(h['peak_disk'])}")
    if result.skipped:
        click.echo(f"skipped {len(result.skipped)} tensor(s) of the vision tower and projector (text model only)")
