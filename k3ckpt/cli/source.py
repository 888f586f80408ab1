"""The SRC argument every command shares, with ``--hub`` for a bare Hub repo id and
``--revision REV`` for the Hub revision to read."""

from __future__ import annotations

import re
from dataclasses import replace

import click

from ..errors import UsageError
from ..hub.url import SCHEME, is_hub_url, parse_hub_url

_META = "k3ckpt.hub"
# ORG/NAME[@REVISION][/SUBFOLDER]: what hf:// takes after the scheme (hub/url.py checks the rest)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[^/\s]+)?(/\S*)?")


def _remember_hub(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    ctx.meta[_META] = value
    return value


def _remember_revision(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    ctx.meta[_META + ".revision"] = value
    return value


def _source(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is not None and ctx.meta.get(_META) and not is_hub_url(value):
        if not _REPO_ID.fullmatch(value):
            raise UsageError(f"--hub needs SRC as ORG/NAME[@REVISION][/SUBFOLDER], found {value!r}")
        value = SCHEME + value
    revision = ctx.meta.get(_META + ".revision")
    if value is None or revision is None:
        return value
    if not is_hub_url(value):
        raise UsageError(f"--revision {revision} picks a Hub revision; SRC {value!r} is a local path")
    url = parse_hub_url(value)
    if url.revision is not None and url.revision != revision:
        raise UsageError(f"SRC names revision {url.revision!r} and --revision {revision!r}: give one")
    return str(replace(url, revision=revision))


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
