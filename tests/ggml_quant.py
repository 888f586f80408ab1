"""ggml's own quantizers for the encoders' tests: ``ggml_quantize_chunk`` from the libggml that
llama-cpp-python builds, through ctypes.  Without llama-cpp-python a test using it skips and says
why; with K3CKPT_REQUIRE_LLAMA_CPP=1 (CI) that is a failure."""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
import pytest


@functools.cache
def _chunk():
    try:
        from llama_cpp import _ggml
    except ImportError:
        why = "llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36 builds it, ~9 min)"
        if os.environ.get("K3CKPT_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(f"ggml's quantizer required but {why}")
        pytest.skip(why)
    lib = _ggml.libggml
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    return lib, fn


def ggml_quantize(qtype, x: np.ndarray, block_bytes: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml's bytes of float32 ``x`` [n, k] as ``qtype`` (a ``GGMLQuantizationType``), ``block_bytes``
    per 256 weights; ``imatrix`` float32 [k] or None (ggml's own rule for a missing one)."""
    lib, fn = _chunk()
    lib.ggml_quantize_init(int(qtype))             # the i-quants' grids; idempotent
    x = np.ascontiguousarray(x, np.float32)
    n, k = x.shape
    out = np.zeros((n, k // 256 * block_bytes), np.uint8)
    q = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    size = fn(int(qtype), x.ctypes.data, out.ctypes.data, 0, n, k, None if q is None else q.ctypes.data)
    assert size == out.nbytes, (size, out.nbytes)
    return out


def ggml_requires_imatrix(qtype) -> bool:
    """Whether ggml refuses to quantize ``qtype`` without an importance matrix."""
    lib, _ = _chunk()
    return bool(lib.ggml_quantize_requires_imatrix(int(qtype)))
