"""The SRC argument every command shares, with ``--hub`` for a bare Hub repo id and
``--revision REV`` for the Hub revision to read."""

from __future__ import annotations

import click

_META = "k3ckpt.hub"


def _remember_hub(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    ctx.meta[_META] = value
    return value


def _remember_revision(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    ctx.meta[_META + ".revision"] = value
    return value


def _source(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    from .. import api   # here, not above: ``--help`` must not import numpy (api reads checkpoints)

    return api.source_url(value, hub=bool(ctx.meta.get(_META)), revision=ctx.meta.get(_META + ".revision"))


_hub_flag = click.option(
    "--hub", is_flag=True, is_eager=True, expose_value=False, callback=_remember_hub,
    help="SRC is a Hub repo id, ORG/NAME[@REVISION][/SUBFOLDER] (the same as hf://ORG/NAME...).")
_revision = click.option(
    "--revision", metavar="REV", is_eager=True, expose_value=False, callback=_remember_revision,
    help="Hub source: the branch, tag or commit to read (the same as hf://ORG/NAME@REV; default: main).")


def hub_option(fn):
    """``--hub`` and ``--revision REV``: how SRC names a Hub checkpoint (eager, so SRC's callback sees them)."""
    return _hub_flag(_revision(fn))


source_argument = click.argument("src", callback=_source)
