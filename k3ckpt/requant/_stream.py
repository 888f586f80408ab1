"""The data pass of ``requant_checkpoint``: copies, the worker pool, the writer.

Weights are submitted in plan order with at most ``2 x workers`` in flight
and their outputs written as they come back, in the same order; copies are
streamed in chunks between them.  Each shard's results are saved in a file of
their own (``.k3ckpt-results/SHARD.json``, listed in the manifest) just before
the shard is recorded as final, so a resumed run can rebuild the report
without recomputing finished shards.  (In the manifest itself they would make
it grow with the checkpoint: about 200 MB for K3, rewritten after every shard.)
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from ..errors import WorkerLostError
from .plan import RequantPlan
from .results import TensorResult

RESULTS_DIR = ".k3ckpt-results"


def results_file(shard: str) -> str:
    """Where the per-weight results of ``shard`` are kept, relative to the output folder."""
    return f"{RESULTS_DIR}/{shard}.json"


def save_state(manifest, rel: str, obj) -> None:
    """Job state too large for the manifest: a JSON file under the output folder, written
    atomically and listed in the manifest with its hash."""
    from ..io.writer import atomic_write_json

    (manifest.root / rel).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(manifest.root / rel, obj, indent=None)
    manifest.record(rel)


def load_state(manifest, rel: str):
    """What ``save_state`` saved under ``rel``; None when it is missing or fails its hash."""
    import json

    if not manifest.verify(rel):
        return None
    return json.loads((manifest.root / rel).read_bytes())


def saved_results(manifest, shard: str) -> list[TensorResult] | None:
    """The results saved with final ``shard``; None when they are lost (the shard is then
    written again)."""
    saved = load_state(manifest, results_file(shard))
    return None if saved is None else [TensorResult.from_dict(d) for d in saved]


def _shard_results(plan: RequantPlan, writer) -> dict[str, list[int]]:
    """Shard name -> weights whose last output shard (in layout order) it is."""
    pos = {n: i for i, n in enumerate(writer.shards)}
    out: dict[str, list[int]] = {n: [] for n in writer.shards}
    for w in plan.weights:
        last = max((writer.shard_of[name] for _, name in w.outputs), key=pos.__getitem__)
        out[last].append(w.index)
    return out


def _worker_lost(name: str) -> WorkerLostError:
    return WorkerLostError("a pool worker process ended without a result (killed from outside: out of memory, "
                           "or a signal); finished shards are kept, rerun with --resume", tensor=name)


class _Runner:
    """Weights computed in order, by a process pool (``workers`` > 1; ``pool_context``) or in-process,
    with at most ``2 x workers`` in flight; ``next()`` returns (index, parts, result)."""

    def __init__(self, ckpt, weights, workers: int, src_path: str | None, place=None, keep_parts: bool = True,
                 importance=None, ray: bool = False):
        from . import worker as wk

        self._importance = importance   # importance.Importance (--imatrix) or None

        self._wk = wk
        self._ckpt = ckpt
        self._src_path = src_path
        self._place = place   # weight -> {role: (file, offset)} its worker writes to, or None
        self._keep_parts = keep_parts
        self._queue = iter(weights)
        self._pending: deque = deque()
        self._pool = _pool(workers, src_path, len(weights), ray=ray)
        for _ in range(1 if self._pool is None else 2 * workers):
            self._submit()

    def _submit(self) -> None:
        w = next(self._queue, None)
        if w is None:
            return
        if self._pool is None:
            self._pending.append((w, None))   # computed in-process, on demand
            return
        arrays = None if self._src_path is not None else self._wk.read_source(self._ckpt, w)
        targets = None if self._place is None else self._place(w)
        try:
            task = (self._wk.run_task, w, arrays, targets, self._keep_parts, self._columns(w))
            future = self._pool.submit(*task) if not ray_pool(self._pool) else \
                self._pool.submit(*task, memory=task_memory(w), units=w.in_bytes)
        except BrokenProcessPool:
            raise _worker_lost(w.name) from None
        self._pending.append((w, future))

    def _columns(self, w):
        # one row of the importance file, read here so workers need not open it (K floats a task)
        return None if self._importance is None else self._importance.columns(w)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def ready(self) -> bool:
        """The next result is already computed (never true in-process: it is computed on demand)."""
        return bool(self._pending) and self._pending[0][1] is not None and self._pending[0][1].done()

    def next(self):
        w, future = self._pending.popleft()
        if future is None:
            got = self._wk.compute(self._ckpt, w, None, self._columns(w))
        else:
            try:
                got = future.result()
            except BrokenProcessPool:
                raise _worker_lost(w.name) from None
        self._submit()
        return got

    def node_stats(self) -> list[dict] | None:
        """Per Ray node: tasks, busy seconds, source bytes (None for a local pool)."""
        return self._pool.stats() if ray_pool(self._pool) else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def ray_pool(pool) -> bool:
    from ..raypool import RayPool

    return isinstance(pool, RayPool)


def task_memory(w) -> int:
    """Bytes a weight's task may use, declared to Ray: the decoded source and output floats, the
    encoder's scratch, and the interpreter (measured peaks are within this; docs/requant.md)."""
    return 16 * w.params + 2 * w.in_bytes + 256 * 2**20


def measure(ckpt, weights, *, workers: int, src_path: str | None, progress: bool,
            importance=None, ray: bool = False) -> dict[int, TensorResult]:
    """Results of ``weights`` without writing anything (the ``--target-bpw`` measurement pass)."""
    from tqdm import tqdm

    out: dict[int, TensorResult] = {}
    by_index = {w.index: w for w in weights}
    # results only: no parts back
    runner = _Runner(ckpt, weights, workers, src_path, keep_parts=False, importance=importance, ray=ray)
    try:
        with tqdm(total=sum(w.in_bytes for w in weights), unit="B", unit_scale=True, desc="measure",
                  disable=not progress) as bar:
            while runner:
                index, _, res = runner.next()
                out[index] = res
                bar.update(by_index[index].in_bytes)
    finally:
        runner.close()
    return out


def stream(ckpt, plan: RequantPlan, dst: Path, manifest, results: dict[int, TensorResult], *, done_shards,
           workers: int, src_path: str | None, progress: bool, max_shard_bytes: int, resume: bool,
           on_result=None, importance=None, ray: bool = False, node_stats: list | None = None) -> list[str]:
    """Write every output tensor of ``plan`` into ``dst``; fills ``results``; returns the shard names."""
    from tqdm import tqdm

    from ..io.writer import ShardedWriter

    def on_final(path: Path) -> None:
        # Results first, then the record: a shard listed as final always has its results saved.
        save_state(manifest, results_file(path.name), [results[i].to_dict() for i in per_shard[path.name]])
        manifest.record(path.name, sha256=writer.sha256[path.name])

    with ShardedWriter(dst, list(plan.specs), max_shard_bytes=max_shard_bytes, done_shards=done_shards,
                       on_shard_final=on_final, overwrite=resume, hash_shards=True,
                       write_index=True) as writer:   # always an index: transformers needs one for model-0000x names
        per_shard = _shard_results(plan, writer)
        todo = [w for w in plan.weights
                if any(writer.needs(n) for _, n in w.outputs) or w.index not in results]
        total = sum(writer.specs[n].nbytes for n in plan.copies if writer.needs(n)) + sum(w.in_bytes for w in todo)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="requant", disable=not progress, smoothing=0.1)
        def place(w) -> dict[str, tuple[str, int]] | None:
            # Pool workers write whole output tensors into the shard file themselves; expert
            # slices of a fused tensor (--layout gpt-oss) come back here.
            if w.out_offsets is not None:
                return None
            return {role: writer.place(name) for role, name in w.outputs
                    if writer.needs(name) and writer.specs[name].nbytes}

        runner = _Runner(ckpt, todo, workers, src_path, place=place, importance=importance, ray=ray)
        pos = {n: i for i, n in enumerate(ckpt.tensors)}
        drained = [0]

        def drain_one() -> None:
            drained[0] += 1
            index, parts, res = runner.next()
            w = plan.weights[index]
            results[index] = res
            for i, (role, name) in enumerate(w.outputs):
                if role not in parts:   # written by the worker (place)
                    writer.mark_written(name)
                    continue
                if not writer.needs(name):
                    continue
                if w.out_offsets is None:
                    writer.write(name, np.ascontiguousarray(parts[role]))
                else:   # one expert's slice of a fused output tensor (--layout gpt-oss)
                    writer.write_chunk(name, w.out_offsets[i], np.ascontiguousarray(parts[role]))
            bar.update(w.in_bytes)
            if on_result is not None:
                on_result(res)

        try:
            # Copies go in source order while the pool works; weights drain in plan order.
            for name in plan.copies:
                if not writer.needs(name):
                    continue
                # Weights stored before this tensor first: reads then go through the source in
                # order, so a staged hub source (k3ckpt.hub.staged) downloads each shard once.
                while drained[0] < len(todo) and min(pos[todo[drained[0]].packed],
                                                     pos[todo[drained[0]].scale]) < pos[name]:
                    drain_one()
                offset = 0
                for chunk in ckpt.iter_chunks(name):
                    writer.write_chunk(name, offset, chunk)
                    offset += len(chunk)
                    bar.update(len(chunk))
                while runner.ready():
                    drain_one()
            while runner:
                drain_one()
            if node_stats is not None:
                node_stats.extend(runner.node_stats() or ())
        finally:
            runner.close()
            bar.close()
        return list(writer.shards)


def pool_context():
    """How pool workers start: forked from a fork server on Linux, else spawned.

    Neither forks the parent, which holds open files and threads.  The fork server imports
    ``_preload`` before its first fork, so numba and the default kernel are loaded once
    instead of once per worker.  (The preload list is the multiprocessing module's own: it
    is set here for a server not yet running; one already running keeps its list.)  Not on
    macOS: system libraries there (numpy's Accelerate BLAS among them) may have started
    threads before the server forks, which is why spawn is Python's default there.  Either way
    workers start without re-running the caller's ``__main__`` (``_spawn``), so scripts without
    a main guard and ``python -`` can run a pool."""
    import multiprocessing
    import sys

    from ._spawn import ForkServerContext, SpawnContext

    if not sys.platform.startswith("linux") or "forkserver" not in multiprocessing.get_all_start_methods():
        return SpawnContext()
    ctx = ForkServerContext()
    ctx.set_forkserver_preload([f"{__package__}._preload"])
    return ctx


def start_pool_server(workers: int) -> None:
    """Start the fork server now, so its imports run while the parent plans (it starts on the
    pool's first task otherwise)."""
    if workers > 1 and pool_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _pool(workers: int, src_path: str | None, tasks: int, *, ray: bool = False):
    from . import worker as wk

    if ray:   # a joined Ray cluster (raypool.connect): tasks run there, whatever their number
        from ..raypool import RayPool

        return RayPool(initializer=wk.init_worker, initargs=(src_path, None))
    if workers <= 1 or tasks <= 1:
        return None
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=min(workers, tasks), mp_context=pool_context(),
                               initializer=wk.init_worker, initargs=(src_path, os.getpid()))
