"""One-pass scanners for safetensors headers and index files in the form every
writer emits.

``json.loads`` builds three Python objects per tensor before the header rules
can be checked; on a 497,220-tensor K3 that is most of the time to open it.
This scanner reads the bytes once (numba) and returns spans and integers in
arrays.  It accepts only the plain form -- an object of
``"name":{"dtype":"D","shape":[...],"data_offsets":[b,e]}`` members in that key
order, an optional ``__metadata__`` object of plain strings, whitespace
between tokens, no backslash escapes, integers below 10**18 -- and answers
"not plain" for anything else.  A header the scanner accepts is valid JSON
with exactly the meaning its arrays describe; ``plain_header`` then checks the
safetensors rules (dtypes, sizes, contiguity, duplicate names) over whole
columns, once per distinct (dtype, shape).  Anything not plain or breaking a
rule gives None, and the strict parser in ``header.py`` decides and names the
problem: this is the one fast path beside it, held to it by differential tests
(tests/test_io_header_scan.py).

``scan_index`` does the same for ``model.safetensors.index.json``: the
``weight_map`` object of plain strings as columns, every other top-level
member as a byte span parsed strictly (they are small).  Names are hashed
(``_hash``) so that the reader can pair the index's names with the headers'
by sorting and then compare their bytes (``same_texts``); a hash is never
taken as proof of equality, only distinct hashes as proof of distinct names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._numba import njit
from ..errors import InvalidFileError, UnsupportedError
from . import dtypes
from ._span_ids import span_ids
from .header import HeaderTensors, _parse_metadata, loads_strict

# Columns of the ``spans`` array returned per tensor.
NAME_S, NAME_E, DTYPE_S, DTYPE_E, SHAPE_S, SHAPE_E, BEGIN, END = range(8)

_DTYPE_KEY = np.frombuffer(b'"dtype"', dtype=np.uint8)
_SHAPE_KEY = np.frombuffer(b'"shape"', dtype=np.uint8)
_OFFSETS_KEY = np.frombuffer(b'"data_offsets"', dtype=np.uint8)
_METADATA_KEY = np.frombuffer(b'"__metadata__"', dtype=np.uint8)
_MAX_DIGITS = 18   # below 2**63: int64 arithmetic is exact; longer numbers take the strict parser


@njit
def _ws(buf, i):
    n = buf.shape[0]
    while i < n and (buf[i] == 32 or buf[i] == 10 or buf[i] == 13 or buf[i] == 9):
        i += 1
    return i


@njit
def _lit(buf, i, lit):
    """Index after ``lit`` at ``i``, or -1."""
    if i + lit.shape[0] > buf.shape[0]:
        return -1
    for k in range(lit.shape[0]):
        if buf[i + k] != lit[k]:
            return -1
    return i + lit.shape[0]


@njit
def _string_end(buf, i):
    """``buf[i]`` is '"': index of the closing quote of an escape-free string, or -1."""
    n = buf.shape[0]
    if i >= n or buf[i] != 34:
        return -1
    j = i + 1
    while j < n:
        c = buf[j]
        if c == 34:
            return j
        if c == 92 or c < 32:   # escapes and raw control characters: strict parser
            return -1
        j += 1
    return -1


@njit
def _number(buf, i):
    """(value, index after) of a JSON non-negative integer at ``i``; index -1 if none."""
    n = buf.shape[0]
    j = i
    v = 0
    while j < n and 48 <= buf[j] <= 57:
        v = v * 10 + (buf[j] - 48)
        j += 1
    digits = j - i
    if digits == 0 or digits > _MAX_DIGITS or (digits > 1 and buf[i] == 48):
        return 0, -1
    return v, j


@njit
def _colon(buf, i):
    i = _ws(buf, i)
    if i >= buf.shape[0] or buf[i] != 58:
        return -1
    return _ws(buf, i + 1)


@njit(inline="always")
def _key(buf, i):
    """(end of the key string at ``i``, start of its value after ':'), or (-1, -1)."""
    e = _string_end(buf, i)
    if e < 0:
        return -1, -1
    j = _colon(buf, e + 1)
    return (-1, -1) if j < 0 else (e, j)


@njit
def _after_member(buf, i):
    """After an object member ending at ``i``: (index after '}', True) at the end of
    the object, (start of the next member, False) after ',', or (-1, False)."""
    i = _ws(buf, i)
    if i >= buf.shape[0]:
        return -1, False
    if buf[i] == 125:
        return i + 1, True
    if buf[i] != 44:
        return -1, False
    return _ws(buf, i + 1), False


@njit
def _metadata(buf, i):
    """End (exclusive) of a ``{"k":"v",...}`` object of plain strings at ``i``, or -1."""
    if i >= buf.shape[0] or buf[i] != 123:
        return -1
    i = _ws(buf, i + 1)
    if i < buf.shape[0] and buf[i] == 125:
        return i + 1
    while True:
        e, i = _key(buf, i)
        if i < 0:
            return -1
        e = _string_end(buf, i)
        if e < 0:
            return -1
        i, end = _after_member(buf, e + 1)
        if i < 0 or end:
            return i


@njit
def _expect(buf, i, c):
    """Index after byte ``c`` at ``i`` (whitespace before it skipped), or -1; -1 stays -1."""
    if i < 0:
        return -1
    i = _ws(buf, i)
    if i >= buf.shape[0] or buf[i] != c:
        return -1
    return i + 1


@njit
def _member(buf, i, key):
    """Index of the value after ``key :`` at ``i`` (whitespace skipped), or -1; -1 stays -1."""
    if i < 0:
        return -1
    i = _lit(buf, _ws(buf, i), key)
    return -1 if i < 0 else _colon(buf, i)


@njit
def _entry(buf, i, row):
    """Parse ``{"dtype":..,"shape":[..],"data_offsets":[b,e]}`` at ``i`` into ``row``; index after or -1."""
    n = buf.shape[0]
    i = _member(buf, _expect(buf, i, 123), _DTYPE_KEY)
    e = _string_end(buf, i) if i >= 0 else -1
    if e < 0:
        return -1
    row[2] = i + 1
    row[3] = e
    i = _expect(buf, _member(buf, _expect(buf, e + 1, 44), _SHAPE_KEY), 91)
    if i < 0:
        return -1
    row[4] = i
    i = _ws(buf, i)
    if i < n and buf[i] != 93:
        while True:
            _, i = _number(buf, i)
            if i < 0:
                return -1
            i = _ws(buf, i)
            if i >= n:
                return -1
            if buf[i] == 93:
                break
            if buf[i] != 44:
                return -1
            i = _ws(buf, i + 1)
    if i >= n:
        return -1
    row[5] = i
    i = _expect(buf, _member(buf, _expect(buf, i + 1, 44), _OFFSETS_KEY), 91)
    if i < 0:
        return -1
    b, i = _number(buf, _ws(buf, i))
    i = _expect(buf, i, 44)
    if i < 0:
        return -1
    e2, i = _number(buf, _ws(buf, i))
    i = _expect(buf, _expect(buf, i, 93), 125)
    if i < 0:
        return -1
    row[6] = b
    row[7] = e2
    return i


@njit
def _names_blob(buf, starts, ends):
    """The texts ``buf[starts[t]:ends[t]]`` joined by newlines (plain strings hold no control characters)."""
    n = starts.shape[0]
    total = 0
    for t in range(n):
        total += ends[t] - starts[t] + 1
    out = np.empty(max(total - 1, 0), dtype=np.uint8)
    j = 0
    for t in range(n):
        if t:
            out[j] = 10
            j += 1
        k = ends[t] - starts[t]
        out[j:j + k] = buf[starts[t]:ends[t]]   # a slice copy: a memmove, not a loop of byte stores
        j += k
    return out


@njit
def scan_header(buf):
    """A plain header's columns: (spans [n, 8] int64, metadata (start, end) or
    (-1, -1), names joined by newlines, kind id per tensor, first tensor of
    each kind, a 64-bit hash of each name); metadata is (-2, -2) and the rest
    empty when the header is not plain."""
    spans, meta = _scan(buf)
    if meta[0] == -2:
        empty = np.empty(0, dtype=np.int64)
        return spans, meta, np.empty(0, dtype=np.uint8), empty, empty, np.empty(0, dtype=np.uint64)
    kind, first = span_ids(buf, spans[:, DTYPE_S], spans[:, SHAPE_E])
    names = _names_blob(buf, spans[:, NAME_S], spans[:, NAME_E])
    return spans, meta, names, kind, first, _hashes(buf, spans[:, NAME_S], spans[:, NAME_E])


@njit
def _scan(buf):
    n = buf.shape[0]
    cap = n // 40 + 1     # the shortest member, '"":{"dtype":"","shape":[],"data_offsets":[0,0]}', is 46 bytes
    spans = np.empty((cap, 8), dtype=np.int64)
    meta = np.full(2, -1, dtype=np.int64)
    bad = (spans[:0], np.full(2, -2, dtype=np.int64))
    i = _ws(buf, 0)
    if i >= n or buf[i] != 123:
        return bad
    i = _ws(buf, i + 1)
    k = 0
    if i < n and buf[i] == 125:
        i += 1
    else:
        while True:
            e, j = _key(buf, i)
            if j < 0:
                return bad
            if _lit(buf, i, _METADATA_KEY) == e + 1:
                if meta[0] != -1:
                    return bad
                end = _metadata(buf, j)
                if end < 0:
                    return bad
                meta[0] = j
                meta[1] = end
                i = end
            else:
                if k >= cap:
                    return bad
                row = spans[k]
                row[0] = i + 1
                row[1] = e
                i = _entry(buf, j, row)
                if i < 0:
                    return bad
                k += 1
            i, end = _after_member(buf, i)
            if i < 0:
                return bad
            if end:
                break
    if _ws(buf, i) != n:
        return bad
    return spans[:k], meta


@njit
def _skip_value(buf, i):
    """Index after the JSON value at ``i`` (structure only: the caller parses the
    span strictly), or -1; strings with escapes give -1."""
    n = buf.shape[0]
    if i >= n:
        return -1
    c = buf[i]
    if c == 34:
        e = _string_end(buf, i)
        return -1 if e < 0 else e + 1
    if c == 123 or c == 91:
        depth = 0
        while i < n:
            c = buf[i]
            if c == 34:
                e = _string_end(buf, i)
                if e < 0:
                    return -1
                i = e + 1
                continue
            if c == 123 or c == 91:
                depth += 1
            elif c == 125 or c == 93:
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return -1
    j = i
    while j < n and not (buf[j] == 44 or buf[j] == 125 or buf[j] == 93 or buf[j] == 32 or buf[j] == 10
                         or buf[j] == 13 or buf[j] == 9):
        j += 1
    return j if j > i else -1


_WEIGHT_MAP_KEY = np.frombuffer(b'"weight_map"', dtype=np.uint8)


@njit
def _scan_index(buf):
    n = buf.shape[0]
    cap = n // 8 + 1
    pairs = np.empty((cap, 4), dtype=np.int64)       # name start/end, shard start/end
    members = np.empty((64, 4), dtype=np.int64)      # other top-level key and value spans
    bad = (False, pairs[:0], members[:0])
    i = _ws(buf, 0)
    if i >= n or buf[i] != 123:
        return bad
    i = _ws(buf, i + 1)
    k = 0
    m = 0
    maps = 0
    if i < n and buf[i] == 125:
        return bad
    while True:
        e, j = _key(buf, i)
        if j < 0:
            return bad
        if _lit(buf, i, _WEIGHT_MAP_KEY) == e + 1:
            maps += 1
            if maps > 1 or j >= n or buf[j] != 123:
                return bad
            i = _ws(buf, j + 1)
            if i < n and buf[i] == 125:
                i += 1
            else:
                while True:
                    if k >= cap:
                        return bad
                    pairs[k, 0] = i + 1
                    pairs[k, 1], i = _key(buf, i)
                    if i < 0:
                        return bad
                    e = _string_end(buf, i)
                    if e < 0:
                        return bad
                    pairs[k, 2] = i + 1
                    pairs[k, 3] = e
                    k += 1
                    i, end = _after_member(buf, e + 1)
                    if i < 0:
                        return bad
                    if end:
                        break
        else:
            if m >= members.shape[0]:
                return bad
            end = _skip_value(buf, j)
            if end < 0:
                return bad
            members[m, 0] = i
            members[m, 1] = e + 1
            members[m, 2] = j
            members[m, 3] = end
            m += 1
            i = end
        i, end = _after_member(buf, i)
        if i < 0:
            return bad
        if end:
            break
    if _ws(buf, i) != n or maps != 1:
        return bad
    return True, pairs[:k], members[:m]


@njit
def scan_index(buf):
    """A plain index: (ok, other members' (key start, key end, value start, value
    end) [m, 4], weight_map pairs (name start, name end, shard start, shard end)
    [n, 4], shard id per name, first name of each shard id, a 64-bit hash of
    each name)."""
    ok, pairs, members = _scan_index(buf)
    empty = np.empty(0, dtype=np.int64)
    if not ok:
        return False, members, pairs, empty, empty, np.empty(0, dtype=np.uint64)
    kind, first = _run_ids(buf, pairs[:, 2], pairs[:, 3])
    return True, members, pairs, kind, first, _hashes(buf, pairs[:, 0], pairs[:, 1])


@njit
def names_blob(buf, starts, ends):
    """The texts ``buf[starts[t]:ends[t]]`` joined by newlines."""
    return _names_blob(buf, starts, ends)


@njit(inline="always")
def _word(buf, k, n):
    """The ``n`` <= 8 bytes at ``k`` as a little-endian integer (LLVM merges the loads)."""
    w = np.uint64(0)
    for j in range(n):
        w |= np.uint64(buf[k + j]) << np.uint64(8 * j)
    return w


@njit
def _hash(buf, a, b):
    """A 64-bit hash of ``buf[a:b]``, eight bytes a step (multiply and xor-shift
    mixing, as in splitmix64).  Only a sort key: equal texts are always compared."""
    m = np.uint64(0x9E3779B97F4A7C15)
    h = np.uint64(b - a) * m
    k = a
    while k + 8 <= b:
        h = (h ^ _word(buf, k, 8)) * m
        h ^= h >> np.uint64(29)
        k += 8
    h = (h ^ _word(buf, k, b - k)) * np.uint64(0xBF58476D1CE4E5B9)
    return h ^ (h >> np.uint64(31))


@njit
def _hashes(buf, starts, ends):
    out = np.empty(starts.shape[0], dtype=np.uint64)
    for t in range(starts.shape[0]):
        out[t] = _hash(buf, starts[t], ends[t])
    return out


@njit
def _run_ids(buf, starts, ends):
    """``span_ids`` for texts that come in runs (an index lists a shard's names
    together): an item equal to the one before takes its id without a hash."""
    n = starts.shape[0]
    kind = np.empty(n, dtype=np.int64)
    heads = np.empty(n, dtype=np.int64)
    runs = 0
    for t in range(n):
        if t and _equal(buf, starts[t], ends[t], buf, starts[t - 1], ends[t - 1]):
            kind[t] = kind[t - 1]
        else:
            heads[runs] = t
            kind[t] = runs
            runs += 1
    heads = heads[:runs]
    run_kind, first = span_ids(buf, starts[heads], ends[heads])
    return run_kind[kind], heads[first]


@njit(inline="always")
def _equal(x, a0, a1, y, b0, b1):
    n = a1 - a0
    if b1 - b0 != n:
        return False
    k = 0
    while k + 8 <= n:
        if _word(x, a0 + k, 8) != _word(y, b0 + k, 8):
            return False
        k += 8
    return _word(x, a0 + k, n - k) == _word(y, b0 + k, n - k)


@njit
def line_spans(names):
    """(start, end) of each name in ``names``, names joined by newlines."""
    L = names.shape[0]
    n = 1
    for i in range(L):
        if names[i] == 10:
            n += 1
    starts = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    k = 0
    starts[0] = 0
    for i in range(L):
        if names[i] == 10:
            ends[k] = i
            k += 1
            starts[k] = i + 1
    ends[k] = L
    return starts, ends


@njit
def name_spans(names):
    """(start, end, 64-bit hash) of each name in ``names``, names joined by newlines."""
    starts, ends = line_spans(names)
    return starts, ends, _hashes(names, starts, ends)


@njit
def same_texts(x, x_starts, x_ends, y, y_starts, y_ends):
    """Whether ``x[x_starts[k]:x_ends[k]]`` equals ``y[y_starts[k]:y_ends[k]]`` for every k."""
    for k in range(x_starts.shape[0]):
        if not _equal(x, x_starts[k], x_ends[k], y, y_starts[k], y_ends[k]):
            return False
    return True


# ---------------------------------------------------------------------------
# the scans' columns checked with the header rules (Python, once per kind)


def plain_header(raw: bytes, *, source: str) -> tuple[HeaderTensors, dict[str, str]] | None:
    """A large header in the plain form, checked with every rule of the strict
    parser but the file size: (its tensors in (begin, end) order, its metadata);
    None when it is not plain or breaks a rule, and the strict parser decides
    (and names the problem)."""
    if not raw.isascii():
        return None
    spans, meta, blob, kind_of, first, hashes = scan_header(np.frombuffer(raw, dtype=np.uint8))
    if meta[0] == -2 or len(spans) < 2:
        return None
    kinds = []
    for t in first.tolist():
        d0, d1, s0, s1 = spans[t, DTYPE_S:SHAPE_E + 1].tolist()
        shape = raw[s0:s1]
        kinds.append((raw[d0:d1].decode("ascii"), tuple(map(int, shape.split(b","))) if shape.strip() else ()))
    checked = _check_kinds(kinds, kind_of)
    if checked is None:
        return None
    canon, kind_of, sizes = checked
    begin = spans[:, BEGIN]
    end = spans[:, END]
    if not np.array_equal(end - begin, sizes[kind_of]):
        return None
    order = np.lexsort((end, begin))   # stable: empty tensors sharing an offset keep header order
    b, e = begin[order], end[order]
    if b[0] != 0 or not np.array_equal(b[1:], e[:-1]):
        return None
    # kinds renumbered in order of first appearance among the sorted tensors, as
    # ``Header.kind_table`` numbers them for a header the strict parser read
    k = kind_of[order]
    used, at = np.unique(k, return_index=True)
    by_first = used[np.argsort(at)]
    renum = np.empty(len(canon), dtype=np.int64)
    renum[by_first] = np.arange(len(by_first))
    k = renum[k]
    canon = [canon[i] for i in by_first.tolist()]
    ordered = np.sort(hashes)
    if (ordered[1:] == ordered[:-1]).any():
        return None   # distinct hashes prove distinct names; a repeat (or a collision) goes to the strict parser
    metadata: dict[str, str] = {}
    if meta[0] >= 0:
        try:
            metadata = _parse_metadata(loads_strict(raw[meta[0]: meta[1]], source=source), source=source)
        except InvalidFileError:
            return None
    in_order = np.array_equal(order, np.arange(len(order)))   # writers mostly list tensors in offset order
    return HeaderTensors(blob, None if in_order else order, canon, k, b, e, hashes), metadata


def _check_kinds(kinds: list[tuple[str, tuple[int, ...]]], kind_of: np.ndarray
                 ) -> tuple[list[tuple[str, tuple[int, ...]]], np.ndarray, np.ndarray] | None:
    """The distinct (dtype, shape) pairs with canonical dtype names, each tensor's
    index into them and each pair's byte size; None if a dtype is unknown, a
    size does not end on a byte or is not below 2**63 (the scan's offsets are)."""
    ids: dict[tuple, int] = {}
    remap = []
    sizes = []
    for dt_name, shape in kinds:
        try:
            dt = dtypes.lookup(dt_name)
        except UnsupportedError:
            return None
        numel = 1
        for d in shape:
            numel *= d
            if numel >= _SIZE_LIMIT:   # stops a long shape of large dims early
                return None
        if numel * dt.bits % 8 or numel * dt.bits // 8 >= _SIZE_LIMIT:
            return None
        key = (dt.name, shape)
        if key not in ids:
            ids[key] = len(ids)
            sizes.append(numel * dt.bits // 8)
        remap.append(ids[key])
    return list(ids), np.array(remap, dtype=np.int64)[kind_of], np.array(sizes, dtype=np.int64)


_SIZE_LIMIT = 1 << 63


def plain_index(raw: bytes, *, source: str, what: str) -> dict | None:
    """A large index file in the plain form, as ``loads_strict`` would give it;
    None when it is not plain or a strict parse would fail (which then says why)."""
    cols = plain_index_columns(raw, source=source, what=what)
    if cols is None:
        return None
    obj, pairs, shard_id, shards, _ = cols
    buf = np.frombuffer(raw, dtype=np.uint8)
    names = names_blob(buf, pairs[:, 0], pairs[:, 1]).tobytes().decode("ascii").split("\n") if len(pairs) else []
    obj["weight_map"] = dict(zip(names, map(shards.__getitem__, shard_id.tolist())))
    return obj


def plain_index_columns(raw: bytes, *, source: str, what: str
                        ) -> tuple[dict, np.ndarray, np.ndarray, list[str], np.ndarray] | None:
    """A large plain index as columns, without a Python object per tensor: (its
    members but ``weight_map``, parsed strictly; ``scan_index``'s pairs; shard id
    per name; the distinct shard names; a 64-bit hash per name).  None when it is
    not plain or a strict parse would fail."""
    if not raw.isascii():
        return None
    ok, members, pairs, shard_id, first, hashes = scan_index(np.frombuffer(raw, dtype=np.uint8))
    if not ok:
        return None
    ordered = np.sort(hashes)
    if len(ordered) and (ordered[1:] == ordered[:-1]).any():
        return None   # distinct hashes prove distinct names; a repeat (or a collision) goes to the strict parser
    shards = [raw[a:b].decode("ascii") for a, b in pairs[first][:, 2:4].tolist()]
    obj: dict[str, Any] = {}
    for k0, k1, v0, v1 in members.tolist():
        key = raw[k0 + 1: k1 - 1].decode("ascii")
        if key in obj:
            return None
        try:
            obj[key] = loads_strict(raw[v0:v1], source=source, what=what)
        except InvalidFileError:
            return None
    return obj, pairs, shard_id, shards, hashes
