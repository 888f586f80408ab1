"""The one strict safetensors header parser (and its inverse, ``build_header``).

Every path that reads a header -- local files, hub range reads, ``inspect`` --
goes through :func:`parse_header_length` and :func:`parse_header_json`, so one
set of rules decides what a valid file is.  The rules follow the reference
reader (safetensors 0.8.0, Rust ``Metadata::validate``) and are listed in
``docs/safetensors-io.md``:

* u64 little-endian header length N, capped at ``MAX_HEADER_BYTES``, and
  ``8 + N`` must fit in the file;
* N bytes of strict UTF-8 JSON: an object, no duplicate keys, no
  NaN/Infinity, optionally padded with trailing spaces;
* ``__metadata__`` maps str to str; every other key is a tensor with exactly
  ``dtype``/``shape``/``data_offsets``;
* offsets are contiguous from 0 once sorted (no gap, no overlap),
  ``end - begin`` equals the tensor's size, and the last end is the end of the
  file (no trailing bytes).

Sizes are Python ints throughout: a hostile shape cannot overflow or make us
allocate anything.

The parser here is the reference: JSON with hooks, then entry by entry.  One
fast path (``_header_scan``, numba) reads large headers and index files in the
plain form writers emit; it answers "not plain" for anything else, and for any
input breaking a rule, and this parser then decides and names the problem.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import operator
import os
import stat
import struct
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Iterator, NamedTuple

import numpy as np

from ..columns import first_ids
from ..errors import InvalidFileError, NotFoundError, ShapeError, TruncatedFileError, UnsupportedError, UsageError
from . import dtypes

MAX_HEADER_BYTES = 100_000_000  # safetensors 0.8.0 refuses larger ("header too large")
_U64_LIMIT = 1 << 64            # the reference reader parses dims and offsets as u64/usize
METADATA_KEY = "__metadata__"
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_ALIGN = 8                      # writer convention since safetensors 0.3.0: data start 8-aligned


class TensorInfo(NamedTuple):
    """One header entry; ``start``/``end`` are relative to the data start.

    Immutable like the frozen dataclasses elsewhere, but a NamedTuple: a K3
    checkpoint makes 497,220 of them and tuple construction is 4x cheaper.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class HeaderTensors(Mapping[str, TensorInfo]):
    """A header's entries by name in offset order, as the fast path leaves them:
    the names joined by newlines (header order, with the offset order when it
    differs) and a hash of each, the distinct (dtype, shape) pairs with each
    tensor's index into them, and the offsets.  Names become strings on first
    use and the ``TensorInfo`` table is built on the first lookup, so a walk over
    names and kinds (``inspect`` of a K3: 497,220 tensors) makes no entry, and
    the index check (``reader._columns_agree``) reads the joined names as bytes.
    Immutable; equal to any mapping with the same entries."""

    __slots__ = ("_blob", "_order", "_hashes", "_names", "_kinds", "_kind_of", "_begin", "_end", "_table")

    def __init__(self, blob: np.ndarray, order: np.ndarray | None, kinds: list[tuple[str, tuple[int, ...]]],
                 kind_of: np.ndarray, begin: np.ndarray, end: np.ndarray, hashes: np.ndarray):
        self._blob = blob            # uint8, ASCII names joined by b"\n" in header order
        self._order = order          # header position of each tensor in offset order, None if the same
        self._hashes = hashes        # per name in header order (``_header_scan._hash``)
        self._names: list[str] | None = None
        self._kinds = kinds
        self._kind_of = kind_of
        self._begin = begin
        self._end = end
        self._table: dict[str, TensorInfo] | None = None

    def _name_list(self) -> list[str]:
        names = self._names
        if names is None:
            blob = self._blob
            if blob is None:   # another thread decoded them meanwhile
                return self._names   # type: ignore[return-value]
            names = blob.tobytes().decode("ascii").split("\n")
            if self._order is not None:
                names = list(operator.itemgetter(*self._order.tolist())(names))
            self._names = names
            self._blob = None   # the strings hold the names from now on
        return names

    def joined_names(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(the names joined by newlines as ASCII bytes, the hash of each), in header
        order; None once the names are strings."""
        blob = self._blob
        return None if blob is None else (blob, self._hashes)

    def _entries(self) -> dict[str, TensorInfo]:
        table = self._table
        if table is None:   # threads may both build it: equal tables, each assigned whole
            names = self._name_list()
            ks = self._kind_of.tolist()
            dts = [d for d, _ in self._kinds]
            shapes = [sh for _, sh in self._kinds]
            infos = map(_new_info, zip(names, map(dts.__getitem__, ks), map(shapes.__getitem__, ks),
                                       self._begin.tolist(), self._end.tolist()))
            table = self._table = dict(zip(names, infos))
        return table

    def kind_table(self) -> tuple[list[tuple[str, tuple[int, ...]]], np.ndarray]:
        """As ``Header.kind_table``: the parse found them."""
        return self._kinds, self._kind_of

    @property
    def data_end(self) -> int:
        """The largest end offset (the data size), without building the table."""
        return int(self._end[-1]) if len(self._end) else 0

    def __getitem__(self, name: str) -> TensorInfo:
        return self._entries()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries()

    def __iter__(self) -> Iterator[str]:
        return iter(self._name_list())

    def __reversed__(self) -> Iterator[str]:
        return reversed(self._name_list())

    def __len__(self) -> int:
        return len(self._begin)

    def values(self):
        return self._entries().values()

    def items(self):
        return self._entries().items()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HeaderTensors):
            other = other._entries()
        return self._entries() == other if isinstance(other, Mapping) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like dict

    def __repr__(self) -> str:
        return f"HeaderTensors({len(self)} tensors)"


_new_info = functools.partial(tuple.__new__, TensorInfo)  # TensorInfo from a 5-tuple, no Python frame


@dataclass(frozen=True)
class Header:
    """A validated safetensors header."""

    tensors: Mapping[str, TensorInfo]   # ordered by start offset (a dict, or HeaderTensors)
    metadata: dict[str, str]
    header_size: int                # N, the JSON length in bytes (padding included)

    def kind_table(self) -> tuple[list[tuple[str, tuple[int, ...]]], np.ndarray]:
        """The distinct (dtype, shape) pairs, in order of first appearance, and each
        tensor's index into them: whole-header work (``inspect``) then runs per
        pair, not per tensor."""
        if isinstance(self.tensors, HeaderTensors):
            return self.tensors.kind_table()
        infos = list(self.tensors.values())
        firsts, kind_of = first_ids(map(_DTYPE_SHAPE, infos))
        return [_DTYPE_SHAPE(infos[i]) for i in firsts.tolist()], kind_of

    @property
    def data_start(self) -> int:
        return 8 + self.header_size

    @property
    def data_size(self) -> int:
        if isinstance(self.tensors, HeaderTensors):
            return self.tensors.data_end
        if not self.tensors:
            return 0
        return next(reversed(self.tensors.values())).end

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size


# ---------------------------------------------------------------------------
# parsing


def parse_header_length(
    first8: bytes,
    *,
    source: str,
    file_size: int | None = None,
    max_header: int = MAX_HEADER_BYTES,
) -> int:
    """Header length N from a file's first 8 bytes, checked against the cap
    and (when known) the file size."""
    if len(first8) < 8:
        raise TruncatedFileError(
            f"file too short for a safetensors header length: need 8 bytes, found {len(first8)}", file=source
        )
    (n,) = struct.unpack("<Q", bytes(first8[:8]))
    if n > max_header:
        raise InvalidFileError(f"header length {n:,} exceeds the {max_header:,}-byte limit", file=source)
    if n < 2:  # the smallest JSON object is "{}"
        raise InvalidFileError(f"header length {n} is too small to hold a JSON object", file=source)
    if file_size is not None and 8 + n > file_size:
        raise TruncatedFileError(
            f"header length {n:,} needs {8 + n:,} bytes but the file has {file_size:,}", file=source
        )
    return n


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


class _LoneSurrogate(Exception):
    def __init__(self, text: str):
        self.text = text


def _check_utf8(s: str) -> None:
    # JSON escapes can spell lone surrogates ("\ud800") that no UTF-8 file can
    # hold; serde_json (the reference reader) refuses them, so do we.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _LoneSurrogate(s) from None


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        _check_utf8(k)
        if isinstance(v, str):
            _check_utf8(v)
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic collector while building many acyclic objects (parsed
    JSON, header entries): a K3's millions of them otherwise trigger repeated
    full-heap passes, about a quarter of the time to open it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def loads_strict(raw: bytes, *, source: str, what: str = "JSON", parse_float: Any = None) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, no lone surrogates.
    Any failure is an ``InvalidFileError`` naming ``source`` (also used for index
    and config files).  ``parse_float`` is passed to ``json.loads``."""
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidFileError(f"{what} is not valid UTF-8 (byte {e.start}: {e.reason})", file=source) from None
    try:
        with paused_gc():
            return json.loads(text, object_pairs_hook=_pairs_no_duplicates, parse_constant=_reject_constant,
                              parse_float=parse_float)
    except _DuplicateKey as e:
        raise InvalidFileError(f"{what} has the key {e.key!r} more than once", file=source) from None
    except _LoneSurrogate as e:
        raise InvalidFileError(f"{what} string {e.text!r} escapes a lone UTF-16 surrogate", file=source) from None
    except RecursionError:
        raise InvalidFileError(f"{what} nests too deeply", file=source) from None
    except ValueError as e:  # JSONDecodeError, constants, over-long integers
        raise InvalidFileError(f"{what} does not parse: {e}", file=source) from None


# Inputs this large in the plain form go through the fast path; smaller ones parse
# quickly enough here, and numba's import (half a second) is spared.
_PLAIN_SCAN_MIN = 1 << 18


def loads_index(raw: bytes, *, source: str, what: str = "index JSON") -> Any:
    """An index file, exactly as ``loads_strict`` gives it (a large plain one by
    the fast path, ``_header_scan.plain_index``)."""
    raw = bytes(raw)
    if len(raw) >= _PLAIN_SCAN_MIN:
        from ._header_scan import plain_index

        plain = plain_index(raw, source=source, what=what)
        if plain is not None:
            return plain
    return loads_strict(raw, source=source, what=what)


def _is_int(x: Any) -> bool:
    return type(x) is int  # bool is an int subclass; JSON true/false are not sizes


def _all_sizes(values: list) -> bool:
    """Every value a JSON integer (not a bool) in [0, 2**64)."""
    for v in values:
        if type(v) is not int or v < 0 or v >= _U64_LIMIT:
            return False
    return True


def _checked_nbytes(dt: dtypes.DType, shape: tuple[int, ...], have: int, *, source: str, name: str) -> None:
    """Check ``have == size(shape)`` without ever forming a size far larger
    than ``have`` (a shape of a million nines would otherwise be slow)."""
    if 0 in shape:
        numel = 0
    else:
        numel = 1
        limit = have * 8 + 8  # in elements, generous: bits >= 4
        for d in shape:
            numel *= d
            if numel > limit:
                raise InvalidFileError(
                    f"shape {list(shape)} of {dt.name} needs more than the {have:,} bytes its offsets give",
                    file=source, tensor=name,
                )
    bits = numel * dt.bits
    if bits % 8:
        raise InvalidFileError(
            f"{dt.name} shape {list(shape)} has {numel} elements = {bits} bits, not a whole number of bytes",
            file=source, tensor=name,
        )
    if bits // 8 != have:
        raise InvalidFileError(
            f"{dt.name} shape {list(shape)} needs {bits // 8:,} bytes but data_offsets span {have:,}",
            file=source, tensor=name,
        )


def _parse_metadata(value: Any, *, source: str) -> dict[str, str]:
    """The ``__metadata__`` value of a parsed header: str -> str (null: none)."""
    if value is None:  # the reference reader reads null as "no metadata" (serde Option)
        return {}
    if not isinstance(value, dict):
        raise InvalidFileError(f"{METADATA_KEY} must be an object of strings, found {type(value).__name__}",
                               file=source)
    for k, v in value.items():
        if not isinstance(v, str):
            raise InvalidFileError(
                f"{METADATA_KEY}[{k!r}] must be a string, found {type(v).__name__}", file=source
            )
    return dict(value)


def _parse_entry(name: str, entry: Any, *, source: str) -> TensorInfo:
    if not isinstance(entry, dict):
        raise InvalidFileError(f"header entry must be an object, found {type(entry).__name__}",
                               file=source, tensor=name)
    keys = entry.keys()
    if keys != _ENTRY_KEYS:
        missing = sorted(_ENTRY_KEYS - keys)
        extra = sorted(keys - _ENTRY_KEYS)
        raise InvalidFileError(
            f"header entry needs exactly dtype, shape, data_offsets (missing {missing}, unexpected {extra})",
            file=source, tensor=name,
        )
    dt_name = entry["dtype"]
    if not isinstance(dt_name, str):
        raise InvalidFileError(f"dtype must be a string, found {dt_name!r}", file=source, tensor=name)
    try:
        dt = dtypes.lookup(dt_name)
    except UnsupportedError as e:
        raise UnsupportedError(e.detail, file=source, tensor=name) from None
    shape = entry["shape"]
    if type(shape) is not list or not _all_sizes(shape):
        raise InvalidFileError(
            f"shape must be a list of non-negative integers below 2**64, found {_short(shape)}",
            file=source, tensor=name,
        )
    offs = entry["data_offsets"]
    if (
        type(offs) is not list
        or len(offs) != 2
        or not _all_sizes(offs)
        or offs[0] > offs[1]
    ):
        raise InvalidFileError(
            f"data_offsets must be [begin, end] with 0 <= begin <= end < 2**64, found {_short(offs)}",
            file=source, tensor=name,
        )
    begin, end = offs
    _checked_nbytes(dt, tuple(shape), end - begin, source=source, name=name)
    return TensorInfo(name=name, dtype=dt.name, shape=tuple(shape), start=begin, end=end)


def _short(x: Any, limit: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


_START_END = operator.itemgetter(3, 4)   # TensorInfo (start, end)
_DTYPE_SHAPE = operator.itemgetter(1, 2)


def parse_header_json(raw: bytes, *, source: str, file_size: int | None = None) -> Header:
    """Validate the N JSON bytes of a header.  With ``file_size`` (the whole
    file, prefix included) the data must end exactly at the end of the file."""
    raw = bytes(raw)
    n = len(raw)
    if not raw[:1] == b"{":  # reference reader: InvalidHeaderStart
        raise InvalidFileError(f"header JSON must start with '{{', found {raw[:1]!r}", file=source)
    if n >= _PLAIN_SCAN_MIN:
        from ._header_scan import plain_header

        plain = plain_header(raw, source=source)
        if plain is not None:
            tensors, metadata = plain
            _check_file_size(tensors.data_end, n, source=source, file_size=file_size)
            return Header(tensors=tensors, metadata=metadata, header_size=n)
    return _parse_header_strict(raw, n, source=source, file_size=file_size)


def _parse_header_strict(raw: bytes, n: int, *, source: str, file_size: int | None) -> Header:
    obj = loads_strict(raw, source=source, what="header JSON")
    if not isinstance(obj, dict):  # pragma: no cover - a '{' start guarantees an object or a parse error
        raise InvalidFileError(f"header JSON must be an object, found {type(obj).__name__}", file=source)
    metadata = _parse_metadata(obj[METADATA_KEY], source=source) if METADATA_KEY in obj else {}
    infos = [_parse_entry(name, entry, source=source) for name, entry in obj.items() if name != METADATA_KEY]
    # Contiguity after sorting by (begin, end): empty tensors sharing an offset
    # sort before the tensor that starts there; ties keep header order.
    infos.sort(key=_START_END)
    pos = 0
    prev: TensorInfo | None = None
    for t in infos:
        if t.start != pos:
            kind = "overlaps" if t.start < pos else "leaves a gap after"
            after = f"tensor {prev.name!r} ending at {pos:,}" if prev else "the data start"
            raise InvalidFileError(
                f"data_offsets [{t.start:,}, {t.end:,}) {kind} {after}; expected begin {pos:,}",
                file=source, tensor=t.name,
            )
        pos = t.end
        prev = t
    _check_file_size(pos, n, source=source, file_size=file_size)
    return Header(tensors={t.name: t for t in infos}, metadata=metadata, header_size=n)


def _check_file_size(data_end: int, n: int, *, source: str, file_size: int | None) -> None:
    """The data (``data_end`` bytes after the ``8 + n`` prefix) ends where the file does."""
    if file_size is None:
        return
    have = file_size - 8 - n
    if data_end > have:
        raise TruncatedFileError(
            f"header describes {data_end:,} data bytes but the file holds {have:,} "
            f"(file size {file_size:,}, expected {8 + n + data_end:,})",
            file=source,
        )
    if data_end < have:
        raise InvalidFileError(
            f"{have - data_end:,} trailing bytes after the last tensor (file size {file_size:,}, "
            f"expected {8 + n + data_end:,})",
            file=source,
        )


def read_header(f_or_path: Any, *, source: str | None = None) -> Header:
    """Read and validate the header of a local path, an open binary file, or a
    ``ByteSource`` (anything with ``pread(offset, n)`` and ``size``).  Reads
    exactly ``8 + N`` bytes, never tensor data."""
    if isinstance(f_or_path, (str, os.PathLike)):
        path = os.fspath(f_or_path)
        src = source or path
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except FileNotFoundError:
            raise NotFoundError("no such file", file=src) from None
        try:
            return _read_header_fd(fd, src)
        finally:
            os.close(fd)
    if hasattr(f_or_path, "pread") and hasattr(f_or_path, "size"):
        src = source or str(getattr(f_or_path, "name", repr(f_or_path)))
        return _read_header_source(f_or_path, src)
    if hasattr(f_or_path, "read") and hasattr(f_or_path, "seek"):
        src = source or str(getattr(f_or_path, "name", type(f_or_path).__name__))
        try:
            fd = f_or_path.fileno()
        except (OSError, AttributeError):  # io.BytesIO and friends have no descriptor
            return _read_header_source(_SeekSource(f_or_path), src)
        return _read_header_fd(fd, src)
    raise UsageError(f"read_header needs a path, a binary file or a ByteSource, got {type(f_or_path).__name__}")


class _SeekSource:
    """pread over a seekable file object without a descriptor."""

    def __init__(self, f: Any):
        self.f = f
        self.size = f.seek(0, os.SEEK_END)

    def pread(self, offset: int, n: int) -> bytes:
        self.f.seek(offset)
        return self.f.read(n)


def _read_header_source(src_obj: Any, src: str) -> Header:
    size = int(src_obj.size)
    k = min(8, size)
    n = parse_header_length(_exact(src_obj.pread(0, k), 0, k, src), source=src, file_size=size)
    raw = _exact(src_obj.pread(8, n), 8, n, src)
    return parse_header_json(raw, source=src, file_size=size)


def _exact(data: bytes, offset: int, n: int, src: str) -> bytes:
    if len(data) != n:
        raise TruncatedFileError(f"short read at offset {offset:,}: wanted {n:,} bytes, got {len(data):,}", file=src)
    return data


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    parts = []
    got = 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _read_header_fd(fd: int, src: str) -> Header:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidFileError("not a regular file", file=src)
    size = st.st_size
    n = parse_header_length(_pread_all(fd, 8, 0), source=src, file_size=size)
    raw = _exact(_pread_all(fd, n, 8), 8, n, src)
    return parse_header_json(raw, source=src, file_size=size)


# ---------------------------------------------------------------------------
# building


def build_header(
    entries: list[tuple[str, str, tuple[int, ...], int]],
    metadata: dict[str, str] | None = None,
) -> tuple[bytes, list[tuple[int, int]]]:
    """The full file prefix (8-byte LE length + JSON) for tensors laid out in
    the given order, and their data-relative ``(start, end)`` offsets.

    ``entries`` are ``(name, dtype, shape, nbytes)``.  The JSON is padded with
    spaces so the data start (8 + N) is a multiple of 8.  Input is checked
    with the parser's rules; mistakes raise ``UsageError``/``ShapeError``/
    ``UnsupportedError``.
    """
    obj: dict[str, Any] = {}
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise UsageError(f"metadata must map str to str, got {_short(metadata)}")
        obj[METADATA_KEY] = dict(metadata)
    offsets: list[tuple[int, int]] = []
    pos = 0
    for name, dt_name, shape, nbytes in entries:
        if not isinstance(name, str):
            raise UsageError(f"tensor names must be strings, got {name!r}")
        if name == METADATA_KEY:
            raise UsageError(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
        if name in obj:
            raise UsageError("tensor name given twice", tensor=name)
        dt = dtypes.lookup(dt_name)
        shape = tuple(shape)
        if not all(_is_int(d) and 0 <= d < _U64_LIMIT for d in shape):
            raise ShapeError(f"shape must hold non-negative ints, got {_short(shape)}", tensor=name)
        want = dt.nbytes(shape)
        if want is None:
            raise ShapeError(f"{dt.name} shape {list(shape)} does not end on a byte boundary", tensor=name)
        if not _is_int(nbytes) or nbytes != want:
            raise ShapeError(f"{dt.name} shape {list(shape)} needs {want:,} bytes, got nbytes={nbytes!r}", tensor=name)
        obj[name] = {"dtype": dt.name, "shape": list(shape), "data_offsets": [pos, pos + want]}
        offsets.append((pos, pos + want))
        pos += want
    try:
        js = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"a tensor name or metadata string is not encodable as UTF-8: {e.reason}") from None
    js += b" " * (-(8 + len(js)) % _ALIGN)
    if len(js) > MAX_HEADER_BYTES:
        raise UsageError(f"header would be {len(js):,} bytes, over the {MAX_HEADER_BYTES:,}-byte limit")
    return struct.pack("<Q", len(js)) + js, offsets
