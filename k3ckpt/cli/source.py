"""The SRC argument every command shares, with ``--hub`` for a bare Hub repo id."""

from __future__ import annotations

import re

import click

from ..errors import UsageError
from ..hub.url import SCHEME, is_hub_url

_META = "k3ckpt.hub"
# ORG/NAME[@REVISION][/SUBFOLDER]: what hf:// takes after the scheme (hub/url.py checks the rest)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[^/\s]+)?(/\S*)?")


def _remember_hub(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    ctx.meta[_META] = value
    return value


def _source(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is None or not ctx.meta.get(_META) or is_hub_url(value):
        return value
    if not _REPO_ID.fullmatch(value):
        raise UsageError(f"--hub needs SRC as ORG/NAME[@REVISION][/SUBFOLDER], found {value!r}")
    return SCHEME + value


hub_option = click.option(
    "--hub", is_flag=True, is_eager=True, expose_value=False, callback=_remember_hub,
    help="SRC is a Hub repo id, ORG/NAME[@REVISION][/SUBFOLDER] (the same as hf://ORG/NAME...).")
source_argument = click.argument("src", callback=_source)
