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
              help="Output dtype of decoded weights (f32 keeps every decoded value exact).")
@click.option("--tensors", "pattern", metavar="REGEX", default=None,
              help="Decode only quantized weights whose logical name matches (default: all); from a GGUF, "
                   "write only the tensors whose GGUF name matches.")
@click.option("--max-shard-size", "max_shard", metavar="SIZE", default="5GB", show_default=True,
              help="Largest output shard, with a unit (e.g. 5GB, 500MB, 2GiB).")
@click.option("--dry-run", is_flag=True,
              help="Print what would be written (tensors, bytes, shards, free space); write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def command(src, dst, dtype, pattern, max_shard, dry_run, as_json, quiet):
    """Write DST: SRC with its quantized weights decoded to plain floats.

    Decodes MXFP4 (K3's weight_packed + weight_scale, gpt-oss's fused blocks),
    block FP8 (DeepSeek-V3 / Kimi K2 weight + weight_scale_inv), INT4
    pack-quantized (Kimi K2-Thinking) and NVFP4 (compressed-tensors and
    ModelOpt naming), in row chunks.  Weights come out under their plain
    names (`...w1.weight`; gpt-oss unfused per expert, [out, in]); a decoded
    module's activation input_scale is dropped; every other tensor is copied
    byte for byte, and config.json's quantization_config (and ModelOpt's
    hf_quant_config.json) is dropped or narrowed.  Output shards are cut at
    --max-shard-size (default 5GB, as save_pretrained does), not the source's
    sharding; DST gets a manifest that `k3ckpt verify` checks.  A failed run
    removes what it created.

    SRC may be a .gguf file (any split of a set; the whole set is read): every
    tensor comes out under its GGUF name in numpy order, quantized ones decoded
    by the gguf package's dequantizers, F32/F16/BF16 copied as they are, and the
    GGUF metadata in k3ckpt_gguf_metadata.json (no config.json).

    \b
    Examples:
      k3ckpt dequant K3 K3-bf16 --dry-run
      k3ckpt dequant Kimi-K3-IQ2_XS-00001-of-00020.gguf K3-from-gguf --dtype f32
      k3ckpt dequant kimi-k2 kimi-k2-f32 --dtype f32 --tensors 'layers\\.1\\.' --max-shard-size 10GB
    """
    result = api.dequant(src, dst, dtype=dtype, tensors=pattern, max_shard_size=max_shard, dry_run=dry_run,
                         progress=not quiet and not dry_run and sys.stderr.isatty())
    if isinstance(result, api.GGUFDequantResult):
        _render_gguf(result, dtype, as_json)
    elif as_json:
        echo_json(result.to_dict())
    elif dry_run:
        room = ("enough free space" if result.fits else
                f"NOT enough free space: {human_bytes(result.free_bytes)} free")
        click.echo(f"would write {result.dst}: {result.tensors:,} tensor(s), {len(result.decoded):,} weight(s) "
                   f"decoded to {dtype}, {result.copied:,} copied, {_count_shards(result):,} shard(s) of at most "
                   f"{human_bytes(result.max_shard_bytes)}, {human_bytes(result.bytes_written)} ({room})")
    else:
        click.echo(f"wrote {result.dst}: {len(result.decoded)} weight(s) decoded to {dtype}, "
                   f"{result.copied} tensor(s) copied, {_count_shards(result)} shard(s), "
                   f"{human_bytes(result.bytes_written)}")
    if isinstance(result, api.GGUFDequantResult):
        return
    if not as_json:
        if result.dropped:
            click.echo(f"dropped {len(result.dropped)} activation scale(s) of decoded modules, "
                       f"e.g. {result.dropped[0]}")
        if result.skipped:
            click.echo(f"left quantized: {len(result.skipped)} tensor(s), e.g. {result.skipped[0]}")
    _warn(result, dtype)


def _warn(result, dtype: str) -> None:
    """One line per kind on stderr, however many weights (K3 has 247,296): the count, the worst."""
    if result.nan_blocks:
        worst = max(result.nan_blocks, key=lambda w: (result.nan_blocks[w], w))
        total = sum(result.nan_blocks.values())
        click.echo(f"k3ckpt: warning: {total:,} block(s) in {len(result.nan_blocks):,} weight(s) have a NaN scale "
                   f"and decode to NaN (most: {worst}, {result.nan_blocks[worst]:,})", err=True)
    if result.inexact:
        worst = max(result.inexact, key=lambda w: (result.inexact[w], w))
        total = sum(result.inexact.values())
        click.echo(f"k3ckpt: warning: {total:,} value(s) in {len(result.inexact):,} weight(s) rounded by the "
                   f"{dtype} output (most: {worst}, {result.inexact[worst]:,}); --dtype f32 keeps them exact",
                   err=True)


def _render_gguf(result, dtype: str, as_json: bool) -> None:
    if as_json:
        echo_json(result.to_dict())
        _warn_gguf(result, dtype)
        return
    verb = "would write" if result.dry_run else "wrote"
    line = (f"{verb} {result.dst}: {result.tensors:,} tensor(s) under their GGUF names, {len(result.decoded):,} "
            f"decoded to {dtype}, {result.copied:,} copied, {_count_shards(result):,} shard(s), "
            f"{human_bytes(result.bytes_written)}, with {result.metadata_file}")
    if result.dry_run:
        line += (" (enough free space)" if result.fits else
                 f" (NOT enough free space: {human_bytes(result.free_bytes)} free)")
    click.echo(line)
    if result.left_out:
        click.echo(f"left out: {len(result.left_out):,} tensor(s) --tensors did not select, e.g. {result.left_out[0]}")
    _warn_gguf(result, dtype)


def _warn_gguf(result, dtype: str) -> None:
    for what, counts, tail in (("decoded to NaN or Inf", result.nonfinite, ""),
                               (f"rounded by the {dtype} output", result.inexact, "; --dtype f32 keeps them exact")):
        if counts:
            worst = max(counts, key=lambda w: (counts[w], w))
            click.echo(f"k3ckpt: warning: {sum(counts.values()):,} value(s) in {len(counts):,} tensor(s) {what} "
                       f"(most: {worst}, {counts[worst]:,}){tail}", err=True)


def _count_shards(result) -> int:
    return sum(1 for s in result.shards if s.endswith(".safetensors"))   # not the index
