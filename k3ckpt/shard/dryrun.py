"""``k3ckpt shard --dry-run``: what a run would write per rank, and whether it fits.

Reads headers only and writes nothing (not even DST): the same checks as a real run
(plan against checkpoint, ranks, moet identity and stages), then per rank the folder's
safetensors files and bytes, the packs and their bytes, and the free space of DST's
filesystem against the total (``io.writer.free_space_for``'s rule).  Linear in the
tensors and experts, so the full K3 (247,296 expert tensors) plans in seconds.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .materialize import LAYOUTS, RankWork, check_plan, default_ckpt_id, rank_work
from .pack_writers import PACK_NAME
from .packs import align_up
from ..placement.spec import Plan
from .source import SourceModel, read_source

__all__ = ["RankDryRun", "ShardDryRun", "shard_dry_run"]

HEADER_SLACK = 1 << 20   # per rank: safetensors headers, index, rank.json (as estimate_bytes)


@dataclass(frozen=True)
class RankDryRun:
    """One rank's share: ``shards`` safetensors files of ``tensor_bytes`` (``tensors``
    tensors, ``experts`` of them whole experts), ``packs`` pack files of ``pack_bytes``
    (moet packs are sparse: the bytes of their written rows)."""

    rank: int
    folder: str
    tensors: int
    experts: int
    shards: int
    tensor_bytes: int
    packs: tuple[str, ...]
    pack_records: int
    pack_bytes: int

    @property
    def bytes(self) -> int:
        return self.tensor_bytes + self.pack_bytes + HEADER_SLACK


@dataclass(frozen=True)
class ShardDryRun:
    """The whole run: ``total_bytes`` to write into ``dst``, whose filesystem has
    ``free_bytes`` free (``fits``: enough).  Nothing was written."""

    dst: str
    mode: str
    layout: str
    ranks: tuple[RankDryRun, ...]
    total_bytes: int
    free_bytes: int
    fits: bool

    @property
    def files(self) -> int:
        """Files the run would write: shards, index and rank.json per rank, packs and
        their sidecars, plan.json and the manifest."""
        return sum(r.shards + 2 + 2 * len(r.packs) for r in self.ranks) + 2


def _shard_count(sizes, max_shard_bytes: int) -> int:
    """Files ``ShardedWriter`` makes: a new shard when the next tensor would pass the limit."""
    n, size = 0, 0
    for s in sizes:
        if n == 0 or (size and size + s > max_shard_bytes):
            n, size = n + 1, 0
        size += s
    return max(n, 1)


def _rank(src: SourceModel, w: RankWork, layout: str, tp: int, ckpt_id: str, tag: str, zero_mode: str,
          G: int, max_shard_bytes: int) -> RankDryRun:
    names = list(src.spec_order(w.dense, w.experts))
    sizes = [src.nbytes(n) for n in names]
    packs: tuple[str, ...] = ()
    pack_bytes = 0
    if w.pack:
        if layout == "moet":
            from .moet_pack import PackIdentity, SlotGeometry

            g = SlotGeometry.for_expert(src.intermediate, src.hidden, tp)
            ident = PackIdentity(ckpt_id=ckpt_id, zero_mode=zero_mode, tag=tag, n_layers=src.num_hidden_layers + 1,
                                 E=src.experts, slot_bytes=g.slot_bytes, stride=g.stride)
            packs = tuple(f"moet-store/{ident.stem(t, tp, (w.rank, G) if G > 1 else None)}.pack" for t in range(tp))
            pack_bytes = tp * len(w.layers) * src.experts * g.stride
        else:
            packs = (f"{w.folder}/{PACK_NAME}",)   # a mixed-format source adds experts-1.pack, ...
            pack_bytes = sum(align_up(src.expert_size(k)) for k in w.pack)
    return RankDryRun(w.rank, w.folder, len(names), len(w.experts), _shard_count(sizes, max_shard_bytes), sum(sizes),
                      packs, len(w.pack), pack_bytes)


def _free(dst: Path) -> int:
    p = dst.absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def shard_dry_run(ckpt, plan: Plan, dst, *, layout: str = "k3ckpt", ranks=None, max_shard_bytes: int = 5_000_000_000,
                  ckpt_id: str | None = None, tag: str = "base", zero_mode: str = "auto", tp: int = 1) -> ShardDryRun:
    """What ``shard_checkpoint`` with these arguments would write; writes nothing.

    Raises what ``shard_checkpoint`` raises before writing (``UsageError``,
    ``UnsupportedError``), except ``DiskSpaceError``: ``fits`` says it instead."""
    if layout not in LAYOUTS:
        raise UsageError(f"layout must be one of {', '.join(LAYOUTS)}, found {layout!r}")
    if not isinstance(plan, Plan):
        raise UsageError("shard_dry_run needs a k3ckpt.placement.spec.Plan")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or (tp > 1 and layout != "moet"):
        raise UsageError(f"tp must be a positive integer, and above 1 only with layout 'moet'; found {tp!r}")
    src = read_source(ckpt, moet=layout == "moet", tp=tp)
    check_plan(src, plan, layout)
    works = rank_work(src, plan, ranks)
    cid = ckpt_id or default_ckpt_id(src)
    if layout == "moet":
        from .moet_pack import PackIdentity

        PackIdentity(slot_bytes=1, stride=4096, n_layers=1, E=1, ckpt_id=cid, tag=tag, zero_mode=zero_mode)
    G = plan.devices.num_gpus
    rows = tuple(_rank(src, w, layout, tp, cid, tag, zero_mode, G, max_shard_bytes) for w in works)
    total = sum(r.bytes for r in rows)
    free = _free(Path(dst))
    return ShardDryRun(str(dst), plan.mode, layout, rows, total, free, total <= free)
