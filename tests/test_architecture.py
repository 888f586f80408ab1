"""The package layers of docs/architecture.md, read from the source (``tools/import_graph.py``):
no import cycles between packages, the low layers import nothing above them, and ``api`` is
the one orchestrator (only the CLI calls it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import import_graph  # noqa: E402

GRAPH = import_graph.package_graph()

# what each low layer may import (docs/architecture.md, "Layers")
FOUNDATION = {"errors", "units", "columns", "_numba", "k3ckpt"}
MAY_IMPORT = {
    "errors": set(),
    "units": {"errors"},
    "io": FOUNDATION,
    "formats": FOUNDATION | {"io"},
    "checkpoint": FOUNDATION | {"io", "formats"},
    "profiles": FOUNDATION | {"io", "formats", "checkpoint"},
}


def test_the_graph_is_read():
    # a walker that found nothing would pass every test below
    assert {"api", "cli", "io", "formats", "requant", "placement", "shard", "gguf", "hub"} <= set(GRAPH)
    assert "io" in GRAPH["formats"] and "api" in GRAPH["cli"]


def test_no_import_cycles_between_packages():
    assert import_graph.cycles(GRAPH) == []


def test_cycles_are_found():
    assert import_graph.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_low_layers_import_nothing_above_them(layer):
    assert GRAPH[layer] - MAY_IMPORT[layer] == set()


def test_only_the_cli_calls_the_orchestrator():
    callers = {node for node, deps in GRAPH.items() if "api" in deps}
    assert callers <= {"cli", "__main__"}
    assert {node for node, deps in GRAPH.items() if "cli" in deps} <= {"__main__"}


def test_module_names_say_what_they_hold():
    """No two modules of the planner and the writers share a name, and there is one module
    named for planning per job (the requant plan, the placement planner, the plan command)."""
    imports = import_graph.module_imports()
    names = [m.rsplit(".", 1)[1] for m in imports if m.split(".")[1:2] in (["placement"], ["shard"])]
    assert len(names) == len(set(names))
    planners = sorted(m for m in imports if m.rsplit(".", 1)[-1].startswith("plan"))
    assert planners == ["k3ckpt.cli.plan", "k3ckpt.placement.planner", "k3ckpt.requant.plan"]
