"""``k3ckpt shard --ray``: a run's output files written by tasks on a Ray cluster (docs/ray.md).

The driver (``materialize.shard_checkpoint``) checks the plan, lays out every rank's safetensors
shards (``ShardedWriter``), creates its packs' ``.building`` files and keeps the run manifest, as
a local run does.  Instead of streaming the source through its writers it then hands out tasks
(``raypool.RayPool``) of two kinds, the units the writer already commits and resumes by:

* a safetensors shard: ``write_shard_file`` reads the shard's tensors by path and writes the
  whole file (its header, then each tensor's bytes) under a hidden ``.partial`` name, renames it
  to its final name and returns its sha256; the driver checks its size and header
  (``ShardedWriter.adopt``) and records it;
* a pack layer (``pack_writers``): the task writes that layer's rows at their offsets of the pack
  file the driver created and returns the records' sha256s; the driver commits the layer.

No two tasks write the same bytes, so they need no order among them, and each writes the same
bytes every time it runs: a task Ray retries after losing its worker leaves the files as an
uninterrupted one does.  Tasks return digests, never data.  Sources and outputs are read and
written by path, so both must be on a filesystem every node sees.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from ..errors import UsageError
from ..io.reader import Checkpoint, TensorEntry, checkpoint_of_files
from ..io.writer import atomic_write_chunks

__all__ = ["OutputJob", "write_on_ray", "write_shard_file"]

_CHUNK = 64 << 20
TASK_BASE = 256 << 20      # a task's interpreter and libraries, declared to Ray beside its data


@dataclass(frozen=True)
class OutputJob:
    """A piece of the output for a task: ``run(*args)`` writes it and returns what ``done`` takes
    (``done`` runs here, in the driver, and records the piece); the task reads ``source_bytes``
    and may use ``memory`` (declared to Ray)."""

    run: Callable
    args: tuple
    source_bytes: int
    memory: int
    done: Callable


def write_shard_file(path: str, prefix: bytes, entries: tuple[TensorEntry, ...]) -> str:
    """Ray task: a safetensors shard whole, ``prefix`` (its header) and then each tensor's bytes
    read by path, written atomically under ``path`` (``io.writer.atomic_write_chunks``: a hidden
    partial file, fsync, rename); returns its sha256, computed as the bytes go out."""
    digest = hashlib.sha256()

    def hashed(pieces):
        for piece in pieces:
            digest.update(piece)
            yield piece

    with checkpoint_of_files({e.name: e for e in entries}) as src:
        data = (c for e in entries for c in src.iter_chunks(e.name, _CHUNK))
        atomic_write_chunks(path, hashed(itertools.chain((prefix,), data)))
    return digest.hexdigest()


def _locator(ckpt: Checkpoint) -> Callable[[str], TensorEntry]:
    """Source tensor -> its entry with ``shard`` the absolute path of its file (what a task opens)."""
    paths: dict[str, str] = {}

    def locate(name: str) -> TensorEntry:
        e = ckpt.entry(name)
        if e.shard not in paths:
            path = getattr(ckpt.source(e.shard), "path", None)
            if path is None:
                raise UsageError("--ray tasks read the source by path: give a checkpoint folder on a filesystem "
                                 "every node sees", file=str(ckpt.root or e.shard))
            paths[e.shard] = str(Path(path).absolute())
        return e._replace(shard=paths[e.shard])

    return locate


def _jobs(ckpt: Checkpoint, src, outs) -> list[OutputJob]:
    """Every shard file and pack layer of ``outs`` (``materialize._RankOut``) still to write, rank by rank."""
    locate = _locator(ckpt)
    jobs = []
    for o in outs:
        for name in o.writer.unwritten():
            prefix, tensors = o.writer.shard_layout(name)
            entries = tuple(map(locate, tensors))
            # a chunk as read, its copy to bytes, and the file's write buffer
            jobs.append(OutputJob(write_shard_file, (str(Path(o.writer.dst_dir, name).absolute()), prefix, entries),
                                  sum(e.nbytes for e in entries), 3 * _CHUNK + TASK_BASE,
                                  partial(o.writer.adopt, name)))
        if o.pack is not None:
            jobs += o.pack.layer_jobs(src, ckpt, locate)
    return jobs


def write_on_ray(ckpt: Checkpoint, src, outs, *, workers: int, progress: bool) -> list[dict]:
    """Write what ``outs`` still lack by tasks on the joined Ray cluster (module docstring), at most
    ``2 x workers`` in flight; returns the pool's per-node figures (``RayPool.stats``)."""
    from tqdm import tqdm

    from ..raypool import RayPool

    todo = deque(_jobs(ckpt, src, outs))
    pool = RayPool(spread=True)     # copying is bound by the filesystem links, not by the CPUs
    pending: list = []
    try:
        with tqdm(total=sum(j.source_bytes for j in todo), unit="B", unit_scale=True, desc="shard",
                  disable=not progress) as bar:
            while todo or pending:
                while todo and len(pending) < 2 * workers:
                    j = todo.popleft()
                    pending.append((j, pool.submit(j.run, *j.args, memory=j.memory, units=j.source_bytes)))
                # the first task to finish is recorded first; with none finished, wait for the oldest
                i = next((i for i, (_, f) in enumerate(pending) if f.done()), 0)
                j, future = pending.pop(i)
                j.done(future.result())
                bar.update(j.source_bytes)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return pool.stats()
