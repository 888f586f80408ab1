"""``k3ckpt formats [--json]``: the registered weight formats (the format table)."""

from __future__ import annotations

import click

from .render import echo_json, table


@click.command("formats")
@click.option("--json", "as_json", is_flag=True, help="Print every format's full row as JSON.")
def command(as_json):
    """List every registered weight format: id, bits per weight, block layout,
    whether k3ckpt can encode and decode it, and its spec page."""
    from ..formats import list_formats

    infos = list_formats()
    if as_json:
        echo_json([{**i.to_dict(), "from_mxfp4": _from_mxfp4(i.id)} for i in infos])
        return
    rows = []
    for i in infos:
        bpw = f"{i.bits_per_weight:g}" + (f" +{i.tensor_bytes}B" if i.tensor_bytes else "")
        encode = "yes" if i.can_encode else ("from mxfp4" if _from_mxfp4(i.id) else "no")
        rows.append((i.id, bpw, i.block, i.fields_text, encode, "yes" if i.can_decode else "no", i.spec))
    click.echo(table(rows, ["id", "bits/weight", "block", "bytes/block", "encode", "decode", "spec"],
                     align="lrrllll"))


def _from_mxfp4(fid: str) -> bool:
    from ..formats import get_format

    return hasattr(get_format(fid), "from_mxfp4")
