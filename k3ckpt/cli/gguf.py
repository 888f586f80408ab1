"""``k3ckpt gguf SRC OUT.gguf``: a K3 checkpoint as a GGUF file (or splits) llama.cpp runs."""

from __future__ import annotations

import sys

import click

from .. import api
from .render import echo_json, human_bytes


@click.command("gguf")
@click.argument("src")
@click.argument("out")
@click.option("--expert-type", default="iq2_xs", show_default=True, metavar="TYPE",
              help="ggml type of the routed experts: iq2_xs, mxfp4 (lossless repack), q8_0, bf16, f16, f32 "
                   "(any case, as ggml spells them).")
@click.option("--outtype", default=None, metavar="TYPE",
              help="bf16, f16, q8_0 or f32 for the other tensors llama.cpp does not keep in f32 "
                   "(default: as the source stores them; BF16 stays BF16 byte for byte).")
@click.option("--split-max-size", default="48GB", show_default=True, metavar="SIZE",
              help="Most tensor bytes per file, with a unit (below the Hub's 50 GB file limit); 'none': one file.")
@click.option("--dry-run", is_flag=True, help="Print the files, types and bytes it would write; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def command(src, out, expert_type, outtype, split_max_size, dry_run, as_json, quiet):
    """Write OUT: the checkpoint SRC as GGUF for llama.cpp: Kimi K3 (MXFP4) as kimi-k3, its text
    model; Kimi K2 / DeepSeek-V3 (block FP8) as deepseek2.

    Tensor names, shapes, types and metadata are those llama.cpp's own converter
    writes (vision tower skipped); routed experts are stacked per layer and
    written one expert at a time, MXFP4 experts repacked losslessly (mxfp4) or
    requantized by k3ckpt's encoder (iq2_xs), FP8 decoded tensor by tensor. The
    vocabulary comes from the folder's tiktoken.model and tokenizer_config.json;
    no remote code runs.
    With more than one file, pass llama.cpp the first (OUT-00001-of-0000N.gguf).

    \b
    Examples:
      k3ckpt gguf Kimi-K3 Kimi-K3-IQ2_XS.gguf --dry-run
      k3ckpt gguf Kimi-K3 Kimi-K3-MXFP4.gguf --expert-type mxfp4
      llama-server -m Kimi-K3-IQ2_XS-00001-of-00020.gguf
    """
    from ..units import parse_size

    size = None if split_max_size.strip().lower() == "none" else parse_size(split_max_size, "--split-max-size")
    result = api.gguf(src, out, expert_type=expert_type, outtype=outtype, split_max_size=size,
                      dry_run=dry_run, progress=not quiet and not dry_run and sys.stderr.isatty())
    if as_json:
        echo_json(result.to_dict())
        return
    verb = "would write" if dry_run else "wrote"
    types = ", ".join(f"{t} {human_bytes(n)}" for t, n in sorted(result.bytes_by_type.items(), key=lambda x: -x[1]))
    click.echo(f"{verb} {len(result.paths)} file(s), {result.tensors} tensors, {human_bytes(result.bytes_written)} "
               f"({types})")
    click.echo(f"first file: {result.paths[0]}")
    if dry_run and result.free_bytes is not None:
        room = "enough" if result.free_bytes >= result.bytes_written else "NOT enough"
        click.echo(f"free space: {human_bytes(result.free_bytes)} ({room})")
    if result.skipped:
        click.echo(f"skipped {len(result.skipped)} tensor(s) of the vision tower and projector (text model only)")
