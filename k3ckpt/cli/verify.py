"""``k3ckpt verify DST [--source SRC]``: re-read a shard or requant output against its manifests."""

from __future__ import annotations

import click

from .render import echo_json, human_bytes


class VerifyFailed(click.ClickException):
    """Exit status 1: the output differs from its manifests or the source."""

    exit_code = 1


@click.command("verify")
@click.argument("dst")
@click.option("--source", "src", default=None, metavar="SRC", help="Also compare every output with this checkpoint.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def command(dst, src, as_json):
    """Check every file in DST (a shard or requant output) against the run manifest (size,
    sha256), every pack record against its pack manifest, and, for a shard output, with
    --source every tensor and record against SRC.  Exit status 1 when something differs."""
    from ..shard.verify import verify_output

    if src is not None:
        from .. import api

        with api.open_source(src) as ckpt:
            r = verify_output(dst, source=ckpt)
    else:
        r = verify_output(dst)
    if as_json:
        from dataclasses import asdict

        echo_json({**asdict(r), "ok": r.ok})
    else:
        what = f"{r.files_checked} file(s), {human_bytes(r.bytes_checked)}, {r.records_checked} pack record(s)"
        if r.source_checked:
            what += f", {r.tensors_checked} tensor(s) against the source"
        click.echo(f"{'ok' if r.ok else 'FAILED'}: {r.dst}: {what}")
        for p in r.problems[:50]:
            click.echo(f"  {p}")
        if len(r.problems) > 50:
            click.echo(f"  ... {len(r.problems) - 50} more")
    if not r.ok:
        raise VerifyFailed(f"{len(r.problems)} problem(s) in {r.dst}")
