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
    from ..requant.report import json_chunks, load_report, render_text, resolve_report_path, with_worst

    report = load_report(path)
    if worst_n is not None and worst_n != report.worst_n:
        report = with_worst(report, worst_n)
    if as_json:
        for chunk in json_chunks(report.to_json(lazy=True)):
            click.echo(chunk, nl=False)
        return
    click.echo(render_text(report))
    svg = resolve_report_path(path).with_name("requant_report.svg")
    if svg.is_file():
        click.echo(f"\npicture       {svg}")
