"""The expert packs one rank of a shard run writes (``shard.materialize``): its k3ckpt packs
(``K3Pack``; ``K3Packs`` when a mixed-format checkpoint needs one per record layout) or its
pipeline stage's moet packs (``MoetPack``, one per TP rank).  Each takes whole experts
(``put``), writes them in place through a ``PackBuilder`` and commits a layer once all its
experts are in; ``finish`` renames the pack and writes its JSON beside it.

On a Ray cluster (``shard.on_ray``) a pack is written a layer at a time by tasks instead:
``layer_jobs`` gives one ``on_ray.OutputJob`` per layer still to write, whose task reads the
layer's experts by path and writes their rows at their offsets of the ``.building`` file this
process created (``write_k3_layer``, ``write_moet_layer``: the same bytes as ``put``), and the
job's ``done`` commits the layer here, so a resumed run finds the layers as a local run leaves
them.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..errors import UsageError
from ..io.manifest import RunManifest
from ..io.reader import Checkpoint, TensorEntry, checkpoint_of_files
from ..io.writer import atomic_write_bytes, atomic_write_json, pwrite_all
from ..placement.spec import Plan
from .packs import ExpertPack, PackBuilder, PackRecord, align_up, name_template, record_parts, sha256_bytes
from .source import SourceModel, mxfp4_pairs

if TYPE_CHECKING:
    from .materialize import RankWork
    from .on_ray import OutputJob

__all__ = ["PACK_NAME", "MOET_DIR", "K3Pack", "K3Packs", "MoetPack", "k3_packs", "write_k3_layer",
           "write_moet_layer"]

PACK_NAME = "experts.pack"
MOET_DIR = "moet-store"
Locate = Callable[[str], TensorEntry]    # source tensor -> its entry, ``shard`` the file's path


@contextmanager
def _row_files(paths: dict):
    """The run's ``.building`` files by key, for ``write(key, offset, data)``; on a clean exit
    their rows are synced to the file's filesystem before the driver commits the layer."""
    fds: dict = {}
    try:
        for key, path in paths.items():
            fds[key] = os.open(path, os.O_WRONLY)
        yield lambda key, offset, data: pwrite_all(fds[key], memoryview(data).cast("B"), offset)
        for fd in fds.values():
            os.fdatasync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def _record(arrays) -> bytes:
    """A k3ckpt record: its parts' bytes back to back, in the pack's part order."""
    return b"".join(memoryview(a.reshape(-1).view(np.uint8)) for a in arrays)


def write_k3_layer(path: str, records: list[tuple[int, tuple[TensorEntry, ...]]]) -> list[str]:
    """Ray task: each record (its offset, its parts' entries in part order) read by path and
    written at its offset of the k3ckpt pack's ``.building`` file; returns their sha256s."""
    shas = []
    with checkpoint_of_files({e.name: e for _, parts in records for e in parts}) as src, \
            _row_files({0: path}) as write:
        for offset, parts in records:   # one record in memory at a time
            rec = _record([src.read_raw(e.name) for e in parts])
            shas.append(sha256_bytes(rec))
            write(0, offset, rec)
    return shas


def write_moet_layer(geom, tp: int, paths: dict[int, str], experts: list[tuple[int, tuple[TensorEntry, ...]]]) -> int:
    """Ray task: each expert (its row offset, its six MXFP4 entries in ``SourceModel.mxfp4_names``
    order) read by path, and its slot for each TP rank ``t`` of ``paths`` written at that offset
    of ``paths[t]``; returns the number of experts."""
    with checkpoint_of_files({e.name: e for _, es in experts for e in es}) as src, _row_files(paths) as write:
        for offset, entries in experts:   # one expert in memory at a time
            triple = mxfp4_pairs([src.read_raw(e.name) for e in entries])
            for t in paths:
                write(t, offset, _slot(geom, tp, t, triple))
    return len(experts)


def _slot(geom, tp: int, t: int, triple) -> np.ndarray:
    from .moet_pack import build_slot, tp_slice_expert

    return build_slot(geom, *tp_slice_expert(*triple, t, tp))


def k3_packs(src: SourceModel, ckpt: Checkpoint, work: RankWork, folder: Path, manifest: RunManifest):
    """The rank's k3ckpt packs: one per record layout (a mixed-format checkpoint has several),
    ``experts.pack`` for the layout of the rank's first expert, then ``experts-1.pack``, ...;
    each holds its experts in plan order."""
    groups: dict[tuple, list] = {}
    for key in work.pack:
        entries = [(n, ckpt.entry(n), proj, part) for n, proj, part in src.expert_entries(key)]
        layout = tuple((p.projection, p.part, p.dtype, p.shape) for p in record_parts(entries))
        groups.setdefault(layout, []).append(key)
    packs = [K3Pack(src, ckpt, work, tuple(keys), _pack_name(i), folder, manifest)
             for i, keys in enumerate(groups.values())]
    return packs[0] if len(packs) == 1 else K3Packs(packs)


def _pack_name(i: int) -> str:
    return PACK_NAME if i == 0 else PACK_NAME.replace(".pack", f"-{i}.pack")


class K3Pack:
    """One k3ckpt pack: the records of ``keys`` (one record layout), in that order."""

    def __init__(self, src: SourceModel, ckpt: Checkpoint, work: RankWork, keys: tuple, name: str, folder: Path,
                 manifest: RunManifest):
        first = src.expert_entries(keys[0])
        self.parts = record_parts([(n, ckpt.entry(n), proj, part) for n, proj, part in first])
        self.record_bytes = sum(p.nbytes for p in self.parts)
        self.stride = align_up(self.record_bytes)
        self.keys = keys
        self.index = {k: i for i, k in enumerate(keys)}
        self.work = work
        self.name = name
        layer0, e0 = keys[0]
        templates = [name_template([src.expert_name(keys[0], p)], layer0, e0) for p in self.parts]
        self.templates = None if any(t is None for t in templates) else tuple(templates)
        self.rel = f"{work.folder}/{name}"
        self.source_format = src.storage
        self.folder = folder
        self.done = manifest.done(self.rel) and manifest.done(self.rel + ".json")
        self.builder = None if self.done else PackBuilder(folder, name, len(keys) * self.stride, manifest,
                                                          f"pack:{self.rel}")
        self.sha: dict[tuple[int, int], str] = {}
        self.left = {layer: sum(1 for k in keys if k[0] == layer) for layer in work.layers}
        if self.builder is not None:
            for k in keys:  # layers finished by an earlier run: hash their records back
                if k[0] in self.builder.done_layers:
                    self.sha[k] = sha256_bytes(self.builder.pread(self.index[k] * self.stride, self.record_bytes))

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def needs(self, key) -> bool:
        return key in self.index and self.builder is not None and key[0] not in self.builder.done_layers

    def close(self) -> None:
        if self.builder is not None:
            self.builder.close()

    def bytes_to_write(self) -> int:
        if self.builder is None:
            return 0
        return sum(self.stride for k in self.keys if k[0] not in self.builder.done_layers) + (1 << 20)

    def _part_names(self, src: SourceModel, key, nbytes: Callable[[str], int]) -> list[str]:
        """``key``'s source tensors in part order; each must be its part's size (``nbytes(name)``)."""
        names = [src.expert_name(key, p) for p in self.parts]
        for p, name in zip(self.parts, names):
            if nbytes(name) != p.nbytes:
                raise UsageError(f"expert (layer {key[0]}, expert {key[1]}) differs in size from the first "
                                 f"expert of the pack", tensor=name)
        return names

    def put(self, src: SourceModel, key, arrays: dict) -> None:
        rec = _record([arrays[n] for n in self._part_names(src, key, lambda n: arrays[n].nbytes)])
        self.builder.pwrite(self.index[key] * self.stride, rec)
        self.sha[key] = sha256_bytes(rec)
        self._count(key[0])

    def layer_jobs(self, src: SourceModel, ckpt: Checkpoint, locate: Locate) -> list[OutputJob]:
        """A ``write_k3_layer`` job per layer still to write (module docstring)."""
        from .on_ray import TASK_BASE, OutputJob

        if self.builder is None:
            return []
        jobs = []
        for layer in self.work.layers:
            keys = [k for k in self.keys if k[0] == layer]
            if not keys or layer in self.builder.done_layers:
                continue
            records = [(self.index[k] * self.stride,
                        tuple(map(locate, self._part_names(src, k, lambda n: ckpt.entry(n).nbytes)))) for k in keys]
            # a record's parts as read, and the record joined from them
            jobs.append(OutputJob(write_k3_layer, (str(self.builder.tmp.absolute()), records),
                                  len(keys) * self.record_bytes, 2 * self.record_bytes + TASK_BASE,
                                  partial(self._layer_done, keys, layer)))
        return jobs

    def _layer_done(self, keys, layer: int, shas: list[str]) -> None:
        self.sha.update(zip(keys, shas))
        self.builder.commit_layer(layer)

    def _count(self, layer) -> None:
        self.left[layer] -= 1
        if self.left[layer] == 0:
            self.builder.commit_layer(layer)

    def finish(self, manifest: RunManifest) -> None:
        if self.builder is None:
            return
        self.builder.finish()
        manifest.record(self.rel)
        records = tuple(PackRecord(layer, e, self.index[(layer, e)] * self.stride, self.record_bytes,
                                   self.sha[(layer, e)]) for layer, e in self.keys)
        pack = ExpertPack(pack=self.name, rank=self.work.rank, source_format=self.source_format,
                          record_bytes=self.record_bytes,
                          stride=self.stride, file_size=len(records) * self.stride, parts=self.parts,
                          name_templates=self.templates, records=records)
        self.manifest_obj = pack
        atomic_write_json(self.folder / (self.name + ".json"), pack.to_dict(), indent=None, sort_keys=True)
        manifest.record(self.rel + ".json")


class K3Packs:
    """Several k3ckpt packs of one rank, one per record layout, used as one."""

    def __init__(self, packs: list[K3Pack]):
        self.packs = packs
        self.rel = packs[0].rel
        self.of = {k: p for p in packs for k in p.keys}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.packs)

    def needs(self, key) -> bool:
        p = self.of.get(key)
        return p is not None and p.needs(key)

    def put(self, src: SourceModel, key, arrays: dict) -> None:
        self.of[key].put(src, key, arrays)

    def layer_jobs(self, src: SourceModel, ckpt: Checkpoint, locate: Locate) -> list[OutputJob]:
        return [j for p in self.packs for j in p.layer_jobs(src, ckpt, locate)]

    def bytes_to_write(self) -> int:
        return sum(p.bytes_to_write() for p in self.packs)

    def close(self) -> None:
        for p in self.packs:
            p.close()

    def finish(self, manifest: RunManifest) -> None:
        for p in self.packs:
            p.finish(manifest)


class MoetPack:
    """A pipeline stage's moet packs: one per TP rank (``rank<t>of<tp>``), rows in lockstep."""

    def __init__(self, src: SourceModel, work: RankWork, root: Path, manifest: RunManifest, plan: Plan,
                 opts: dict):
        from .moet_pack import PackIdentity, SlotGeometry

        self.tp = opts["tp"]
        self.geom = SlotGeometry.for_expert(src.intermediate, src.hidden, self.tp)
        self.ident = PackIdentity(ckpt_id=opts["ckpt_id"], zero_mode=opts["zero_mode"], tag=opts["tag"],
                                  n_layers=src.num_hidden_layers + 1, E=src.experts,
                                  slot_bytes=self.geom.slot_bytes, stride=self.geom.stride)
        G = plan.devices.num_gpus
        self.stems = [self.ident.stem(t, self.tp, (work.rank, G) if G > 1 else None) for t in range(self.tp)]
        self.work = work
        self.folder = root / MOET_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rel = f"{MOET_DIR}/{self.stems[0]}.pack"
        # layer_key: creation ordinal among the stage's MoE layers (each PP stage restarts at 0)
        self.layer_key = {layer: i for i, layer in enumerate(work.layers)}
        self.builders = []
        for stem in self.stems:
            rel = f"{MOET_DIR}/{stem}"
            done = manifest.done(rel + ".pack") and manifest.done(rel + ".json")
            self.builders.append(None if done else PackBuilder(self.folder, stem + ".pack", self.ident.file_size,
                                                               manifest, f"pack:{rel}.pack"))
        self.builder = next((b for b in self.builders if b is not None), None)
        self.keys = set(work.pack)
        self.left = [{layer: src.experts for layer in work.layers} for _ in self.stems]

    def _todo(self, t: int, layer: int) -> bool:
        b = self.builders[t]
        return b is not None and layer not in b.done_layers

    def needs(self, key) -> bool:
        return key in self.keys and any(self._todo(t, key[0]) for t in range(self.tp))

    def bytes_to_write(self) -> int:
        rows = sum(1 for t in range(self.tp) for layer in self.work.layers if self._todo(t, layer))
        return rows * self.ident.E * self.ident.stride + (1 << 20)

    def put(self, src: SourceModel, key, arrays: dict) -> None:
        triple = src.mxfp4_triple(key, arrays)
        for t, b in enumerate(self.builders):
            if not self._todo(t, key[0]):
                continue
            b.pwrite(self.ident.row_offset(self.layer_key[key[0]], key[1]), _slot(self.geom, self.tp, t, triple))
            self.left[t][key[0]] -= 1
            if self.left[t][key[0]] == 0:
                b.commit_layer(key[0])

    def layer_jobs(self, src: SourceModel, ckpt: Checkpoint, locate: Locate) -> list[OutputJob]:
        """A ``write_moet_layer`` job per layer some TP rank's pack still lacks (module docstring)."""
        from .on_ray import TASK_BASE, OutputJob

        jobs = []
        for layer in self.work.layers:
            ts = [t for t in range(self.tp) if self._todo(t, layer)]
            if not ts:
                continue
            experts = [(self.ident.row_offset(self.layer_key[layer], e),
                        tuple(map(locate, src.mxfp4_names((layer, e))))) for e in range(src.experts)]
            paths = {t: str(self.builders[t].tmp.absolute()) for t in ts}
            # one expert's codes, its slots and the slot kernel's planes at a time
            jobs.append(OutputJob(write_moet_layer, (self.geom, self.tp, paths, experts),
                                  src.experts * src.expert_bytes, 16 * src.expert_bytes + TASK_BASE,
                                  partial(self._layer_done, ts, layer)))
        return jobs

    def _layer_done(self, ts: list[int], layer: int, _experts: int) -> None:
        for t in ts:
            self.builders[t].commit_layer(layer)

    def finish(self, manifest: RunManifest) -> None:
        for stem, b in zip(self.stems, self.builders):
            if b is None:
                continue
            b.finish()
            manifest.record(f"{MOET_DIR}/{stem}.pack")
            # the sidecar comes after the pack, as the runtime's own writer does it
            atomic_write_bytes(self.folder / f"{stem}.json", self.ident.sidecar_bytes(self.layer_key.values()))
            manifest.record(f"{MOET_DIR}/{stem}.json")

    def close(self) -> None:
        for b in self.builders:
            if b is not None:
                b.close()

    def describe(self) -> dict:
        g = self.geom
        return {"packs": [{"tp_rank": t, "pack": f"{MOET_DIR}/{stem}.pack", "sidecar": f"{MOET_DIR}/{stem}.json"}
                          for t, stem in enumerate(self.stems)],
                "tp": self.tp, "ckpt_id": self.ident.ckpt_id, "zero_mode": self.ident.zero_mode,
                "tag": self.ident.tag, "n_layers": self.ident.n_layers, "E": self.ident.E,
                "slot_bytes": self.ident.slot_bytes, "stride": self.ident.stride,
                "n13": g.n13, "k13": g.k13, "n2": g.n2, "k2": g.k2,
                "layer_keys": [[layer, k] for layer, k in self.layer_key.items()]}
