"""Expert placement and NVMe expert-cache planning (numpy; numba only for the cache
simulators, loaded when a simulation runs).

Entry point: ``k3ckpt.shard.plan.make_plan(geometry, devices, loads, ...)`` returns a
``Plan`` (``to_json`` / ``from_json``).  Pieces:

* ``devices``: device catalog, device-set files and shorthands (``64xGB200``).
* ``loads``: load and trace files, validation.
* ``placement`` / ``packing``: the placement planner and its metrics.
* ``eplb``: DeepSeek's EPLB, our baseline.
* ``topology``: dispatch traffic and co-activation-aware GPU order.
* ``cache``: cache tiers and policy simulators.
* ``synthetic``: synthetic router statistics for tests and benchmarks.

Modules load on first use so that ``import k3ckpt.shard`` stays light.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "MoEGeometry": "plan",
    "Plan": "plan",
    "make_plan": "plan",
    "DeviceSet": "devices",
    "parse_devices": "devices",
    "load_device_set": "devices",
    "lookup_device": "devices",
    "Placement": "placement",
    "plan_placement": "placement",
    "read_loads": "loads",
    "read_trace": "loads",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
