"""Per-tensor report fields beside the error metric: source zeros, 2-bit code counts.

(The max row bias comes with the metric: ``metrics.error_stats_rows``.)  Each
numba kernel has a numpy twin (``*_reference``); tests hold them equal.
"""

from __future__ import annotations

import numpy as np

from .._numba import njit


@njit
def _byte_counts_kernel(b):
    counts = np.zeros(256, np.int64)
    for i in range(b.size):
        counts[b[i]] += 1
    return counts


def _zero_nibbles(counts: np.ndarray) -> int:
    v = np.arange(256)
    return int(counts[(v & 7) == 0].sum() + counts[((v >> 4) & 7) == 0].sum())


def _codes_2bit(counts: np.ndarray) -> tuple[int, ...]:
    v = np.arange(256)
    return tuple(int(sum(counts[((v >> sh) & 3) == c].sum() for sh in (0, 2, 4, 6))) for c in range(4))


def byte_counts(b: np.ndarray) -> np.ndarray:
    """How often each byte value occurs in the uint8 array ``b`` (numba; int64 [256])."""
    return _byte_counts_kernel(np.ascontiguousarray(b).reshape(-1))


def byte_counts_reference(b: np.ndarray) -> np.ndarray:
    """Numpy twin of ``byte_counts``."""
    return np.bincount(np.asarray(b, np.uint8).reshape(-1), minlength=256).astype(np.int64)


def zero_codes(mxfp4_packed: np.ndarray, *, reference: bool = False) -> int:
    """E2M1 zero codes (+0 and -0) among the two nibbles of every byte of MXFP4 ``packed``."""
    return _zero_nibbles((byte_counts_reference if reference else byte_counts)(mxfp4_packed))


def code_histogram(packed_2bit: np.ndarray, *, reference: bool = False) -> tuple[int, int, int, int]:
    """Counts of 2-bit codes 0..3 over the four fields of every byte."""
    return _codes_2bit((byte_counts_reference if reference else byte_counts)(packed_2bit))
