"""``k3ckpt demo``: the main job on a built-in default, for a newcomer.

Generates the tiny K3-shaped fixture and runs the pipeline on it, printing what
each step reports: inspect (headers and data), dequant, requant to the
runtime-compatible 2.25-bpw format with its error report, and a plan for a
small device set.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from .. import api
from .inspect import render_report


@click.command("demo")
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="Where to put the fixture and outputs (default: a new temporary folder).")
def command(workdir):
    """Build the tiny K3 fixture and run inspect, dequant, requant and plan on it."""
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="k3ckpt-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    src = root / "k3-tiny"
    click.echo(f"== 1. fixture: tiny Kimi K3 (real names, MXFP4 experts) -> {src}")
    api.make_fixture("k3-tiny", src)
    click.echo(f"\n== 2. k3ckpt inspect --scan {src}")
    click.echo(render_report(api.inspect(src, scan=True)))
    out = root / "k3-tiny-bf16"
    click.echo(f"\n== 3. k3ckpt dequant {src} {out}")
    result = api.dequant(src, out, dtype="bf16")
    click.echo(f"decoded {len(result.decoded)} MXFP4 weights to bf16, copied {result.copied} tensors "
               f"unchanged -> {out}")
    rq = root / "k3-tiny-moet-w2"
    click.echo(f"\n== 4. k3ckpt requant {src} {rq} --format moet-w2")
    from ..requant.report import load_report
    from ..requant.report_render import render_text

    res = api.requant(src, rq, format="moet-w2", workers=1, progress=False)
    click.echo(render_text(load_report(res.report)))
    click.echo(f"picture: {Path(res.report) / 'requant_report.svg'}")
    click.echo(f"\n== 5. k3ckpt plan {src} --devices 2xH100 --format moet-w2")
    from .plan import render_plan

    click.echo(render_plan(api.plan(src, "2xH100", format="moet-w2")))
    click.echo(f"\nAll outputs are under {root}")
