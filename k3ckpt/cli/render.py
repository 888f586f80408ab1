"""Rendering helpers shared by the commands: the table, sizes and dB (``k3ckpt.render``), JSON."""

from __future__ import annotations

import json
from typing import Any

import click

from ..render import fmt_db, human_bytes, human_count, human_duration, table

__all__ = ["echo_json", "fmt_db", "human_bytes", "human_count", "human_duration", "ray_line", "table"]


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


def ray_line(cluster: dict) -> str:
    """A --ray run's one line: tasks, nodes, CPUs (a result's ``cluster``; docs/ray.md)."""
    nodes = cluster["nodes"]
    return (f"ray {cluster['address']}: {sum(n['tasks'] for n in nodes):,} task(s) on {len(nodes)} node(s), "
            f"{cluster['workers']} CPU(s)")
