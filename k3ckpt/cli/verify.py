"""``k3ckpt verify DST [--source SRC]``: re-read a k3ckpt output against its manifests (and the source)."""

from __future__ import annotations

import click

from .render import echo_json, human_bytes


class VerifyFailed(click.ClickException):
    """Exit status 1: the output differs from its manifests or the source (bad input is 2)."""

    exit_code = 1


@click.command("verify")
@click.argument("dst")
@click.option("--source", "src", default=None, metavar="SRC",
              help="Also check DST against the checkpoint it was made from (folder, file or hf:// URL).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (problems included).")
def command(dst, src, as_json):
    """Check DST, a `k3ckpt shard`, `requant`, `dequant` or `gguf` output.

    Every file in DST against the run manifest (size, sha256; nothing unlisted
    beside them, except the Moet runtime's own <stem>.lock and
    <stem>.pack.heat.json next to a moet pack), every pack record against its
    pack manifest.  With --source SRC: a shard output's tensors and pack
    records against SRC byte for byte (moet rows by their decoded values); a
    requant or dequant output's tensors against the plan SRC implies with the
    run's options: copied tensors byte for byte, re-encoded or decoded weights
    by presence, dtype and shape.  A `k3ckpt gguf` output (OUT.gguf or any
    split): every split's size and sha256 against PREFIX.k3ckpt-manifest.json,
    and the gguf package's reader finds every planned tensor in it; with
    --source, SRC must be the checkpoint the run read.  The problems go to stderr; exit status 1
    when something differs, 2 when DST is not a k3ckpt output.

    \b
    Examples:
      k3ckpt verify out/shards --source K3
      k3ckpt verify K3-bf16 --json
      k3ckpt verify Kimi-K3-IQ2_XS-00001-of-00020.gguf
    """
    from .. import api

    r = api.verify(dst, source=src)   # a .gguf DST: a k3ckpt gguf output, OUT.gguf or any of its splits
    if as_json:
        from dataclasses import asdict

        echo_json({**asdict(r), "ok": r.ok})
    else:
        what = f"{r.files_checked} file(s), {human_bytes(r.bytes_checked)}"
        if not dst.endswith(".gguf"):          # a GGUF output has no pack records
            what += f", {r.records_checked} pack record(s)"
        if r.source_checked:
            what += f", {r.tensors_checked} tensor(s) against the source"
        click.echo(f"{'ok' if r.ok else 'FAILED'}: {r.dst}: {what}")
        for p in r.problems[:50]:
            click.echo(f"  {p}", err=True)
        if len(r.problems) > 50:
            click.echo(f"  ... {len(r.problems) - 50} more", err=True)
    if not r.ok:
        n = len(r.problems)
        more = f" (and {n - 1:,} more{' listed above' if not as_json else ''})" if n > 1 else ""
        raise VerifyFailed(f"{r.dst}: {n:,} problem{'s' if n > 1 else ''}: {r.problems[0]}{more}")
