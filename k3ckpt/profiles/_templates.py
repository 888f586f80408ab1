"""Name templates of many tensor names in one pass (numba).

The profile classifies a name by its *template*: every dotted component that
is a bare integer (not the first component) is taken out and kept as a number
(``layers.12.experts.5.w1.weight`` -> ``layers``, ``experts``, ``w1.weight`` with
numbers 12 and 5).  Over a K3's 497,220 names a regex pass costs about a
second; this scanner reads the newline-joined UTF-8 names once, gives each
distinct template an id and keeps the first ``MAX_NUMBERS`` numbers of each
name.  The template text writes each taken-out ``.<digits>`` as one NUL byte,
so ``template.split("\\0")`` gives exactly the text pieces the regex split gives.
"""

from __future__ import annotations

import numpy as np

from .._numba import njit

MAX_NUMBERS = 8
_MAX_DIGITS = 18   # a longer number would not fit an int64 exactly: the caller takes the regex path


@njit
def _same(buf, a0, a1, b0, b1):
    if a1 - a0 != b1 - b0:
        return False
    for k in range(a1 - a0):
        if buf[a0 + k] != buf[b0 + k]:
            return False
    return True


@njit
def scan_templates(blob, n):
    """For ``n`` names joined by b"\\n" in ``blob``: (ok, template id per name,
    first name of each id, template bytes, template (start, end) per name,
    numbers [n, MAX_NUMBERS], numbers per name).  ``ok`` is False when a name
    holds a NUL byte, the names are not ``n``, or a number is too long."""
    size = 1024
    while size < 2 * n:
        size *= 2
    tmpl = np.empty(blob.shape[0], dtype=np.uint8)
    tspan = np.empty((n, 2), dtype=np.int64)
    numbers = np.zeros((n, MAX_NUMBERS), dtype=np.int64)
    count = np.zeros(n, dtype=np.int64)
    ids = np.empty(n, dtype=np.int64)
    first = np.empty(n, dtype=np.int64)
    table = np.full(size, -1, dtype=np.int64)
    kinds = 0
    L = blob.shape[0]
    i = 0      # read position in blob
    j = 0      # write position in tmpl
    for t in range(n):
        tspan[t, 0] = j
        while i < L and blob[i] != 10:
            c = blob[i]
            if c == 0:
                return False, ids, first[:0], tmpl, tspan, numbers, count
            if c == 46:   # '.': does an all-digit component follow?
                k = i + 1
                v = 0
                while k < L and 48 <= blob[k] <= 57:
                    v = v * 10 + (blob[k] - 48)
                    k += 1
                digits = k - i - 1
                if digits > 0 and (k == L or blob[k] == 46 or blob[k] == 10):
                    if digits > _MAX_DIGITS:
                        return False, ids, first[:0], tmpl, tspan, numbers, count
                    if count[t] < MAX_NUMBERS:
                        numbers[t, count[t]] = v
                    count[t] += 1
                    tmpl[j] = 0
                    j += 1
                    i = k
                    continue
            tmpl[j] = c
            j += 1
            i += 1
        tspan[t, 1] = j
        if t < n - 1:
            if i >= L:
                return False, ids, first[:0], tmpl, tspan, numbers, count
            i += 1   # the newline
        a0 = tspan[t, 0]
        a1 = tspan[t, 1]
        h = np.uint64(14695981039346656037)
        for k in range(a0, a1):
            h = (h ^ np.uint64(tmpl[k])) * np.uint64(1099511628211)
        slot = np.int64(h & np.uint64(size - 1))
        while True:
            r = table[slot]
            if r < 0:
                table[slot] = t
                ids[t] = kinds
                first[kinds] = t
                kinds += 1
                break
            if _same(tmpl, a0, a1, tspan[r, 0], tspan[r, 1]):
                ids[t] = ids[r]
                break
            slot = (slot + 1) & (size - 1)
    if i != L:
        return False, ids, first[:0], tmpl, tspan, numbers, count
    return True, ids, first[:kinds], tmpl, tspan, numbers, count
