"""``k3ckpt shard``: a plan turned into per-rank files and NVMe expert packs.

``shard_checkpoint(ckpt, plan, dst)`` streams the source once, in source order,
one tensor (dense) or one expert (all its tensors) at a time, and writes every
output that needs it (docs/shard.md):

* placement plan: ``rank-NNNNN/`` holds the rank's experts (its slots, in slot
  order; a replica twice on one rank is written once) and every dense tensor,
  as safetensors with an index;
* cache plan: rank ``r`` runs MoE layers ``[b[r], b[r+1])``; ``rank-NNNNN/`` holds
  the dense tensors of its layers (non-layer tensors: embeddings and vision on
  the first rank, the rest on the last) plus its HBM-hot experts as safetensors,
  and an expert pack of every expert of its layers: ``experts.pack`` +
  ``experts.pack.json`` (layout ``k3ckpt``; one pack per record layout, ``experts-1.pack``
  and on, when a mixed-format checkpoint has several), or the runtime's own pack in
  ``moet-store/`` (layout ``moet``, one pipeline stage per rank);
* ``rank.json`` per rank (what it holds), ``plan.json`` (the plan used) and the
  run manifest ``k3ckpt-manifest.json`` (every final file's size and sha256).

Files appear under their final names only when complete; an interrupted run
resumes (``resume=True``) from the manifest: finished files are kept, packs
continue at their first unfinished layer.  With ``ray`` the same files are
written by tasks on a Ray cluster, a safetensors shard or a pack layer each
(``shard.on_ray``); the manifest, indexes and JSON stay here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..formats import ids
from ..io.manifest import RunManifest
from ..io.reader import Checkpoint
from ..io.writer import ShardedWriter, TensorSpec, atomic_write_json, free_space_for, is_fresh_output
from .pack_writers import PACK_NAME, K3Packs, MoetPack, k3_packs
from .packs import align_up
from ..placement.spec import Plan
from .source import SourceModel, read_source

__all__ = ["LAYOUTS", "RankSummary", "ShardResult", "RankWork", "rank_work", "shard_checkpoint"]

LAYOUTS = ("k3ckpt", "moet")
JOB = "shard"
RANK_FILE = "rank.json"
PLAN_FILE = "plan.json"
_CHUNK = 64 << 20


@dataclass(frozen=True)
class RankWork:
    """What one rank receives.  ``experts`` are written as safetensors (placement: its
    slots; cache: the HBM tier), in this order; ``pack`` lists ``(layer, expert)`` of
    its NVMe pack in record order (cache plans only)."""

    rank: int
    folder: str
    dense: tuple[str, ...]
    experts: tuple[tuple[int, int], ...]
    layers: tuple[int, ...]                      # MoE layers (model numbers) the rank runs
    slots: tuple[tuple[int, ...], ...] = ()      # placement: per layer row, the rank's slot ids
    slot_experts: tuple[tuple[int, ...], ...] = ()
    pack: tuple[tuple[int, int], ...] = ()
    host: tuple[tuple[int, int], ...] = ()       # cache: the host-RAM tier, hottest first


@dataclass(frozen=True)
class RankSummary:
    rank: int
    folder: str
    tensors: int
    experts: int
    pack: str | None
    pack_records: int
    more_packs: int = 0   # k3ckpt packs beside ``pack`` (one per further record layout)


@dataclass(frozen=True)
class ShardResult:
    dst: str
    mode: str
    layout: str
    ranks: tuple[RankSummary, ...]
    files: tuple[str, ...]
    files_resumed: int
    bytes_written: int
    hub: Any = field(default=None, compare=False)   # an hf:// source: hub.convert.HubRun (set by api.shard)
    cluster: dict | None = field(default=None, compare=False)   # --ray: address, workers, per-node figures

    def to_dict(self) -> dict:
        out = asdict(replace(self, hub=None))
        del out["hub"], out["cluster"]
        if self.hub is not None:
            out["hub"] = self.hub.facts()
        if self.cluster is not None:
            out["ray"] = self.cluster
        return out


# --------------------------------------------------------------------------- plan -> work
def check_plan(src: SourceModel, plan: Plan, layout: str) -> None:
    """The plan must describe this checkpoint's experts in this layout's bytes."""
    m = plan.model
    if tuple(m.layer_ids) != src.layers or m.experts != src.experts:
        raise UsageError(
            f"the plan is for another model: {m.moe_layers} MoE layers {_span(m.layer_ids)} x {m.experts} experts "
            f"({m.model_id or 'unnamed'}); the checkpoint has {len(src.layers)} MoE layers {_span(src.layers)} x "
            f"{src.experts} experts")
    if m.mixed or src.mixed:
        # experts of several sizes: only a plan of every expert's stored bytes fits
        if plan.format_id != "stored" or not np.array_equal(m.bytes_table(), src.bytes_table()):
            raise UsageError(f"the plan counts {_sizes(m.bytes_table())} per expert ({plan.format_id}); this "
                             f"checkpoint's experts take {_sizes(src.bytes_table())}: plan this checkpoint with "
                             "--format stored")
    want = {src.storage: src.expert_bytes, "stored": src.expert_bytes}
    if layout == "moet":
        want[ids.MOET_W2] = src.moet_slot_bytes()
    if plan.format_id not in want:
        raise UsageError(f"the plan is for format {plan.format_id!r}; layout {layout!r} of this checkpoint writes "
                         f"{' or '.join(repr(k) for k in want)}")
    if not src.mixed and m.expert_bytes != want[plan.format_id]:
        raise UsageError(f"the plan counts {m.expert_bytes:,} bytes per {plan.format_id} expert; this checkpoint's "
                         f"experts take {want[plan.format_id]:,}")
    if layout == "moet" and plan.mode != "cache":
        raise UsageError("layout 'moet' writes NVMe packs, which only cache plans have (the runtime refuses EP/EPLB "
                         "placements); use layout 'k3ckpt' for a placement plan")
    if plan.mode == "cache":
        from ..placement.stages import check_stages

        check_stages(src.layers, src.num_hidden_layers, plan, layout)


def _sizes(table: np.ndarray) -> str:
    lo, hi = int(table.min()), int(table.max())
    return f"{lo:,} bytes each" if lo == hi else f"{lo:,}-{hi:,} bytes ({int(table.sum()):,} in all)"


def _span(ids) -> str:
    ids = list(ids)
    return f"[{ids[0]}..{ids[-1]}]" if ids else "[]"


def rank_work(src: SourceModel, plan: Plan, ranks=None) -> list[RankWork]:
    """Per-rank work from the plan (``ranks``: a subset of rank ids, default all)."""
    G = plan.devices.num_gpus
    if ranks is None:
        ranks = range(G)
    ranks = sorted({int(r) for r in ranks})
    bad = [r for r in ranks if not 0 <= r < G]
    if bad:
        raise UsageError(f"rank {bad[0]} does not exist: the plan has ranks 0..{G - 1}")
    if not ranks:
        raise UsageError("no ranks to write")
    layers = src.layers
    out = []
    if plan.mode == "placement":
        pl = plan.placement
        for r in ranks:
            slots = np.flatnonzero(pl.slot2gpu == r)
            experts, seen = [], set()
            for row, layer in enumerate(layers):
                for e in pl.phy2log[row, slots]:
                    if (layer, int(e)) not in seen:
                        seen.add((layer, int(e)))
                        experts.append((layer, int(e)))
            out.append(RankWork(r, f"rank-{r:05d}", src.dense, tuple(experts), layers,
                                tuple(tuple(int(s) for s in slots) for _ in layers),
                                tuple(tuple(int(e) for e in pl.phy2log[row, slots]) for row in range(len(layers)))))
        return out
    c = plan.cache
    b = c.layer_bounds
    from ..placement.stages import stage_ranges

    stages = stage_ranges(src.num_hidden_layers, plan)
    for r in ranks:
        mine = layers[int(b[r]): int(b[r + 1])]
        pre = c.preload[c.preload[:, 0] == r]
        hbm = [(layers[int(x[2])], int(x[3])) for x in pre if x[1] == 0]
        host = [(layers[int(x[2])], int(x[3])) for x in pre if x[1] == 1]
        rank_of = {k: i for i, k in enumerate(hbm + host)}
        pack = []
        for layer in mine:  # plan order: HBM tier, host tier (hottest first), then the rest by id
            keys = [(layer, e) for e in range(src.experts)]
            pack.extend(sorted(keys, key=lambda k: (rank_of.get(k, len(rank_of)), k[1])))
        dense = src.dense_for_stage(mine, first=r == 0, last=r == G - 1, decoder=stages[r] if stages else None)
        out.append(RankWork(r, f"rank-{r:05d}", dense,
                            tuple(hbm), tuple(mine), pack=tuple(pack), host=tuple(host)))
    return out


# --------------------------------------------------------------------------- outputs
class _RankOut:
    """One rank's writers: its safetensors and (cache plans) its pack."""

    def __init__(self, src: SourceModel, ckpt: Checkpoint, work: RankWork, root: Path, manifest: RunManifest,
                 layout: str, plan: Plan, moet_opts: dict, max_shard_bytes: int):
        self.work = work
        self.folder = root / work.folder
        self.manifest = manifest
        order = src.spec_order(work.dense, work.experts)
        self.specs = [TensorSpec(n, ckpt.entry(n).dtype, ckpt.entry(n).shape) for n in order]
        self.tensor_set = set(order)
        self.expert_set = set(work.experts)
        prefix = work.folder + "/"
        done = [n[len(prefix):] for n in manifest.records if n.startswith(prefix) and manifest.done(n)]
        self.writer = ShardedWriter(self.folder, self.specs, max_shard_bytes=max_shard_bytes, write_index=True,
                                    overwrite=True, check_free_space=False, done_shards=[
                                        d for d in done if d.endswith(".safetensors")],
                                    hash_shards=True, on_shard_final=lambda p: manifest.record(
                                        f"{work.folder}/{p.name}", sha256=self.writer.sha256[p.name]))
        self.pack = None
        self.layout = layout
        if work.pack:
            self.pack = MoetPack(src, work, root, manifest, plan, moet_opts) if layout == "moet" else \
                k3_packs(src, ckpt, work, self.folder, manifest)

    def bytes_to_write(self) -> int:
        st = sum(s.nbytes for s in self.specs if self.writer.needs(s.name)) + (1 << 20)
        return st + (self.pack.bytes_to_write() if self.pack else 0)


# --------------------------------------------------------------------------- the job
def estimate_bytes(src: SourceModel, works: list[RankWork], layout: str, tp: int = 1) -> int:
    """Bytes a fresh run writes (safetensors data + 1 MiB of headers and JSON per rank, packs;
    moet packs are sparse, so only their written rows count)."""
    total = 0
    for w in works:
        total += sum(src.nbytes(n) for n in w.dense) + sum(map(src.expert_size, w.experts)) + (1 << 20)
        if w.pack:
            if layout == "moet":
                from .moet_pack import SlotGeometry

                g = SlotGeometry.for_expert(src.intermediate, src.hidden, tp)
                total += tp * len(w.layers) * src.experts * g.stride
            else:
                total += sum(align_up(src.expert_size(k)) for k in w.pack)
    return total


def default_ckpt_id(src: SourceModel) -> str:
    """A stable id for the runtime's ``VLLM_MOE_W2_CKPT_ID`` (the runtime's own default is not
    reproducible off-box; MOET.md section 6): 'k3ckpt-' + 16 hex digits of the source identity."""
    return "k3ckpt-" + src.identity()["layout_sha256"][:16]


def shard_checkpoint(ckpt: Checkpoint, plan: Plan, dst, *, layout: str = "k3ckpt", resume: bool = False,
                     progress: bool = True, ranks=None, max_shard_bytes: int = 5_000_000_000,
                     ckpt_id: str | None = None, tag: str = "base", zero_mode: str = "auto",
                     tp: int = 1, ray: str | None = None) -> ShardResult:
    """Write ``dst`` from ``ckpt`` as ``plan`` says (module docstring; docs/shard.md).

    Args:
        layout: ``k3ckpt`` (packs of verbatim source records) or ``moet`` (the vLLM-Moet
            runtime's 2.25-bpw pack; cache plans from MXFP4 checkpoints).
        resume: continue an interrupted run in ``dst`` (same plan, options and source).
        ranks: write only these ranks (default all), e.g. one node's share.
        ckpt_id, tag, zero_mode: the moet pack's identity (``ckpt_id`` default:
            ``default_ckpt_id``; pass the same string to the runtime as
            ``VLLM_MOE_W2_CKPT_ID``).
        tp: moet: tensor-parallel ranks per pipeline stage; each plan rank gets one pack
            per TP rank (``rank<t>of<tp>``) holding its 1/tp of every expert.
        ray: a Ray cluster (``HOST:PORT`` or ``auto``) whose tasks write the shard files and pack
            layers (``shard.on_ray``); the source and ``dst`` must be paths every node sees.  The
            bytes are those of a local run; ``result.cluster`` has per-node figures.

    Raises:
        UsageError: a plan for another model or format, unknown ranks, bad options.
        DiskSpaceError: ``dst``'s filesystem has less free space than the output needs.
        OutputExistsError / ResumeMismatchError: ``dst`` holds something else.
    """
    if layout not in LAYOUTS:
        raise UsageError(f"layout must be one of {', '.join(LAYOUTS)}, found {layout!r}")
    if not isinstance(plan, Plan):
        raise UsageError("shard_checkpoint needs a k3ckpt.placement.spec.Plan")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or (tp > 1 and layout != "moet"):
        raise UsageError(f"tp must be a positive integer, and above 1 only with layout 'moet'; found {tp!r}")
    src = read_source(ckpt, moet=layout == "moet", tp=tp)
    check_plan(src, plan, layout)
    works = rank_work(src, plan, ranks)
    moet_opts = {}
    if layout == "moet":
        from .moet_pack import PackIdentity

        moet_opts = {"ckpt_id": ckpt_id or default_ckpt_id(src), "tag": tag, "zero_mode": zero_mode}
        PackIdentity(slot_bytes=1, stride=4096, n_layers=1, E=1, **moet_opts)  # validate before any write
        moet_opts["tp"] = tp
    workers = None
    if ray is not None:   # before anything is written: a cluster that cannot be reached is one line
        from ..raypool import join

        workers = join(ray, None)
    dst = Path(dst)
    plan_json = plan.to_json()
    options = {"layout": layout, "plan_sha256": hashlib.sha256(plan_json.encode()).hexdigest(),
               "ranks": [w.rank for w in works], "max_shard_bytes": max_shard_bytes, **moet_opts}
    if is_fresh_output(dst, resume):   # refuse a full disk before creating anything
        free_space_for(dst, estimate_bytes(src, works, layout, tp))
    identity = {**src.identity(), **ckpt.origin.identity()}   # an hf:// source: pinned to its commit
    manifest = RunManifest.begin(dst, job=JOB, options=options, source=identity, resume=resume)
    resumed = len(manifest.records)
    outs: list[_RankOut] = []
    try:
        for w in works:
            outs.append(_RankOut(src, ckpt, w, dst, manifest, layout, plan, moet_opts, max_shard_bytes))
        free_space_for(dst, sum(o.bytes_to_write() for o in outs))
        cluster = None
        if ray is None:
            _stream(src, ckpt, outs, progress)
        else:
            from .on_ray import write_on_ray

            cluster = {"address": ray, "workers": workers,
                       "nodes": write_on_ray(ckpt, src, outs, workers=workers, progress=progress)}
        for o in outs:
            o.writer.close()
            manifest.record(f"{o.work.folder}/{o.writer.index_path.name}")
            if o.pack is not None:
                o.pack.finish(manifest)
    except BaseException:
        for o in outs:
            o.writer.abort()
            if o.pack is not None:
                o.pack.close()
        raise
    for o in outs:
        atomic_write_json(o.folder / RANK_FILE, _rank_json(src, plan, layout, o), indent=1, sort_keys=True)
        manifest.record(f"{o.work.folder}/{RANK_FILE}")
    atomic_write_json(dst / PLAN_FILE, json.loads(plan_json), indent=1, sort_keys=True)
    manifest.record(PLAN_FILE)
    files = sorted(manifest.records)
    written = sum(manifest.records[n].size for n in files)
    summaries = tuple(RankSummary(o.work.rank, o.work.folder, len(o.specs), len(o.work.experts),
                                  None if o.pack is None else o.pack.rel, len(o.work.pack),
                                  len(o.pack.packs) - 1 if isinstance(o.pack, K3Packs) else 0) for o in outs)
    manifest.finish(ranks=[o.work.rank for o in outs], files=len(files), bytes=written)
    return ShardResult(str(dst), plan.mode, layout, summaries, tuple(files), resumed, written, cluster=cluster)


def _stream(src: SourceModel, ckpt: Checkpoint, outs: list[_RankOut], progress: bool) -> None:
    """The source read once, in source order, into every rank's writers that need each piece."""
    from tqdm import tqdm

    units = _units(src, outs)
    with tqdm(total=sum(n for _, _, n in units), unit="B", unit_scale=True, desc="shard",
              disable=not progress) as bar:
        for kind, what, nbytes in units:
            if kind == "dense":
                _copy_dense(ckpt, what, [o.writer for o in outs if what in o.tensor_set and o.writer.needs(what)])
            else:
                _copy_expert(src, ckpt, what, outs)
            bar.update(nbytes)


def _units(src: SourceModel, outs: list[_RankOut]) -> list[tuple[str, object, int]]:
    """Dense tensors and experts somebody still needs, in source order, with their bytes."""
    units = []
    for _pos, kind, what in src.units():
        if kind == "dense":
            if any(what in o.tensor_set and o.writer.needs(what) for o in outs):
                units.append((kind, what, src.nbytes(what)))
        elif any(_wants(src, o, what) for o in outs):
            units.append((kind, what, src.expert_size(what)))
    return units


def _wants(src: SourceModel, o: _RankOut, key) -> bool:
    if key in o.expert_set and any(o.writer.needs(n) for n, _, _ in src.expert_entries(key)):
        return True
    return o.pack is not None and o.pack.needs(key)


def _copy_dense(ckpt: Checkpoint, name: str, writers: list[ShardedWriter]) -> None:
    if not writers:
        return
    pos = 0
    for chunk in ckpt.iter_chunks(name, _CHUNK):
        for w in writers:
            w.write_chunk(name, pos, chunk)
        pos += len(chunk)
    if pos == 0:  # empty tensors complete with an empty write
        for w in writers:
            w.write_chunk(name, 0, b"")


def _copy_expert(src: SourceModel, ckpt: Checkpoint, key, outs: list[_RankOut]) -> None:
    names = [n for n, _, _ in src.expert_entries(key)]
    arrays = {n: ckpt.read_raw(n) for n in names}   # one expert in memory at a time
    for o in outs:
        for n in names:
            if n in o.tensor_set and o.writer.needs(n):
                o.writer.write(n, np.ascontiguousarray(arrays[n]))
        if o.pack is not None and o.pack.needs(key):
            o.pack.put(src, key, arrays)


def _rank_json(src: SourceModel, plan: Plan, layout: str, o: _RankOut) -> dict:
    w = o.work
    d = {"kind": "k3ckpt-rank", "version": 1, "rank": w.rank, "num_ranks": plan.devices.num_gpus,
         "mode": plan.mode, "layout": layout, "source_format": src.storage, "moe_layers": list(w.layers),
         "index": o.writer.index_path.name, "dense_tensors": len(w.dense),
         "experts": [list(k) for k in w.experts]}
    if plan.mode == "placement":
        d["slots"] = list(w.slots[0]) if w.slots else []
        d["slot_experts"] = [list(x) for x in w.slot_experts]
    else:
        d["hbm"] = [list(k) for k in w.experts]
        d["host"] = [list(k) for k in w.host]
        if layout == "moet":
            d["moet"] = o.pack.describe()
        else:
            d["pack"] = PACK_NAME
            d["pack_manifest"] = PACK_NAME + ".json"
            if len(o.pack.names) > 1:   # experts of several record layouts: one pack each
                d["packs"] = [{"pack": n, "pack_manifest": n + ".json"} for n in o.pack.names]
    return d
