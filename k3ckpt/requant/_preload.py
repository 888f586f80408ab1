"""Imported once by the worker pool's fork server (``_stream.pool_context``), before it forks
any worker: numba's import and its first load of a cached kernel cost about a second of CPU,
paid here once instead of in every worker.  Workers forked from the server start with the
default format's kernel loaded; other kernels load on first use, as before."""


def _warm() -> None:
    import numpy as np

    from . import worker  # noqa: F401  (what every task unpickles: the pool's entry points)
    from .moet_fused import requant_moet

    requant_moet(np.zeros((1, 16), np.uint8), np.full((1, 1), 127, np.uint8))


try:
    _warm()
except Exception:   # only a head start: a worker loads what it needs itself, and reports its errors
    pass
