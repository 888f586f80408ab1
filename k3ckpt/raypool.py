"""A worker pool on a Ray cluster (``--ray ADDRESS|auto``), for the runners that otherwise use a
local process pool (``requant._stream``, ``gguf.pool``).

``RayPool`` has the part of ``concurrent.futures.ProcessPoolExecutor`` those runners use:
``submit(fn, *args)`` returns a future with ``result()`` and ``done()``, ``shutdown()`` ends it.
A task is a module-level function and its arguments (Ray pickles the function by reference, so
every node needs the same k3ckpt installed); the pool's ``initializer`` runs once per Ray worker
process before its first task, as a process pool's does.  Tasks read their sources by path and
write their outputs at fixed offsets of files the driver created, so both paths must be on a
filesystem every node sees; a task returns its per-weight result, never bulk data.

Ray retries a task whose worker process or node is lost (``max_retries``); the runners' tasks
write the same bytes at the same offsets every time, so a retried task leaves the output as an
uninterrupted one would.  Each task declares one CPU and the memory it may use, so Ray does not
put more on a node than it holds.  ``stats()`` is per node: tasks, busy seconds, and the source
bytes the caller said each task stood for.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from .errors import UsageError, WorkerLostError

__all__ = ["RayPool", "connect", "cluster_cpus", "join"]

# Test hook: with this set to a file path, the first task to create that file kills its own worker
# process after its work is done and before it answers (tests/test_ray.py: a lost worker's task is
# retried and the output is unchanged).
KILL_ONCE_ENV = "K3CKPT_RAY_KILL_ONCE"
CONNECT_TIMEOUT_S = 5.0


def _ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'k3ckpt[ray]'") from None
    return ray


def connect(address: str) -> str:
    """Join the Ray cluster at ``address`` (``HOST:PORT`` of its head, or ``auto``: the one this
    machine runs or ``RAY_ADDRESS`` names); returns the address joined.  A cluster that cannot be
    reached is one ``UsageError`` line, within ``CONNECT_TIMEOUT_S`` for a ``HOST:PORT``."""
    ray = _ray()
    if ray.is_initialized():
        return address
    if address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--ray {address!r}: give the head's HOST:PORT (e.g. 10.0.0.1:6379) or auto")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise UsageError(f"cannot reach a Ray cluster at {address} ({e.strerror or e})") from None
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot join a Ray cluster at {address}: {first}") from None
    return address


def cluster_cpus() -> int:
    """CPUs the joined cluster offers (the default worker count of a ``--ray`` run)."""
    return max(1, int(_ray().cluster_resources().get("CPU", 1)))


def join(address: str, workers: int | None) -> int:
    """``connect(address)``, then the run's worker count: ``workers``, or the cluster's CPUs."""
    connect(address)
    return cluster_cpus() if workers is None else workers


# One entry per (initializer, initargs) already run in this worker process.
_INITIALIZED: set = set()


def _call(initializer, initargs, fn, args):
    """What a Ray worker runs: the pool's initializer (once per process), then ``fn(*args)``;
    returns (node id, seconds, fn's answer)."""
    if initializer is not None:
        key = (initializer.__module__, initializer.__qualname__, tuple(initargs))
        if key not in _INITIALIZED:
            initializer(*initargs)
            _INITIALIZED.add(key)
    t0 = time.perf_counter()
    out = fn(*args)
    seconds = time.perf_counter() - t0
    marker = os.environ.get(KILL_ONCE_ENV)
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            os._exit(9)
    import ray

    return ray.get_runtime_context().get_node_id(), seconds, out


@dataclass
class NodeStats:
    tasks: int = 0
    busy_seconds: float = 0.0
    source_bytes: int = 0

    def to_dict(self, node: str) -> dict:
        rate = self.source_bytes / self.busy_seconds if self.busy_seconds > 0 else 0.0
        return {"node": node, "tasks": self.tasks, "busy_seconds": round(self.busy_seconds, 3),
                "source_bytes": self.source_bytes, "source_bytes_per_busy_s": round(rate, 1)}


class RayFuture:
    def __init__(self, pool: "RayPool", ref, units: int):
        self._pool, self._ref, self._units = pool, ref, units
        self._answer = None
        self._got = False

    def done(self) -> bool:
        if self._got:
            return True
        ready, _ = self._pool.ray.wait([self._ref], timeout=0)
        return bool(ready)

    def result(self):
        if not self._got:
            self._answer = self._pool._finish(self._ref, self._units)
            self._got = True
        return self._answer


class RayPool:
    """``submit`` / ``shutdown`` over Ray tasks (module docstring); ``memory``: bytes a task
    declares by default (``submit(..., memory=)`` per task); ``spread``: place tasks across the
    nodes (Ray's ``SPREAD``) rather than filling the driver's node first, for tasks that mostly
    read and write files, so each node's link to the shared filesystem carries a share."""

    def __init__(self, *, initializer=None, initargs=(), memory: int | None = None, max_retries: int = 3,
                 spread: bool = False):
        self.ray = _ray()
        self._initializer, self._initargs = initializer, tuple(initargs)
        self._memory = memory
        self._retries = max_retries
        self._spread = {"scheduling_strategy": "SPREAD"} if spread else {}
        self._task = self.ray.remote(_call)
        self._pending: set = set()
        self._stats: dict[str, NodeStats] = {}

    def submit(self, fn, *args, memory: int | None = None, units: int = 0) -> RayFuture:
        """Run ``fn(*args)`` on the cluster; ``units``: the source bytes it stands for (``stats``)."""
        mem = memory if memory is not None else self._memory
        opts = {"num_cpus": 1, "max_retries": self._retries, **({"memory": int(mem)} if mem else {}), **self._spread}
        ref = self._task.options(**opts).remote(self._initializer, self._initargs, fn, args)
        self._pending.add(ref)
        return RayFuture(self, ref, units)

    def _finish(self, ref, units: int):
        ray = self.ray
        try:
            node, seconds, out = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, BaseException) else e) from None
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                ray.exceptions.ObjectLostError) as e:
            raise WorkerLostError(f"a Ray task failed after {self._retries} retries ({type(e).__name__}); "
                                  "finished shards are kept, rerun with --resume") from None
        finally:
            self._pending.discard(ref)
        s = self._stats.setdefault(node, NodeStats())
        s.tasks += 1
        s.busy_seconds += seconds
        s.source_bytes += units
        return out

    def stats(self) -> list[dict]:
        return [s.to_dict(n) for n, s in sorted(self._stats.items())]

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """End the pool as a process pool's ``shutdown`` does: ``cancel_futures`` cancels the tasks
        not collected (a running one stops at its next Python line), ``wait`` returns only once
        none of them runs, so nothing of this run still writes when the caller cleans up."""
        pending = list(self._pending)
        if cancel_futures:
            for ref in pending:
                try:
                    self.ray.cancel(ref, force=False)
                except Exception:  # noqa: BLE001 - a finished task cannot be cancelled; nothing to do
                    pass
        if wait and pending:
            self.ray.wait(pending, num_returns=len(pending))
        self._pending.clear()
