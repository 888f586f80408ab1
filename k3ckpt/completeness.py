"""Is a checkpoint whole?  What an incomplete one lacks, in one line each.

A numbered shard set with a gap is refused when it is opened
(``io.reader.check_numbered_set``).  Two more holes only the profile can see:
no tensors at all (an index with an empty ``weight_map``), and MoE layers
(as the config names them) whose routed experts are not in the headers.
Writers (requant, dequant, shard, plan) refuse such a checkpoint
(``require_complete``, called by ``api.open_source``); ``inspect`` reports the
same sentences as warnings and exits 2 with ``--strict`` (docs/inspect-json.md).
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidFileError


def empty_text(ckpt) -> str:
    where = "its index's weight_map is empty" if not ckpt.shards else "its shards hold none"
    return f"the checkpoint holds no tensors ({where})"


def missing_experts_text(layers, experts: int) -> str:
    shown = ", ".join(map(str, layers[:8])) + (" ..." if len(layers) > 8 else "")
    return (f"MoE layer(s) {shown} have no routed-expert tensors in the headers (the config expects {experts} "
            f"each): a shard or the experts are missing")


def layers_without_experts(ckpt, profile) -> list[int]:
    """MoE layers of the config with no routed-expert tensor in the headers, sorted."""
    from .profiles import Role

    g = profile.geometry
    if g is None or not g.experts or not g.moe_layers:
        return []
    names = list(ckpt.tensors.keys())
    if not names:
        return sorted(g.moe_layers)
    # the role of a name does not depend on its dtype: one placeholder dtype for all
    entries, which, layer, _ = profile.locate_many(names, np.zeros(len(names), dtype=np.int64), ["U8"])
    routed = np.array([e.role is Role.ROUTED_EXPERT for e in entries], dtype=bool)[which]
    have = set(np.unique(layer[routed & (layer >= 0)]).tolist()) if layer.dtype != object else \
        {v for v, r in zip(layer.tolist(), routed.tolist()) if r and v >= 0}
    return sorted(set(g.moe_layers) - have)


def problems(ckpt, profile=None) -> list[str]:
    """One sentence per thing ``ckpt`` lacks; [] for a whole checkpoint."""
    if len(ckpt.tensors) == 0:
        return [empty_text(ckpt)]
    if profile is None:
        from .profiles import detect

        profile = detect(ckpt.config, ckpt.tensors.keys())
    missing = layers_without_experts(ckpt, profile)
    return [missing_experts_text(missing, profile.geometry.experts)] if missing else []


def require_complete(ckpt, complete: bool = True):
    """``ckpt`` if it is whole (or ``complete`` is False); else closes it and raises
    ``InvalidFileError`` naming what is missing."""
    if not complete:
        return ckpt
    found = problems(ckpt)
    if found:
        ckpt.close()
        raise InvalidFileError(f"incomplete checkpoint: {found[0]}", file=str(ckpt.root or "") or None)
    return ckpt
