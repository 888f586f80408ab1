"""``k3ckpt formats [--json]``: the registered weight formats (the format table)."""

from __future__ import annotations

import click

from .render import echo_json, table


@click.command("formats", epilog="""\b
Examples:
  k3ckpt formats
  k3ckpt formats --json | jq -r '.[] | select(.requant_target) | .id'""")
@click.option("--json", "as_json", is_flag=True,
              help="Print every format's full row as JSON (with from_mxfp4 and requant_target).")
def command(as_json):
    """List every registered weight format: id, bits per weight, block layout,
    whether k3ckpt can encode and decode it, whether `requant --format` can
    write it (target), and its spec page.

    --format also takes any id in any case and llama.cpp's type names
    (IQ2_XS = gguf-iq2_xs); decode-only formats are read, never written."""
    from .. import api

    entries = api.formats()
    if as_json:
        echo_json([e.to_dict() for e in entries])
        return
    rows = []
    for e in entries:
        i = e.info
        bpw = f"{i.bits_per_weight:g}" + (f" +{i.tensor_bytes}B" if i.tensor_bytes else "")
        encode = "yes" if i.can_encode else ("from mxfp4" if e.from_mxfp4 else "no")
        target = "yes" if e.requant_target else "no (decode-only)"
        rows.append((i.id, bpw, i.block, i.fields_text, encode, "yes" if i.can_decode else "no", target, i.spec))
    click.echo(table(rows, ["id", "bits/weight", "block", "bytes/block", "encode", "decode", "target", "spec"],
                     align="lrrlllll"))

