"""Which numba kernels a requant plan runs, and whether numba's on-disk cache holds them yet.

A first run compiles them (about 10 s for moet-w2 and k3ckpt-mx2, 33 s for gguf-iq2_xs on
one core: 36.5 s against 3.5 s for a 7 MB IQ2_XS requant), later runs load them from the cache
(``k3ckpt._numba``).  A kernel counts as compiled when its cache index file
(``<module>.<function>-<line>.py<ver>.nbi``) exists; a cache made by other k3ckpt sources
(an edit, an upgrade) is not detected and only costs the compile again.
"""

from __future__ import annotations

import importlib
import os

from ..formats import ids

# Format or method -> the kernels its weights run, as "module.kernel" or "module:factory.kernel"
# (a kernel a cached factory returns).  Every weight but moet-w2's one-pass kernel also runs the
# error metric, the code histogram and the MXFP4 decode of its source.
_COMMON = ("k3ckpt.requant.metrics:_kernels.1", "k3ckpt.requant.tensor_stats._byte_counts_kernel",
           "k3ckpt.formats.mxfp4:_kernels.decode_f32")
_KERNELS = {
    "refit": ("k3ckpt.requant.moet_fused:_kernel",),
    "keep-scales": ("k3ckpt.requant.moet_fused:_kernel",),
    ids.MX2: ("k3ckpt.requant.mx2._search_kernel", "k3ckpt.requant.mx2._encode_kernel") + _COMMON,
    ids.GGUF_IQ2_XS: ("k3ckpt.requant.iq2xs._encode_kernel", "k3ckpt.formats.iq2xs:_kernels.decode") + _COMMON,
    ids.MXFP4_PACK: ("k3ckpt.formats.mxfp4:_kernels.encode",) + _COMMON,
}
# Seconds to compile them on one core (measured on the fixtures, first run against second).
COMPILE_SECONDS = {"refit": 10.0, "keep-scales": 10.0, ids.MX2: 10.0, ids.GGUF_IQ2_XS: 33.0,
                   ids.MXFP4_PACK: 5.0}


def _dispatcher(where: str):
    from .. import _numba  # noqa: F401  (chooses numba's cache folder before numba is imported)

    head, _, factory = where.partition(":")
    if factory:
        name, _, attr = factory.partition(".")
        got = getattr(importlib.import_module(head), name)()
        if not attr:
            return got
        return got[int(attr)] if attr.isdigit() else getattr(got, attr)
    mod_name, _, attr = head.rpartition(".")
    return getattr(importlib.import_module(mod_name), attr)


def _cached(dispatcher) -> bool:
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    path = getattr(cache_file, "_index_path", None)
    return path is None or os.path.exists(path)   # no cache at all: nothing to detect


def cold_kernels(keys) -> dict[str, float]:
    """For each format or method in ``keys`` whose kernels are not all in the cache: the
    seconds compiling them is expected to take (empty when everything is cached)."""
    out = {}
    for key in dict.fromkeys(keys):
        places = _KERNELS.get(key)
        if places is None:
            continue
        try:
            cold = any(not _cached(_dispatcher(where)) for where in places)
        except Exception:   # an estimate only: never fail a run over it
            cold = False
        if cold:
            out[key] = COMPILE_SECONDS[key]
    return out


def plan_keys(plan) -> list[str]:
    """The ``_KERNELS`` keys of a plan's weights (by method where the format has methods, else by format)."""
    return [w.method or w.format for w in plan.weights]


def compile_seconds(plan) -> float:
    """Expected seconds of compiling before ``plan``'s weights run (0.0 with a warm cache).
    Kernels shared by several keys (moet-w2's two methods) count once."""
    cold = cold_kernels(plan_keys(plan))
    return float(sum({_KERNELS[k]: v for k, v in cold.items()}.values()))
