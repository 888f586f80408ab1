"""``k3ckpt fixture NAME DST``: synthetic checkpoints with real names, dtypes and layouts."""

from __future__ import annotations

import click

from .. import api


@click.command("fixture")
@click.argument("name", required=False)
@click.argument("dst", required=False)
@click.option("--layers", type=int, default=None, help="Decoder layers (fixture default if unset).")
@click.option("--num-experts", "experts", type=int, default=None, metavar="N",
              help="Routed experts per MoE layer (fixture default if unset).")
# The old name, kept hidden: elsewhere --experts is a regex on expert names (requant).
@click.option("--experts", "experts_old", type=int, default=None, hidden=True, help="Old name of --num-experts.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the generated values: same seed, same bytes.")
@click.option("--profile", "profile", default=None, metavar="NAME",
              help="The fixture by name, as an option: `k3ckpt fixture --profile NAME DST`.")
@click.option("--overwrite", is_flag=True,
              help="Rebuild in a DST that holds files: its shards and index are replaced, other files kept.")
@click.option("--list", "list_only", is_flag=True, help="List the fixtures and exit.")
def command(name, dst, layers, experts, experts_old, seed, profile, overwrite, list_only):
    """Generate fixture NAME into the folder DST (or `--profile NAME DST`).

    k3-tiny, k3 (real expert shapes), kimi-k2-tiny, gpt-oss-tiny, the other
    sources (kimi-k2-thinking-tiny, deepseek-v3-tiny, nvfp4-tiny,
    nvfp4-modelopt-tiny; see --list), and k3-virtual (the full-size K3 as
    headers over sparse files: no disk cost).  Free space is checked first and
    DST is written only when the build is complete.

    \b
    Examples:
      k3ckpt fixture --list
      k3ckpt fixture k3-tiny out/k3-tiny
      k3ckpt fixture k3 out/k3-1g --num-experts 28   # real expert shapes, ~1 GB
      k3ckpt fixture k3-virtual out/k3v              # 1.56 TB of headers over holes
    """
    from ..errors import UsageError

    if experts_old is not None:
        if experts is not None:
            raise UsageError("give --num-experts once (--experts is its old name)")
        experts = experts_old

    if profile is not None:   # then the one positional argument is DST
        if dst is not None:
            raise UsageError(f"give the fixture once: --profile {profile} or NAME, not both ({name!r})")
        name, dst = profile, name

    known = api.fixtures()
    if list_only or name is None:
        for key, description in sorted(known.items()):
            if key != api.VIRTUAL_K3:
                click.echo(f"{key:22s} {description}")
        click.echo(f"{api.VIRTUAL_K3:14s} {known[api.VIRTUAL_K3]}")
        return
    if dst is None:
        raise UsageError("give a destination folder: k3ckpt fixture NAME DST")
    if name not in known:
        raise UsageError(f"unknown fixture {name!r}; choose from {', '.join(known)}")
    options = {"seed": seed, "overwrite": overwrite}
    if layers is not None:
        options["layers"] = layers
    if experts is not None:
        options["experts"] = experts
    if name == api.VIRTUAL_K3:
        if layers is not None or experts is not None:
            raise UsageError("k3-virtual is the real geometry; --layers/--num-experts do not apply")
        options = {"overwrite": overwrite}
    path = api.make_fixture(name, dst, **options)
    click.echo(f"wrote {name} to {path}")
