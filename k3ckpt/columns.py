"""Whole-column helpers for work over every tensor of a checkpoint at once."""

from __future__ import annotations

import itertools
from typing import Hashable, Iterable

import numpy as np


def first_ids(keys: Iterable[Hashable]) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids of hashable keys: (position of each id's first key, id per key),
    ids in order of first appearance.  The dict work runs in C (``map`` over
    ``setdefault``), which matters at half a million keys."""
    seen: dict = {}
    first_pos = np.fromiter(map(seen.setdefault, keys, itertools.count()), dtype=np.int64)
    firsts, ids = np.unique(first_pos, return_inverse=True)
    return firsts, ids.reshape(-1)
