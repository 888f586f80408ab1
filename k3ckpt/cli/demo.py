"""``k3ckpt demo``: the main job on a built-in default, for a newcomer.

Generates the tiny K3-shaped fixture and runs the pipeline on it, printing what
each step reports: inspect (headers and data), dequant, requant to the
2.25-bpw moet-w2 format with its error report, and a plan for a
small device set.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from .. import api
from .inspect import render_report

DEFAULT_DIR = "k3ckpt-demo"
OUTPUTS = ("k3-tiny", "k3-tiny-bf16", "k3-tiny-moet-w2")
MARK = ".k3ckpt-demo"   # in the demo folder: the OUTPUTS there are ours to replace


def demo_root(workdir: str | None) -> Path:
    """The demo's folder, ready for a run: the outputs of an earlier demo there are removed
    (the mark says they are ours); outputs we did not make are refused, never removed."""
    from ..errors import OutputExistsError

    root = Path(workdir or DEFAULT_DIR).absolute()
    if root.exists() and not root.is_dir():
        raise OutputExistsError("exists and is not a folder; choose another --dir", file=str(root))
    found = [name for name in OUTPUTS if (root / name).exists()]
    if found and not (root / MARK).is_file():
        raise OutputExistsError(f"holds {found[0]}, not made by k3ckpt demo; choose another --dir", file=str(root))
    if found:
        click.echo(f"replacing the outputs of an earlier demo in {root}")
        for name in found:
            shutil.rmtree(root / name)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARK).write_text("outputs of k3ckpt demo: " + ", ".join(OUTPUTS) + "\n")
    return root


@click.command("demo")
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help=f"Where to put the fixture and outputs (default: ./{DEFAULT_DIR}; a rerun replaces them).")
def command(workdir):
    """Build the tiny K3 fixture and run inspect, dequant, requant and plan on it.

    Writes about 30 MB into ./k3ckpt-demo (or --dir), and says where; a second run
    replaces what the first wrote there.

    \b
    Examples:
      k3ckpt demo
      k3ckpt demo --dir /tmp/k3-demo
    """
    root = Path(workdir or DEFAULT_DIR).absolute()
    click.echo(f"k3ckpt demo: writing into {root} (remove it when done: rm -r {root})")
    root = demo_root(workdir)
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
    res = api.requant(src, rq, format="moet-w2", workers=1, progress=False)
    click.echo(api.report(res.report).text())
    click.echo(f"picture: {Path(res.report) / 'requant_report.svg'}")
    click.echo(f"\n== 5. k3ckpt plan {src} --devices 2xH100 --format moet-w2")
    from .plan import render_plan

    click.echo(render_plan(api.plan(src, "2xH100", format="moet-w2")))
    click.echo(f"\nAll outputs are under {root} (about 30 MB; remove them with: rm -r {root})")
