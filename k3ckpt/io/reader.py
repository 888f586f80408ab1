"""Checkpoint reader: index + headers at open, tensor bytes only on request.

A checkpoint is a folder with ``model.safetensors.index.json``, a single
``.safetensors`` file, or a folder of ``*.safetensors`` without an index.
``open_checkpoint`` reads every shard's header (never tensor data) through
the strict parser in ``header.py`` and cross-checks them with the index.
Shard bytes come from ``ByteSource`` objects: ``LocalFile`` (``os.pread`` on
a kept descriptor) here, hub range reads elsewhere -- ``checkpoint_from_sources``
holds all index/header logic and knows nothing about local files.

Memory is bounded by what the caller asks for: ``read_bytes``/``read_rows``
return exactly the requested range, ``iter_chunks`` at most ``chunk_bytes``
at a time.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
import threading
from collections.abc import ItemsView, Mapping, ValuesView
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..errors import (
    InvalidFileError,
    NotFoundError,
    ShapeError,
    TruncatedFileError,
    UnsafePathError,
    UsageError,
)
from . import dtypes, header as _header
from .origin import Origin
from .header import Header, HeaderTensors, TensorInfo, loads_index, loads_strict, paused_gc, read_header

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
MAX_JSON_BYTES = 1 << 30  # index/config files beyond 1 GiB are not plausible (K3's index is ~60 MB)


@runtime_checkable
class ByteSource(Protocol):
    """What the reader needs from a shard: its size and positioned reads."""

    name: str
    size: int

    def pread(self, offset: int, n: int) -> bytes: ...

    def close(self) -> None: ...


class LocalFile:
    """A local file read with ``os.pread`` on a descriptor opened on first use.

    Short reads raise ``TruncatedFileError``; a file whose size changed since
    it was opened is refused (``InvalidFileError``).
    """

    def __init__(self, path: str | os.PathLike, name: str | None = None):
        self.path = Path(path)
        self.name = name if name is not None else self.path.name
        try:
            self.size = self.path.stat().st_size
        except FileNotFoundError:
            raise NotFoundError("no such file", file=str(self.path)) from None
        self._fd: int | None = None
        self._lock = threading.Lock()

    def _fileno(self) -> int:
        with self._lock:  # readers may share a checkpoint across threads
            if self._fd is None:
                fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    os.close(fd)
                    raise InvalidFileError("not a regular file", file=str(self.path))
                if st.st_size != self.size:
                    os.close(fd)
                    raise InvalidFileError(f"file changed size from {self.size:,} to {st.st_size:,} while open",
                                           file=str(self.path))
                self._fd = fd
            return self._fd

    def _check(self, offset: int, n: int) -> None:
        if offset < 0 or n < 0:
            raise UsageError(f"pread needs offset, n >= 0, got {offset}, {n}", file=str(self.path))
        if offset + n > self.size:
            raise TruncatedFileError(f"read of {n:,} bytes at {offset:,} passes the end ({self.size:,} bytes)",
                                     file=str(self.path))

    def pread(self, offset: int, n: int) -> bytes:
        self._check(offset, n)
        buf = bytearray(n)
        self.pread_into(offset, memoryview(buf))
        return bytes(buf)

    def pread_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` (a writable byte buffer) from ``offset``: no extra copy."""
        view = memoryview(buf).cast("B")
        n = view.nbytes
        self._check(offset, n)
        fd = self._fileno()
        got = 0
        while got < n:
            k = os.preadv(fd, [view[got:]], offset + got)
            if k == 0:
                raise TruncatedFileError(f"short read at {offset + got:,}: file ended early", file=str(self.path))
            got += k

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __repr__(self) -> str:
        return f"LocalFile({str(self.path)!r})"


class TensorEntry(NamedTuple):
    """Where one tensor lives: its header entry, its shard, its absolute offset.
    (A NamedTuple for the same reason as ``TensorInfo``.)"""

    info: TensorInfo
    shard: str          # shard file name, relative to the checkpoint folder
    data_offset: int    # absolute file offset of the first byte

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def nbytes(self) -> int:
        return self.info.nbytes


# ---------------------------------------------------------------------------
# names and paths


_WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:")


def check_shard_name(name: Any, *, source: str) -> str:
    """A shard name from an index must be a relative path of plain components
    inside the checkpoint folder: no absolute path, drive, backslash, ``..``,
    ``.`` or empty component.  Lexical only; see ``resolve_inside`` for links."""
    if not isinstance(name, str) or not name:
        raise InvalidFileError(f"shard name must be a non-empty string, found {name!r}", file=source)
    if "\x00" in name or "\\" in name or name.startswith("/") or _WINDOWS_DRIVE.match(name):
        raise UnsafePathError(f"shard name {name!r} is not a relative file name inside the folder", file=source)
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"shard name {name!r} has an empty, '.' or '..' component", file=source)
    return name


def _allowed_roots(root: Path) -> list[Path]:
    """The folder itself, plus -- for a Hugging Face cache snapshot
    (``<repo>/snapshots/<rev>``) -- the repo's ``blobs`` folder its links point to."""
    base = root.resolve()
    roots = [base]
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        roots.append((root.parent.parent / "blobs").resolve())
    return roots


def resolve_inside(root: Path, name: str, *, source: str) -> Path:
    """``root/name`` after checking the name and that following links stays inside ``root``."""
    check_shard_name(name, source=source)
    path = root / PurePosixPath(name)
    real = path.resolve()
    if not any(real == r or r in real.parents for r in _allowed_roots(root)):
        raise UnsafePathError(f"shard {name!r} resolves to {str(real)!r}, outside the checkpoint folder",
                              file=source)
    return path


def _natural_key(name: str) -> list[Any]:
    # model-2 before model-10 for unpadded names; same as plain sort when zero padded
    return [(0, int(t), t) if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def _load_json_file(path: Path, *, what: str, index: bool = False) -> Any:
    """A JSON file's object; for a large index in the plain form, an ``IndexColumns``."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise InvalidFileError(f"{what} is {size:,} bytes, over the {MAX_JSON_BYTES:,}-byte limit", file=str(path))
    raw = path.read_bytes()
    if index and len(raw) >= _header._PLAIN_SCAN_MIN:
        from ._header_scan import plain_index_columns

        cols = plain_index_columns(raw, source=str(path), what=what)
        if cols is not None:
            return IndexColumns(raw, *cols)
    return (loads_index if index else loads_strict)(raw, source=str(path), what=what)


class IndexColumns(NamedTuple):
    """A large plain index kept as columns over its bytes (the fast path,
    ``_header_scan.plain_index_columns``): its 497,220 names (a K3's) are checked
    against the headers' by comparing bytes (``_columns_agree``) instead of becoming
    Python strings twice, in a weight map and in the table it is compared with."""

    raw: bytes
    members: dict              # every top-level member but weight_map, parsed strictly
    pairs: np.ndarray          # [n, 4] name start/end, shard start/end in ``raw``
    shard_id: np.ndarray       # [n] index into ``shards``
    shards: list[str]          # distinct shard names, in order of first appearance
    hashes: np.ndarray         # [n] uint64, a hash of each name (all distinct)

    def weight_map(self) -> dict[str, str]:
        """The weight map as a dict (only to name what disagrees)."""
        from ._header_scan import names_blob

        if not len(self.pairs):
            return {}
        blob = names_blob(np.frombuffer(self.raw, dtype=np.uint8), self.pairs[:, 0], self.pairs[:, 1])
        names = blob.tobytes().decode("ascii").split("\n")
        return dict(zip(names, map(self.shards.__getitem__, self.shard_id.tolist())))


def load_config(path: str | os.PathLike) -> dict:
    """A ``config.json``: strict JSON object (InvalidFileError otherwise)."""
    path = Path(path)
    obj = _load_json_file(path, what="config JSON")
    if not isinstance(obj, dict):
        raise InvalidFileError(f"config must be a JSON object, found {type(obj).__name__}", file=str(path))
    return obj


# ---------------------------------------------------------------------------
# index and headers, independent of where the bytes come from


def _index_metadata(index_json: dict, *, source: str) -> dict:
    meta = index_json.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise InvalidFileError(f"index 'metadata' must be an object, found {type(meta).__name__}", file=source)
    return dict(meta)


def _index_shards(index_json: dict | IndexColumns, *, source: str) -> tuple[dict[str, str] | None, list[str], dict]:
    """(weight map, or None for columns; the shard names it lists, checked; its metadata)."""
    if isinstance(index_json, IndexColumns):
        meta = _index_metadata(index_json.members, source=source)
        for shard in index_json.shards:
            check_shard_name(shard, source=source)
        return None, index_json.shards, meta
    weight_map, meta = parse_index(index_json, source=source)
    return weight_map, list(dict.fromkeys(weight_map.values())), meta


def parse_index(index_json: Any, *, source: str) -> tuple[dict[str, str], dict]:
    """Validate an index object: ``weight_map`` str->str with safe shard names,
    optional ``metadata`` object.  Returns ``(weight_map, metadata)``."""
    if not isinstance(index_json, dict):
        raise InvalidFileError(f"index must be a JSON object, found {type(index_json).__name__}", file=source)
    wm = index_json.get("weight_map")
    if not isinstance(wm, dict):
        raise InvalidFileError(f"index needs a 'weight_map' object, found {type(wm).__name__}", file=source)
    meta = _index_metadata(index_json, source=source)
    if set(map(type, wm.values())) - {str}:
        tensor, shard = next((t, s) for t, s in wm.items() if type(s) is not str)
        raise InvalidFileError(f"weight_map value must be a shard name, found {shard!r}", file=source,
                               tensor=tensor)
    for shard in dict.fromkeys(wm.values()):   # a K3 index names 96 shards 497,220 times
        check_shard_name(shard, source=source)
    return dict(wm), meta


# "model-00003-of-00007.safetensors": the Hugging Face numbering of a sharded checkpoint
_NUMBERED = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")


def check_numbered_set(shards, *, source: str) -> None:
    """Every shard of a numbered set (``-00001-of-00007``) must be there: a set with a
    gap is an incomplete download or copy, and reading on would drop whole layers.
    ``NotFoundError`` names the missing shards."""
    sets: dict[tuple[str, int], dict[int, int]] = {}
    for name in shards:
        m = _NUMBERED.match(name)
        if m:
            sets.setdefault((m["stem"], int(m["n"])), {})[int(m["i"])] = len(m["i"])
    for (stem, total), seen in sets.items():
        missing = [i for i in range(1, total + 1) if i not in seen]
        if missing:
            width = max(seen.values())
            names = [f"{stem}-{i:0{width}d}-of-{_total_text(shards, stem, total)}.safetensors" for i in missing[:3]]
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise NotFoundError(f"incomplete checkpoint: {len(missing)} of {total} shards missing "
                                f"({', '.join(names)}{more})", file=source or None)


def _total_text(shards, stem: str, total: int) -> str:
    """The ``-of-N`` text as the set spells it (``000007``)."""
    for name in shards:
        m = _NUMBERED.match(name)
        if m and m["stem"] == stem and int(m["n"]) == total:
            return m["n"]
    return str(total)


def checkpoint_from_sources(
    index_json: dict | IndexColumns | None,
    sources: dict[str, ByteSource],
    config: dict | None = None,
    *,
    root: Path | None = None,
    index_source: str = INDEX_NAME,
    headers: dict[str, Header] | None = None,
    origin: Origin | None = None,
    hub: Any = None,
) -> Checkpoint:
    """Build a ``Checkpoint`` from shard byte sources (local or remote).

    With ``index_json`` every tensor must be listed for the shard whose header
    holds it and vice versa; ``sources`` must cover every shard the index
    names.  Without it, ``sources`` are the shards (taken in natural name
    order).  ``headers``: shard headers the caller already read (with
    ``read_header``) from these sources, e.g. while other downloads ran; the
    rest are read here.  ``origin`` / ``hub``: see ``Checkpoint``.  The sources are owned by the returned checkpoint
    (closed by it), also when this function raises.
    """
    try:
        ckpt = _checkpoint_from_sources(index_json, sources, config, root=root, index_source=index_source,
                                        parsed=headers or {})
    except BaseException:
        for s in sources.values():
            s.close()
        raise
    if origin is not None:
        ckpt.origin = origin
    ckpt.hub = hub
    return ckpt


def _checkpoint_from_sources(index_json, sources, config, *, root, index_source, parsed,
                             index_parts=None) -> Checkpoint:
    if index_json is not None:
        weight_map, listed, index_meta = index_parts or _index_shards(index_json, source=index_source)
        shards = sorted(listed, key=_natural_key)
        for s in shards:
            if s not in sources:
                raise NotFoundError(f"index names shard {s!r}, which is not available", file=index_source)
    else:
        weight_map, index_meta = None, {}
        shards = sorted(sources, key=_natural_key)
    for s in shards:
        check_shard_name(s, source=index_source)
    check_numbered_set(shards, source=index_source if index_json is not None else str(root or ""))

    shard_of: dict[str, str] | None = None
    with paused_gc():
        headers = _read_headers(shards, sources, parsed, root)
        agree = isinstance(index_json, IndexColumns) and _columns_agree(index_json, shards, headers)
        if not agree:
            # Whole-table checks at C speed; the per-name walk in _explain_mismatch runs
            # only to name what is wrong.  No name sits in two headers, and (with an
            # index) the index maps exactly these names to exactly these shards.
            if isinstance(index_json, IndexColumns):
                weight_map = index_json.weight_map()
            shard_of = _shard_table(headers)
            agree = (sum(len(h.tensors) for h in headers.values()) == len(shard_of)
                     and (weight_map is None or shard_of == weight_map))
    if not agree:
        _explain_mismatch(shards, headers, weight_map, root=root, index_source=index_source)
    used = {s: sources[s] for s in shards}
    for s, src in sources.items():  # sources the index does not name are not ours to keep open
        if s not in used:
            src.close()
    return Checkpoint(root=root, config=config, index_metadata=index_meta, shards=shards,
                      headers=headers, tensors=TensorTable(shard_of, headers), sources=used)


_HEADER_THREADS = 4


def _read_headers(shards: list[str], sources: dict[str, ByteSource], parsed: dict[str, Header],
                  root: Path | None) -> dict[str, Header]:
    """Each shard's header, in shard order (``parsed`` ones as given).  Several are
    read on worker threads: the header scan releases the GIL, so one shard's scan
    runs beside another's Python half.  The first failing shard in order raises,
    as in a read one by one."""
    todo = [s for s in shards if s not in parsed]
    workers = min(len(todo), os.cpu_count() or 1, _HEADER_THREADS)
    if workers < 2:
        return {s: parsed[s] if s in parsed else read_header(sources[s], source=_label(root, s)) for s in shards}
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k3ckpt-header")
    try:
        futures = {s: pool.submit(read_header, sources[s], source=_label(root, s)) for s in todo}
        return {s: parsed[s] if s in parsed else futures[s].result() for s in shards}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _shard_table(headers: dict[str, Header]) -> dict[str, str]:
    """Tensor name -> shard, keyed by the headers' own name strings."""
    shard_of: dict[str, str] = {}
    for s, h in headers.items():
        shard_of.update(dict.fromkeys(h.tensors, s))
    return shard_of


_HASH_BITS = 48   # of a name's hash, under its shard's index in one sort key


def _columns_agree(index: IndexColumns, shards: list[str], headers: dict[str, Header]) -> bool:
    """True when the index lists exactly the headers' tensors, each for the shard
    holding it, and no name is in two headers; False when that may not hold (the
    dict comparison then decides).  Both sides sorted by (shard, name hash) must
    pair up name for name, bytes compared: no Python string per index name, and
    the byte comparisons stay inside one shard's names at a time."""
    counts = [len(h.tensors) for h in headers.values()]
    total = sum(counts)
    if total != len(index.pairs) or len(shards) >= 1 << (64 - _HASH_BITS):
        return False
    if total == 0:
        return True
    from ._header_scan import line_spans, name_spans, same_texts

    parts = []
    for h in headers.values():
        # the fast path's names are still bytes; a header the strict parser read joins its strings
        part = h.tensors.joined_names() if isinstance(h.tensors, HeaderTensors) else None
        if part is None and len(h.tensors):
            text = "\n".join(h.tensors)
            if not text.isascii():   # the plain index is ASCII
                return False
            blob = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
            part = (blob, name_spans(blob)[2])
        if part is not None:
            parts.append(part)
    newline = np.full(1, 10, dtype=np.uint8)
    held = np.concatenate([piece for blob, _ in parts for piece in (newline, blob)][1:])
    hashes = np.concatenate([hs for _, hs in parts])
    starts, ends = line_spans(held)
    if len(starts) != total or len(hashes) != total:   # a newline in a header name: not in the plain index
        return False
    at = {s: i for i, s in enumerate(shards)}
    listed_as = np.array([at[s] for s in index.shards], dtype=np.uint64)[index.shard_id]
    held_by = np.repeat(np.arange(len(shards), dtype=np.uint64), counts)
    shift = np.uint64(_HASH_BITS)
    ikey = (listed_as << shift) | (index.hashes >> np.uint64(64 - _HASH_BITS))
    hkey = (held_by << shift) | (hashes >> np.uint64(64 - _HASH_BITS))
    iorder = np.argsort(ikey)
    horder = np.argsort(hkey)
    hk = hkey[horder]
    if not np.array_equal(ikey[iorder], hk) or (hk[1:] == hk[:-1]).any():
        return False   # a difference, or two names of a shard with one key: the dict comparison decides
    listed = np.empty_like(iorder)   # the index entry paired with each header name, in header order
    listed[horder] = iorder
    return bool(same_texts(np.frombuffer(index.raw, dtype=np.uint8), index.pairs[listed, 0], index.pairs[listed, 1],
                           held, starts, ends))


def _explain_mismatch(shards, headers, weight_map, *, root, index_source) -> None:
    seen: dict[str, str] = {}
    for s in shards:
        for name in headers[s].tensors:
            if name in seen:
                raise InvalidFileError(f"tensor is in both shard {seen[name]!r} and shard {s!r}",
                                       file=_label(root, s), tensor=name)
            if weight_map is not None:
                listed = weight_map.get(name)
                if listed is None:
                    raise InvalidFileError(f"shard {s!r} holds this tensor but the index does not list it",
                                           file=index_source, tensor=name)
                if listed != s:
                    raise InvalidFileError(f"index lists it in shard {listed!r} but shard {s!r} holds it",
                                           file=index_source, tensor=name)
            seen[name] = s
    for name, s in (weight_map or {}).items():
        if name not in seen:
            raise InvalidFileError(f"index lists it in shard {s!r} but that shard's header does not hold it",
                                   file=index_source, tensor=name)
    raise AssertionError("tensor table mismatch without a culprit")  # pragma: no cover


class TensorTable(Mapping[str, TensorEntry]):
    """Every tensor of a checkpoint by name, in shard then offset order.

    Entries are made on access from the shard headers, rather than stored: a
    K3 has 497,220 tensors and most callers look at a few, or walk them once.
    """

    __slots__ = ("_table", "_headers", "_len")

    def __init__(self, shard_of: dict[str, str] | None, headers: dict[str, Header]):
        self._table = shard_of          # built on first lookup when None (inspect needs none)
        self._headers = headers
        self._len = sum(len(h.tensors) for h in headers.values())

    @property
    def _shard_of(self) -> dict[str, str]:
        table = self._table
        if table is None:   # two threads may both build it: the same table, assigned whole
            table = self._table = _shard_table(self._headers)
        return table

    def __getitem__(self, name: str) -> TensorEntry:
        s = self._shard_of[name]
        h = self._headers[s]
        info = h.tensors[name]
        return TensorEntry(info, s, h.data_start + info.start)

    def __contains__(self, name: object) -> bool:
        return name in self._shard_of

    def __iter__(self) -> Iterator[str]:
        # header order, whatever order the name -> shard table was built in (an index's)
        return itertools.chain.from_iterable(h.tensors for h in self._headers.values())

    def __len__(self) -> int:
        return self._len

    def shard_of(self, name: str) -> str:
        return self._shard_of[name]

    def _walk(self) -> Iterator[tuple[str, TensorEntry]]:
        for s, h in self._headers.items():
            start = h.data_start
            for name, info in h.tensors.items():
                yield name, TensorEntry(info, s, start + info.start)

    def items(self) -> ItemsView[str, TensorEntry]:
        return _Items(self)

    def values(self) -> ValuesView[TensorEntry]:
        return _Values(self)


class _Items(ItemsView):
    def __iter__(self):
        return self._mapping._walk()


class _Values(ValuesView):
    def __iter__(self):
        return (e for _, e in self._mapping._walk())


def _label(root: Path | None, shard: str) -> str:
    return str(root / shard) if root is not None else shard


# ---------------------------------------------------------------------------
# the checkpoint


class Checkpoint:
    """An opened checkpoint: headers in memory, tensor data read on request."""

    def __init__(self, *, root: Path | None, config: dict | None, index_metadata: dict, shards: list[str],
                 headers: dict[str, Header], tensors: Mapping[str, TensorEntry], sources: dict[str, ByteSource],
                 origin: Origin | None = None, hub: Any = None):
        #: where the bytes come from (``io.origin``); local ``root`` unless the opener says otherwise
        self.origin = origin if origin is not None else Origin.local(root)
        #: a Hub source's live handle (``k3ckpt.hub.remote.HubSource``: file listing, transfer
        #: counters); None for local checkpoints.  Provenance questions go to ``origin``.
        self.hub = hub
        self.root = root
        self.config = config
        self.index_metadata = index_metadata
        self.shards = shards
        self.headers = headers
        self.tensors = tensors
        self._sources = sources

    def __repr__(self) -> str:
        where = str(self.root) if self.root is not None else "<sources>"
        return f"<Checkpoint {where}: {len(self.shards)} shards, {len(self.tensors)} tensors>"

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except (KeyError, TypeError):
            raise NotFoundError("no such tensor in the checkpoint", file=self._where(), tensor=str(name)) from None

    def _where(self) -> str:
        return str(self.root) if self.root is not None else "checkpoint"

    def source(self, shard: str) -> ByteSource:
        try:
            return self._sources[shard]
        except KeyError:
            raise NotFoundError(f"no shard {shard!r} in the checkpoint", file=self._where()) from None

    def shard_size(self, shard: str) -> int:
        """File size of a shard, as its header describes it (== the file's size)."""
        self.source(shard)
        return self.headers[shard].file_size

    @property
    def total_size(self) -> int:
        """Sum of tensor data bytes (what an index's ``total_size`` should say)."""
        return sum(e.nbytes for e in self.tensors.values())

    def _range(self, e: TensorEntry, start: int, stop: int | None) -> tuple[int, int]:
        stop = e.nbytes if stop is None else stop
        if not (isinstance(start, (int, np.integer)) and isinstance(stop, (int, np.integer))
                and 0 <= start <= stop <= e.nbytes):
            raise UsageError(f"byte range [{start}, {stop}) is not inside [0, {e.nbytes})", tensor=e.name)
        return int(start), int(stop)

    def _read_into(self, e: TensorEntry, start: int, out: np.ndarray) -> None:
        src = self._sources[e.shard]
        n = out.nbytes
        if n == 0:
            return
        view = memoryview(out.reshape(-1).view(np.uint8))
        if hasattr(src, "pread_into"):
            src.pread_into(e.data_offset + start, view)
        else:
            data = src.pread(e.data_offset + start, n)
            if len(data) != n:
                raise TruncatedFileError(f"short read: wanted {n:,} bytes, got {len(data):,}",
                                         file=_label(self.root, e.shard), tensor=e.name)
            view[:] = data

    def read_bytes(self, name: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of a tensor's data."""
        e = self.entry(name)
        start, stop = self._range(e, start, stop)
        buf = np.empty(stop - start, np.uint8)
        self._read_into(e, start, buf)
        return buf.tobytes()

    @staticmethod
    def _storage(e: TensorEntry) -> tuple[np.dtype, bool]:
        dt = dtypes.lookup(e.dtype)
        if dt.bits % 8:
            return np.dtype(np.uint8), False
        return np.dtype(dt.storage).newbyteorder("<"), True

    def read_raw(self, name: str) -> np.ndarray:
        """The whole tensor as its storage dtype (bytes uninterpreted: BF16 and
        F8 come back as uint16/uint8), shaped; sub-byte dtypes as flat uint8."""
        e = self.entry(name)
        st, shaped = self._storage(e)
        out = np.empty(e.nbytes // st.itemsize, st)
        self._read_into(e, 0, out)
        return out.reshape(e.shape) if shaped else out

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of the first dimension, same dtype rules as ``read_raw``."""
        e = self.entry(name)
        if not e.shape:
            raise ShapeError("a 0-d tensor has no rows", tensor=name)
        rows = e.shape[0]
        if not (isinstance(start, (int, np.integer)) and isinstance(stop, (int, np.integer))
                and 0 <= start <= stop <= rows):
            raise UsageError(f"rows [{start}, {stop}) are not inside [0, {rows})", tensor=name)
        row_bytes = dtypes.lookup(e.dtype).nbytes(e.shape[1:])
        if row_bytes is None:
            raise ShapeError(f"{e.dtype} rows of shape {list(e.shape[1:])} do not end on a byte boundary",
                             tensor=name)
        st, shaped = self._storage(e)
        out = np.empty((int(stop) - int(start)) * row_bytes // st.itemsize, st)
        self._read_into(e, int(start) * row_bytes, out)
        return out.reshape((int(stop) - int(start),) + e.shape[1:]) if shaped else out

    def iter_chunks(self, name: str, chunk_bytes: int = 64 << 20) -> Iterator[bytes]:
        """The tensor's bytes in order, at most ``chunk_bytes`` at a time."""
        e = self.entry(name)
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise UsageError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        for pos in range(0, e.nbytes, chunk_bytes):
            yield self.read_bytes(name, pos, min(pos + chunk_bytes, e.nbytes))

    def close(self) -> None:
        for s in self._sources.values():
            s.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def checkpoint_of_files(entries: Mapping[str, TensorEntry]) -> Checkpoint:
    """A checkpoint of just these tensors, each entry's ``shard`` the path of the file that holds it:
    what a worker reads of its task, by path, without opening the whole source (close it after)."""
    paths = sorted({e.shard for e in entries.values()})
    return Checkpoint(root=None, config=None, index_metadata={}, shards=paths, headers={}, tensors=dict(entries),
                      sources={p: LocalFile(p) for p in paths})


def open_checkpoint(path: str | os.PathLike, *, opener: Callable[[str], ByteSource] | None = None) -> Checkpoint:
    """Open a folder with an index, a single ``.safetensors`` file, or a folder
    of ``*.safetensors`` (no index).  ``opener(shard_name)`` may supply the
    shard bytes (e.g. remote); by default they are local files, checked to stay
    inside the folder."""
    path = Path(path)
    if not path.exists():
        raise NotFoundError("no such file or folder", file=str(path))
    if path.is_dir():
        root = path
        index_path = path / INDEX_NAME
        if index_path.is_file():
            index_json = _load_json_file(index_path, what="index JSON", index=True)
            index_parts = _index_shards(index_json, source=str(index_path))
            names = sorted(index_parts[1], key=_natural_key)
        else:
            index_json = index_parts = None
            names = sorted((p.name for p in path.glob("*.safetensors") if not p.name.startswith(".")),
                           key=_natural_key)
            if not names:
                raise NotFoundError(f"no {INDEX_NAME} and no *.safetensors files", file=str(path))
        index_source = str(index_path)
    else:
        root = path.parent
        index_json = index_parts = None
        names = [path.name]
        index_source = str(path)

    config = None
    if (root / CONFIG_NAME).is_file():
        config = load_config(root / CONFIG_NAME)

    def local(name: str) -> ByteSource:
        p = resolve_inside(root, name, source=index_source) if path.is_dir() else path
        if not p.is_file():
            raise NotFoundError(f"shard {name!r} is missing", file=str(p))
        return LocalFile(p, name=name)

    get = opener or local
    sources: dict[str, ByteSource] = {}
    try:
        for n in names:
            sources[n] = get(n)
    except BaseException:
        for s in sources.values():
            s.close()
        raise
    try:
        ckpt = _checkpoint_from_sources(index_json, sources, config, root=root, index_source=index_source,
                                        parsed={}, index_parts=index_parts)
    except BaseException:
        for s in sources.values():
            s.close()
        raise
    ckpt.origin = Origin.local(path)
    return ckpt
