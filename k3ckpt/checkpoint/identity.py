"""What makes a source that source, for the manifests that let a run resume."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["source_identity"]


def source_identity(ckpt) -> dict[str, Any]:
    """Shard names and sizes, tensor count, a hash of config.json, and for an ``hf://``
    source the repo and the commit it was pinned to (a resumed run reopens exactly it)."""
    config = json.dumps(ckpt.config, sort_keys=True) if ckpt.config is not None else None
    out: dict[str, Any] = {"shards": {s: ckpt.shard_size(s) for s in ckpt.shards}, "tensors": len(ckpt.tensors),
                           "config_sha256": hashlib.sha256(config.encode()).hexdigest() if config else None}
    out.update(ckpt.origin.identity())
    return out
