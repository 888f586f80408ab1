"""Rendering helpers shared by the commands: the table (``k3ckpt.render``), sizes, JSON."""

from __future__ import annotations

import json
from typing import Any

import click

from ..render import table  # noqa: F401  (re-exported for the commands)
from ..units import human_bytes, human_count  # noqa: F401  (re-exported for the commands)


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))
