"""Exact ids for byte spans that repeat: the dedupe behind the header, index and name scanners."""

from __future__ import annotations

import numpy as np

from .._numba import njit


@njit
def _same(buf, a0, a1, b0, b1):
    if a1 - a0 != b1 - b0:
        return False
    for k in range(a1 - a0):
        if buf[a0 + k] != buf[b0 + k]:
            return False
    return True


@njit
def span_ids(buf, starts, ends):
    """Per item, the id of its text ``buf[starts[t]:ends[t]]``, ids numbered in
    order of first appearance, and the first item of each id.  Headers repeat a
    few hundred (dtype, shape) texts hundreds of thousands of times, an index a
    few shard names, so Python then handles each distinct text once.  Exact:
    equal ids mean byte-equal texts."""
    n = starts.shape[0]
    size = 1024
    while size < 2 * n:
        size *= 2
    table = np.full(size, -1, dtype=np.int64)       # slot -> first item of a kind
    kind = np.empty(n, dtype=np.int64)
    first = np.empty(n, dtype=np.int64)
    kinds = 0
    for t in range(n):
        a0 = starts[t]
        a1 = ends[t]
        h = np.uint64(14695981039346656037)
        for k in range(a0, a1):
            h = (h ^ np.uint64(buf[k])) * np.uint64(1099511628211)
        slot = np.int64(h & np.uint64(size - 1))
        while True:
            r = table[slot]
            if r < 0:
                table[slot] = t
                kind[t] = kinds
                first[kinds] = t
                kinds += 1
                break
            if _same(buf, a0, a1, starts[r], ends[r]):
                kind[t] = kind[r]
                break
            slot = (slot + 1) & (size - 1)
    return kind, first[:kinds]
