"""Expert placement and NVMe expert-cache planning (numpy; numba only for the cache
simulators, loaded when a simulation runs).  ``k3ckpt.shard`` writes what it plans.

Entry point: ``k3ckpt.placement.planner.make_plan(geometry, devices, loads, ...)``
returns a ``Plan`` (``spec``: ``to_json`` / ``from_json``).  ``api.plan`` reaches it
from a checkpoint through ``inputs`` (geometry, devices, loads and trace, checked).
Pieces:

* ``spec``: the plan's data types (``MoEGeometry`` in, ``Plan`` out).
* ``planner``: mode choice, slot budget, reports.
* ``inputs`` / ``from_checkpoint``: the planner's inputs from a checkpoint and files.
* ``devices``: device catalog, device-set files and shorthands (``64xGB200``).
* ``loads``: load and trace files, validation.
* ``assign`` / ``packing``: the placement of experts on GPUs and its metrics.
* ``eplb``: DeepSeek's EPLB, our baseline.
* ``topology``: dispatch traffic and co-activation-aware GPU order.
* ``cache``: cache tiers and policy simulators.
* ``stages``: pipeline-parallel stages (vLLM's split of decoder layers).
* ``synthetic``: synthetic router statistics for tests and benchmarks.

Modules load on first use so that ``import k3ckpt.placement`` stays light.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "MoEGeometry": "spec",
    "Plan": "spec",
    "make_plan": "planner",
    "DeviceSet": "devices",
    "parse_devices": "devices",
    "load_device_set": "devices",
    "lookup_device": "devices",
    "Placement": "assign",
    "plan_placement": "assign",
    "read_loads": "loads",
    "read_trace": "loads",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
