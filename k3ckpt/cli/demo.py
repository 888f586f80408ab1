"""``k3ckpt demo``: the main job on a built-in default, for a newcomer.

Generates the tiny K3-shaped fixture and runs the pipeline on it, printing what
each step reports: inspect (headers), inspect --scan (data), dequant.
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
    """Build the tiny K3 fixture and run inspect, scan and dequant on it."""
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
    click.echo(f"\nAll outputs are under {root}")
