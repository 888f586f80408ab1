"""Routed experts produced by worker processes while the parent writes them in order.

Encoding an expert (IQ2_XS from MXFP4 codes: about 2 s of one core for a K3
expert) is what a GGUF run spends its time on; everything else is copying.
``ExpertRunner`` hands experts to a process pool (``requant._stream.pool_context``:
a fork server or spawn, never a fork of the parent) and gives their bytes back
in submission order, so the file is the same for any worker count.  At most
``2 x workers`` experts are in flight (a few MB each once encoded; a worker
holds one expert's decoded floats, about 270 MB for K3's largest), and the
parent submits only within one run of consecutive expert tensors, so it never
holds more than that window.

A task names where its source tensors lie (``SourceFiles``: the shard file's
path and the tensor's offset, for a staged ``hf://`` source the staged copy's
path) and the worker opens the files itself; only a source without local files
(an unstaged remote checkpoint) has its arrays read by the parent and sent.  So has a staged
``hf://`` source on Ray: its staged shards are the driver's (the staging window downloads and
releases them as the driver moves on, and another node need not see the staging folder), so
the weights travel to the tasks as Ray objects, as requant's do.
"""

from __future__ import annotations

import math
import os
from collections import deque
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace

from ..errors import WorkerLostError
from . import container as C
from .tensors import Planned, Recipe


def one_expert(p: Planned, e: int) -> Planned:
    """Expert ``e`` of stacked expert tensor ``p`` as a plan of its own (one expert, ``[1, rows, K]``):
    ``produce.expert_piece(.., 0)`` of it is exactly that expert's piece of ``p``."""
    r = p.recipe
    info = C.TensorInfo(p.info.name, p.info.ggml_type, (1,) + tuple(p.info.shape[1:]))
    if r.rows:          # gpt-oss: every expert in one fused tensor, so the piece is expert e of it
        return replace(p, info=info, recipe=replace(r, arg=1, first=r.first + e))
    per = len(r.sources) // r.arg
    return replace(p, info=info, recipe=Recipe("experts", r.sources[e * per:(e + 1) * per], 1))


class SourceFiles:
    """Where a worker process reads source tensors, staging ``hf://`` shards on the way.

    ``staged``: shards come and go (``hub.staged.ShardWindow``), so the runner must not stage a
    new shard while workers still read others (staging may release them to stay in budget)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.window = getattr(ckpt, "staging", None)
        self.staged = self.window is not None

    def shards(self, names) -> set[str]:
        return {self.ckpt.tensors[n].shard for n in names}

    def locate(self, names) -> dict | None:
        """name -> TensorEntry whose ``shard`` is the file's path; None when a source has no local file."""
        from ..io.reader import LocalFile

        out = {}
        for n in names:
            e = self.ckpt.tensors[n]
            f = self.window.local(e.shard) if self.staged else self.ckpt.source(e.shard)
            if not isinstance(f, LocalFile):
                return None
            out[n] = e._replace(shard=str(f.path))
        return out


class _Arrays:
    def __init__(self, arrays: dict):
        self._arrays = arrays

    def read_raw(self, name: str):
        return self._arrays[name]

    def close(self) -> None:
        pass


def expert_importance(importance, p: Planned, e: int):
    """Expert ``e`` of stacked tensor ``p``'s importance per column (read by the parent: K floats a
    task), or None without an importance matrix or an entry for ``p``."""
    if importance is None:
        return None
    return importance.row(p.info.name, int(p.info.shape[-1]), p.recipe.first + e if p.recipe.rows else e)


def run_task(p: Planned, number: int, entries: dict | None, arrays: dict | None, measure: bool, imatrix=None):
    """Pool entry point: one expert's ``produce.ExpertPiece`` (``p`` is ``one_expert``'s plan of
    expert ``number``; ``imatrix`` its importance per column, or None)."""
    from ..io.reader import checkpoint_of_files
    from .produce import expert_piece

    # files closed per task: a released staged shard must not stay open
    src = checkpoint_of_files(entries) if entries is not None else _Arrays(arrays)
    try:
        return expert_piece(src, p, 0, measure=measure, number=number, imatrix=imatrix)
    finally:
        src.close()


def init_worker(parent_pid: int) -> None:
    """Pool initializer: end with the parent (``requant.worker._exit_with``), even when it is killed."""
    from ..requant.worker import _exit_with

    _exit_with(parent_pid)


def _lost(name: str) -> WorkerLostError:
    return WorkerLostError("a worker process ended without a result (killed from outside: out of memory, or a "
                           "signal); finished splits are kept, rerun with --resume", tensor=name)


class ExpertRunner:
    """Experts of consecutive expert tensors, computed ahead by ``workers`` processes.

    ``run(tensors)`` yields ``(planned, expert, ExpertPiece)`` in order for every expert of ``tensors``
    (a run of expert tensors that come one after another in the file); ``measure``: each piece
    carries its report row."""

    def __init__(self, ckpt, workers: int, *, measure: bool = False, importance=None, ray: bool = False):
        self.files = SourceFiles(ckpt)
        self.ray = ray                  # a joined Ray cluster computes the experts (raypool)
        self.importance = importance    # requant.importance.Importance (--imatrix) or None
        self.workers = workers
        self.measure = measure
        self._pool = None

    def _executor(self):
        if self._pool is None and self.ray:
            from ..raypool import RayPool

            self._pool = RayPool()
        if self._pool is None:
            from concurrent.futures import ProcessPoolExecutor

            from ..requant._stream import pool_context

            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=pool_context(),
                                             initializer=init_worker, initargs=(os.getpid(),))
        return self._pool

    def run(self, tensors: list[Planned]):
        todo = deque((p, e) for p in tensors for e in range(p.recipe.arg))
        pending: deque = deque()       # (planned, expert, shards it reads, future)

        def submit() -> None:
            p, e = todo.popleft()
            sub = one_expert(p, e)
            shards = self.files.shards(sub.recipe.sources)
            by_path = not (self.ray and self.files.staged)
            if self.files.staged and by_path and not shards <= set().union(*(s for _, _, s, _ in pending)):
                # staging a new shard may release others to stay in --max-disk: none may be in use
                while pending:
                    yield drain()
            entries = self.files.locate(sub.recipe.sources) if by_path else None
            arrays = None
            if entries is None:
                arrays = {n: self.files.ckpt.read_raw(n) for n in sub.recipe.sources}
            try:
                task = (run_task, sub, e, entries, arrays, self.measure, expert_importance(self.importance, p, e))
                if self.ray:   # an expert's decoded floats, its encoding and the interpreter
                    weights = math.prod(sub.info.shape)
                    future = self._executor().submit(*task, memory=16 * weights + 256 * 2**20,
                                                     units=sum(self.files.ckpt.tensors[n].nbytes
                                                               for n in sub.recipe.sources))
                else:
                    future = self._executor().submit(*task)
            except BrokenProcessPool:
                raise _lost(p.info.name) from None
            pending.append((p, e, shards, future))

        def drain():
            p, e, _, future = pending.popleft()
            try:
                return p, e, future.result()
            except BrokenProcessPool:
                raise _lost(p.info.name) from None

        while todo or pending:
            while todo and len(pending) < 2 * self.workers:
                yield from submit()
            if pending:
                yield drain()

    def node_stats(self) -> list[dict]:
        """Per Ray node: tasks, busy seconds, source bytes (empty for a local pool)."""
        return self._pool.stats() if self.ray and self._pool is not None else []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
