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
from ..io._span_ids import span_ids

MAX_NUMBERS = 8
_MAX_DIGITS = 18   # a longer number would not fit an int64 exactly: the caller takes the regex path


@njit
def scan_templates(blob, n):
    """For ``n`` names joined by b"\\n" in ``blob``: (ok, template id per name,
    first name of each id, template bytes, template (start, end) per name,
    numbers [n, MAX_NUMBERS], numbers per name).  ``ok`` is False when a name
    holds a NUL byte, the names are not ``n``, or a number is too long."""
    tmpl = np.empty(blob.shape[0], dtype=np.uint8)
    tspan = np.empty((n, 2), dtype=np.int64)
    numbers = np.zeros((n, MAX_NUMBERS), dtype=np.int64)
    count = np.zeros(n, dtype=np.int64)
    ids = np.empty(n, dtype=np.int64)
    L = blob.shape[0]
    i = 0      # read position in blob
    j = 0      # write position in tmpl
    for t in range(n):
        tspan[t, 0] = j
        while i < L and blob[i] != 10:
            c = blob[i]
            if c == 0:
                return False, ids, ids[:0], tmpl, tspan, numbers, count
            if c == 46:   # '.': does an all-digit component follow?
                k = i + 1
                v = 0
                while k < L and 48 <= blob[k] <= 57:
                    v = v * 10 + (blob[k] - 48)
                    k += 1
                digits = k - i - 1
                if digits > 0 and (k == L or blob[k] == 46 or blob[k] == 10):
                    if digits > _MAX_DIGITS:
                        return False, ids, ids[:0], tmpl, tspan, numbers, count
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
                return False, ids, ids[:0], tmpl, tspan, numbers, count
            i += 1   # the newline
    if i != L:
        return False, ids, ids[:0], tmpl, tspan, numbers, count
    ids, first = span_ids(tmpl, tspan[:, 0], tspan[:, 1])
    return True, ids, first, tmpl, tspan, numbers, count
