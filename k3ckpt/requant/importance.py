"""An importance matrix bound to a run (``--imatrix``): which entry and row each weight reads.

llama.cpp's ``llama-imatrix`` names its entries after the GGUF tensors its converter writes:
the routed experts of layer L are one stacked tensor per projection,
``blk.L.ffn_{gate,up,down}_exps.weight``, and expert E is row E of that entry (K3's
``layers.L.block_sparse_moe.experts.E.w1`` reads ``blk.L.ffn_gate_exps.weight`` row E; the
same for Kimi K2 / DeepSeek-V3 and gpt-oss).  A fused gate_up weight (gpt-oss) reads the gate
entry: gate and up take the same input, so llama.cpp records the same activations for both.

``Importance.columns(w)`` gives one weight's importance per input column, float32 ``[K]``, read
from the file when asked (one row, never the entry); None for a weight the file has no entry
for, which is then encoded and measured with all-ones weights, and listed in the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..errors import UsageError
from ..imatrix import Imatrix, read_imatrix

__all__ = ["Importance", "entry_name", "load_gguf_importance", "load_importance"]

# a weight's projection (profiles' TensorRole.projection) -> the GGUF tensor llama-imatrix names
_EXPERT_ENTRY = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps", "gate_up": "ffn_gate_exps"}


def entry_name(layer: int | None, expert: int | None, projection: str | None) -> str | None:
    """The importance entry of a routed expert weight, or None for any other weight."""
    if layer is None or expert is None or projection not in _EXPERT_ENTRY:
        return None
    return f"blk.{layer}.{_EXPERT_ENTRY[projection]}.weight"


@dataclass(frozen=True)
class Importance:
    """An ``Imatrix`` and the weights of one run it covers (``missing``: those it has no entry for)."""

    imatrix: Imatrix
    missing: tuple[str, ...] = ()

    def columns(self, w) -> np.ndarray | None:
        """float32 ``[K]`` for planned weight ``w`` (``layer`` / ``expert`` / ``projection`` /
        ``shape``), or None when the file has no entry for it."""
        name = entry_name(w.layer, w.expert, w.projection)
        if name is None or name not in self.imatrix:
            return None
        return self.imatrix.columns(name, int(w.shape[-1]), w.expert)

    def row(self, name: str, k: int, expert: int) -> np.ndarray | None:
        """float32 ``[k]``: expert ``expert`` of the entry named ``name`` (a GGUF tensor name, as
        llama-imatrix names entries), or None when the file has no such entry."""
        return self.imatrix.columns(name, k, expert) if name in self.imatrix else None

    def identity(self) -> dict:
        """What a resume checks: the file's name and size (an imatrix of K3 is several GB, so it
        is not hashed)."""
        from pathlib import Path

        p = Path(self.imatrix.path)
        return {"name": p.name, "bytes": p.stat().st_size}

    def describe(self) -> dict:
        """What the report says about it: the file, what it was computed on, which weights it missed."""
        m = self.imatrix
        return {"file": m.path, "kind": m.kind, "datasets": list(m.datasets), "chunk_count": m.chunk_count,
                "chunk_size": m.chunk_size, "entries": len(m), "weights_without_entry": len(self.missing),
                "without_entry": list(self.missing[:20])}


def load_importance(path, weights: Iterable) -> Importance:
    """Read importance-matrix ``path`` and bind it to ``weights`` (planned weights, or anything
    with ``name`` / ``layer`` / ``expert`` / ``projection`` / ``shape``).

    Checked here, before anything is written, from the file's index alone: each entry a weight
    reads has rows of that weight's K and a row for its expert.  Raises ``UsageError`` when the
    file names none of the weights (one line, with an entry it does hold and a name it expected)
    or does not fit one; ``NotFoundError`` / ``InvalidFileError`` from ``read_imatrix``."""
    return _bind(path, ((w.name, entry_name(w.layer, w.expert, w.projection), int(w.shape[-1]),
                         (w.expert or 0) + 1) for w in weights), "weight")


def load_gguf_importance(path, tensors: Iterable[tuple[str, int, int]]) -> Importance:
    """``load_importance`` for a GGUF run: ``tensors`` are its stacked expert tensors as
    ``(GGUF name, experts, K)``, which are llama-imatrix's entry names as they are."""
    return _bind(path, ((name, name, k, experts) for name, experts, k in tensors), "tensor")


def _bind(path, uses, what: str) -> Importance:
    """``uses``: ``(label, entry name or None, K, experts it needs)`` per weight or tensor."""
    m = read_imatrix(path)
    missing: list[str] = []
    expected = None
    used = 0
    matrices: dict[tuple[str, int], int] = {}
    for label, name, k, need in uses:
        if name is None or name not in m:
            missing.append(label)
            expected = expected or name
            continue
        n = matrices.get((name, k))
        if n is None:
            n = matrices[(name, k)] = m.matrices(name, k)
        if n < need:
            raise UsageError(f"importance entry {name!r} holds {n} matrices of {k}, {label} needs {need}: "
                             "an importance matrix of another model?", file=m.path)
        used += 1
    if used == 0:
        some = m.names[0] if len(m) else "none"
        want = f"; expected names like {expected!r}" if expected else ""
        raise UsageError(f"the importance matrix names no {what} this run encodes (it holds {len(m)} entries, "
                         f"e.g. {some!r}{want})", file=m.path)
    return Importance(m, tuple(missing))
