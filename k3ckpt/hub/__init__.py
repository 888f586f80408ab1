"""``hf://`` sources: Hugging Face Hub checkpoints read by range requests.

``parse_hub_url`` / ``is_hub_url`` / ``HubUrl`` are light.  Everything that
talks to the Hub (``open_hub_checkpoint``, ``resolve_checkpoint``,
``HubClient``, ``open_staged``, ``requant_from_hub``, ``push_output``, ...) loads
huggingface_hub on first use, so importing
``k3ckpt.hub`` costs nothing on the CLI's ``--help`` path.  See ``docs/hub.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .url import EXPECTED, HubUrl, is_hub_url, parse_hub_url

_LAZY = {
    "open_hub_checkpoint": "remote",
    "resolve_checkpoint": "remote",
    "HubSource": "remote",
    "HubCheckpointFiles": "remote",
    "RemoteFile": "remote",
    "HubClient": "client",
    "HubFile": "client",
    "RetryPolicy": "client",
    "TransferStats": "client",
    "open_staged": "staged",
    "StagedCheckpoint": "staged",
    "requant_from_hub": "convert",
    "shard_from_hub": "convert",
    "push_output": "push",
    "model_card": "card",
}

__all__ = ["EXPECTED", "HubUrl", "is_hub_url", "parse_hub_url", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
