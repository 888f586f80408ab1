"""What ``k3ckpt shard`` needs to know about a source checkpoint, from headers alone.

Routed experts are grouped per (layer, expert) by the model profile; everything
else is "dense".  Layers are 0-indexed decoder layers, as in plan.json's
``layer_ids``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ..errors import ShapeError, UnsupportedError, UsageError
from ..formats import ids
from ..io.reader import Checkpoint
from ..profiles import detect
from ..profiles.roles import Role

__all__ = ["SourceModel", "mxfp4_pairs", "read_source"]

MXFP4_PAIR = ids.MXFP4_PACK
_FIRST_RANK_ROLES = (Role.EMBEDDING, Role.VISION)


@dataclass(frozen=True, eq=False)
class SourceModel:
    """Source facts for sharding.

    Attributes:
        storage: storage id of the routed experts (e.g. ``mxfp4-pack-quantized``).
        layers: MoE layers, ascending.  experts: routed experts per layer.
        expert_bytes: bytes of the largest expert (all its tensors); ``expert_size``
            gives each one (a mixed-format requant output has several sizes).
        num_hidden_layers: decoder layers (config), for the moet pack's ``n_layers``.
        intermediate, hidden: gate/up rows and their width (MXFP4 pair layout only, else 0).
        dense: every non-expert tensor, source order.
    """

    storage: str
    layers: tuple[int, ...]
    experts: int
    expert_bytes: int
    num_hidden_layers: int
    intermediate: int
    hidden: int
    dense: tuple[str, ...]
    _ckpt: Checkpoint = field(repr=False)
    _groups: dict = field(repr=False)          # (layer, expert) -> ((name, projection, part), ...) source order
    _parts: dict = field(repr=False)           # (layer, expert) -> {(projection, part): name}
    _index: dict = field(repr=False)           # name -> source position
    _where: dict = field(repr=False)           # dense name -> (layer | None, role)
    _sizes: dict = field(repr=False)           # (layer, expert) -> bytes of its tensors

    # -- experts ------------------------------------------------------------------
    def expert_entries(self, key) -> tuple[tuple[str, str, str], ...]:
        return self._groups[tuple(key)]

    def expert_size(self, key) -> int:
        return self._sizes[tuple(key)]

    @property
    def mixed(self) -> bool:
        """Experts differ in size (stored in more than one format)."""
        return any(n != self.expert_bytes for n in self._sizes.values())

    def bytes_table(self) -> np.ndarray:
        """``int64 [MoE layers, experts]`` bytes of every expert (as plan.json's ``per_expert_bytes``)."""
        from ..placement.from_checkpoint import expert_bytes_table

        return expert_bytes_table(self._sizes, self.layers, self.experts)

    def expert_name(self, key, part) -> str:
        """The source tensor of ``part`` (a ``PartSpec``: projection, part) for expert ``key``."""
        try:
            return self._parts[tuple(key)][(part.projection, part.part)]
        except KeyError:
            raise ShapeError(f"expert (layer {key[0]}, expert {key[1]}) has no {part.projection} {part.part} "
                             "tensor, unlike the pack's first expert") from None

    def mxfp4_names(self, key) -> tuple[str, ...]:
        """An MXFP4 pair-layout expert's gate, up and down tensors, packed then scale each."""
        p = self._parts[tuple(key)]
        return tuple(p[(proj, part)] for proj in ("gate", "up", "down") for part in ("packed", "scale"))

    def mxfp4_triple(self, key, arrays: dict):
        """((gate packed, scale), (up ...), (down ...)) of an MXFP4 pair-layout expert."""
        return mxfp4_pairs([arrays[n] for n in self.mxfp4_names(key)])

    def moet_slot_bytes(self) -> int:
        """Bytes of one expert in the runtime's 2.25 representation (TP 1)."""
        i, h = self.intermediate, self.hidden
        return 3 * i * h // 4 + 3 * i * h // 32

    # -- dense --------------------------------------------------------------------
    def nbytes(self, name: str) -> int:
        return self._ckpt.entry(name).nbytes

    def dense_for_stage(self, moe_layers, *, first: bool, last: bool, decoder=None) -> tuple[str, ...]:
        """Dense tensors of a pipeline stage running ``moe_layers``: its decoder layers
        ``decoder = (start, stop)`` as vLLM's partition gives them, or without it the
        layers after the previous stage's last MoE layer up to its own last one (all
        remaining ones on the last stage); embeddings and vision on the first stage,
        other non-layer tensors on the last."""
        moe_layers = list(moe_layers)
        if not moe_layers:
            return ()
        i = self.layers.index(moe_layers[0])
        lo = self.layers[i - 1] if i > 0 else -1
        hi = moe_layers[-1]
        out = []
        for name in self.dense:
            layer, role = self._where[name]
            if layer is None:
                keep = first if role in _FIRST_RANK_ROLES else last
            elif decoder is not None:
                keep = decoder[0] <= layer < decoder[1]
            else:
                keep = lo < layer <= hi or (last and layer > hi) or (first and layer <= lo)
            if keep:
                out.append(name)
        return tuple(out)

    # -- ordering -----------------------------------------------------------------
    def units(self) -> list[tuple[int, str, object]]:
        """``(source position, 'dense' | 'expert', name | key)`` in source order."""
        out = [(self._index[n], "dense", n) for n in self.dense]
        out += [(min(self._index[n] for n, _, _ in g), "expert", k) for k, g in self._groups.items()]
        out.sort(key=lambda t: t[0])
        return out

    def _layer_anchors(self) -> dict[int, int]:
        """Source position of each layer's first expert tensor, computed once: every rank
        asks (64 ranks over K3's 82,432 experts made it O(ranks x experts))."""
        anchor = self.__dict__.get("_anchors")
        if anchor is None:
            anchor = {}
            for (layer, _), g in self._groups.items():
                pos = min(self._index[n] for n, _, _ in g)
                anchor[layer] = min(anchor.get(layer, pos), pos)
            object.__setattr__(self, "_anchors", anchor)
        return anchor

    def spec_order(self, dense, experts) -> list[str]:
        """Tensor names of a rank in file order: source order, except that a layer's experts
        come together (where the layer's first expert tensor is) in the given order."""
        anchor = self._layer_anchors()
        rows = [(self._index[n], 0, 0, n) for n in dense]
        for i, key in enumerate(experts):
            for j, (n, _, _) in enumerate(self._groups[tuple(key)]):
                rows.append((anchor[key[0]], 1 + i, j, n))
        rows.sort(key=lambda t: t[:3])
        return [r[3] for r in rows]

    def identity(self) -> dict:
        """What a resumed run must find unchanged: tensor layout and shard sizes (not paths)."""
        h = hashlib.sha256()
        for name, e in self._ckpt.tensors.items():
            h.update(f"{name}\0{e.dtype}\0{list(e.shape)}\0{e.shard}\0{e.data_offset}\n".encode())
        return {"tensors": len(self._ckpt.tensors), "layout_sha256": h.hexdigest(),
                "shards": {s: self._ckpt.shard_size(s) for s in self._ckpt.shards}}


def mxfp4_pairs(arrays) -> tuple:
    """((gate packed, scale), (up ...), (down ...)) as uint8 from the six arrays of ``mxfp4_names``."""
    a = [x.view(np.uint8) for x in arrays]
    return (a[0], a[1]), (a[2], a[3]), (a[4], a[5])


def read_source(ckpt: Checkpoint, *, moet: bool = False, tp: int = 1) -> SourceModel:
    """Group the checkpoint's routed experts; with ``moet`` also check they are MXFP4 pairs
    of the runtime's shapes (gate/up ``[I, H]``, down ``[H, I]``; split ``tp`` ways)."""
    profile = detect(ckpt.config, ckpt.tensors.keys())
    roles = {n: profile.classify(n, e.dtype) for n, e in ckpt.tensors.items()}
    groups_raw: dict = {}   # as profiles.experts.expert_groups, without classifying twice
    for n, r in roles.items():
        if r.role is Role.ROUTED_EXPERT and r.layer is not None:
            groups_raw.setdefault((r.layer, r.expert), []).append(n)
    if not groups_raw:
        raise UnsupportedError("the checkpoint has no routed experts that k3ckpt recognises",
                               file=str(ckpt.root) if ckpt.root else None)
    if any(k[1] is None for k in groups_raw):
        raise UnsupportedError("fused all-expert tensors (gpt-oss style) cannot be split per expert by shard yet")
    index = {n: i for i, n in enumerate(ckpt.tensors)}
    groups, parts = {}, {}
    storages = set()
    for key, names in groups_raw.items():
        g = tuple((n, roles[n].projection or "", roles[n].part) for n in sorted(names, key=index.__getitem__))
        groups[key] = g
        parts[key] = {(proj, part): n for n, proj, part in g}
        if len(parts[key]) != len(g):
            raise UnsupportedError(f"expert (layer {key[0]}, expert {key[1]}) has two tensors of one part")
        storages.update(roles[n].storage for n in names)
    layers = tuple(sorted({k[0] for k in groups}))
    experts = {layer: sorted(e for (l2, e) in groups if l2 == layer) for layer in layers}
    E = len(experts[layers[0]])
    for layer in layers:
        if experts[layer] != list(range(E)):
            raise UnsupportedError(f"layer {layer} has experts {experts[layer][:3]}...; shard needs experts "
                                   f"0..{E - 1} in every MoE layer")
    sizes = {k: sum(ckpt.entry(n).nbytes for n, _, _ in g) for k, g in groups.items()}
    part_sets = {frozenset(p) for p in parts.values()}
    if len(part_sets) > 1:
        a, b = sorted(part_sets, key=sorted)[:2]
        raise UnsupportedError(f"experts differ in their parts ({sorted(a)} vs {sorted(b)}); shard needs the same "
                               "tensors in every expert")
    if len(set(sizes.values())) > 1:
        # a mixed-format requant output: its parts keep their names, so name the formats its config declares
        from ..checkpoint.qconfig import declared_groups

        storages.update(fid for fid, _ in declared_groups(ckpt.config))
    storage = sorted(storages)[0] if len(storages) == 1 else "+".join(sorted(storages))
    inter = hidden = 0
    fp = parts[(layers[0], 0)]
    if storage == MXFP4_PAIR and all((p, q) in fp for p in ("gate", "up", "down") for q in ("packed", "scale")):
        gs = ckpt.entry(fp[("gate", "packed")]).shape
        inter, hidden = gs[0], 2 * gs[1]
    if moet:
        _check_moet(ckpt, storage, groups, parts, inter, hidden, tp)
    cfg = ckpt.config or {}
    tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    nhl = tc.get("num_hidden_layers")
    if not isinstance(nhl, int) or nhl <= layers[-1]:
        nhl = layers[-1] + 1
    expert_names = {n for g in groups.values() for n, _, _ in g}
    dense = tuple(n for n in ckpt.tensors if n not in expert_names)
    where = {n: (roles[n].layer, roles[n].role) for n in dense}
    return SourceModel(storage, layers, E, max(sizes.values()), nhl, inter, hidden, dense, ckpt, groups, parts,
                       index, where, sizes)


def _check_moet(ckpt, storage, groups, parts, inter, hidden, tp) -> None:
    if storage != MXFP4_PAIR or not inter:
        from ..checkpoint.qconfig import declared_groups

        declared = sorted({fid for fid, _ in declared_groups(ckpt.config)})
        if declared and MXFP4_PAIR not in declared:
            # a k3ckpt requant output: the runtime builds its packs from the MXFP4 checkpoint
            # itself (it re-encodes MXFP4 codes, moet-pack.md), never from our 2-bit outputs
            raise UnsupportedError(
                f"layout 'moet' builds the runtime's NVMe packs from the MXFP4 ({MXFP4_PAIR}) checkpoint the runtime "
                f"also loads; this is a k3ckpt requant output ({', '.join(declared)} experts): pass the MXFP4 "
                f"checkpoint it was made from as SRC, or shard this one with --layout k3ckpt (on a plan made "
                f"from it)")
        raise UnsupportedError(f"layout 'moet' builds packs from MXFP4 ({MXFP4_PAIR}) experts with gate, up and down "
                               f"weight_packed/weight_scale tensors; this checkpoint's experts are {storage}: pass "
                               f"an MXFP4 checkpoint (Kimi K3 as published), or use --layout k3ckpt")
    from .moet_pack import SlotGeometry

    try:
        SlotGeometry.for_expert(inter, hidden, tp)
    except (ShapeError, UsageError) as exc:
        raise UnsupportedError(f"layout 'moet': expert shapes do not fit the runtime's planes ({exc.detail})") from None
    want = {"gate": ((inter, hidden // 2), (inter, hidden // 32)), "up": ((inter, hidden // 2), (inter, hidden // 32)),
            "down": ((hidden, inter // 2), (hidden, inter // 32))}
    for key, p in parts.items():
        for proj, (ps, ss) in want.items():
            for part, shape in (("packed", ps), ("scale", ss)):
                name = p.get((proj, part))
                if name is None or tuple(ckpt.entry(name).shape) != shape or ckpt.entry(name).dtype != "U8":
                    raise UnsupportedError(f"layout 'moet' needs {proj} {part} U8 {list(shape)} in every expert",
                                           tensor=name or f"layer {key[0]} expert {key[1]}")
        if len(groups[key]) != 6:
            raise UnsupportedError(f"layout 'moet': expert (layer {key[0]}, expert {key[1]}) has tensors beyond "
                                   "gate/up/down packed+scale (bias, global scale)")
