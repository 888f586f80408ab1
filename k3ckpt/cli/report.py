"""``k3ckpt report PATH``: render an existing requant error report (text or JSON)."""

from __future__ import annotations

import click


@click.command("report")
@click.argument("path", metavar="PATH")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (docs/requant-report.md).")
@click.option("--worst", "worst_n", type=click.IntRange(min=0), default=None, metavar="N",
              help="List the N experts of lowest SNR (default: as stored, 10).")
def command(path, as_json, worst_n):
    """Show the requant error report at PATH.

    PATH is a requant_report.json file or the folder holding one (the
    --report folder of `k3ckpt requant`).  The text form gives the summary
    and the worst experts; the folder's requant_report.md and .svg hold the
    per-layer table and the heatmap.

    \b
    Examples:
      k3ckpt report k3-w2
      k3ckpt report k3-w2/requant_report.json --worst 25 --json
    """
    from .. import api

    view = api.report(path, worst=worst_n)
    if as_json:
        for chunk in view.json_chunks():
            click.echo(chunk, nl=False)
        return
    click.echo(view.text())
    if view.picture is not None:
        click.echo(f"\npicture       {view.picture}")
