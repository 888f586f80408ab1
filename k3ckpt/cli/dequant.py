"""``k3ckpt dequant SRC DST``: quantized weights decoded to bf16/f16/f32, the rest copied."""

from __future__ import annotations

import sys

import click

from .. import api
from .render import echo_json, human_bytes
from .source import hub_option, source_argument


@click.command("dequant")
@source_argument
@click.argument("dst")
@hub_option
@click.option("--dtype", type=click.Choice(["bf16", "f16", "f32"]), default="bf16", show_default=True,
              help="Output dtype of decoded weights.")
@click.option("--tensors", "pattern", metavar="REGEX", default=None,
              help="Decode only quantized weights whose logical name matches (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def command(src, dst, dtype, pattern, as_json, quiet):
    """Write DST: SRC with its quantized weights decoded to plain floats.

    Decodes MXFP4 (K3's weight_packed + weight_scale, gpt-oss's fused blocks),
    block FP8 (DeepSeek-V3 / Kimi K2 weight + weight_scale_inv), INT4
    pack-quantized (Kimi K2-Thinking) and NVFP4 (compressed-tensors and
    ModelOpt naming), in row chunks.  Weights come out under their plain
    names (`...w1.weight`; gpt-oss unfused per expert, [out, in]); a decoded
    module's activation input_scale is dropped; every other tensor is copied
    byte for byte, and config.json's quantization_config (and ModelOpt's
    hf_quant_config.json) is dropped or narrowed.
    """
    result = api.dequant(src, dst, dtype=dtype, tensors=pattern, progress=not quiet and sys.stderr.isatty())
    if as_json:
        from dataclasses import asdict

        echo_json(asdict(result))
        return
    click.echo(f"wrote {result.dst}: {len(result.decoded)} weight(s) decoded to {dtype}, "
               f"{result.copied} tensor(s) copied, {len(result.shards)} shard(s), "
               f"{human_bytes(result.bytes_written)}")
    for weight, n in sorted(result.nan_blocks.items()):
        click.echo(f"warning: {weight}: {n} block(s) have a NaN scale; they decode to NaN")
    for weight, n in sorted(result.inexact.items()):
        click.echo(f"warning: {weight}: {n} value(s) rounded by the {dtype} output")
    if result.dropped:
        click.echo(f"dropped {len(result.dropped)} activation scale(s) of decoded modules, "
                   f"e.g. {result.dropped[0]}")
    if result.skipped:
        click.echo(f"left quantized: {len(result.skipped)} tensor(s), e.g. {result.skipped[0]}")
