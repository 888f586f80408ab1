"""Reading GGUF files (one file or a llama.cpp split set), for ``inspect`` and ``dequant``.

The ``gguf`` package's ``GGUFReader`` parses each file and ``gguf.quants.dequantize``
decodes its tensors: both are independent of our writer and kernels, which is the
point of reading back what we wrote.  ``GGUFReader`` trusts the file (an array length
past the end of the file makes it loop for as long as the length says), so each file's
header is first walked here with every length checked against the file size, as ggml's
``gguf.cpp`` checks it; a file that fails is one ``InvalidFileError`` line
(``TruncatedFileError`` when it ends early), never a traceback.

Splits are found as llama.cpp names them (``PREFIX-00002-of-00005.gguf``, any of them
may be given); every split must be there and agree on ``split.count`` and
``split.tensors.count``.  The metadata is the first split's.  Nothing here reads tensor
data except ``GGUFSet.read_rows`` (``os.pread``: the memory maps are only for headers).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidFileError, NotFoundError, TruncatedFileError, UnsupportedError, UsageError
from .container import ARRAY, MAGIC, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT, STRING, UINT32, pad, split_name

SUPPORTED_VERSIONS = (2, 3)        # what gguf-py's reader takes (READER_SUPPORTED_VERSIONS)
MAX_DIMS = 4                       # ggml's GGML_MAX_DIMS
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # enum gguf_type
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5,})-of-(?P<count>\d{5,})\.gguf$")


def is_gguf_path(src) -> bool:
    """``src`` names a GGUF file: it ends in ``.gguf``, or is a file that starts with the magic."""
    p = Path(src)
    if p.name.lower().endswith(".gguf"):
        return True
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(4) == MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor as a GGUF file lists it. ``shape`` is numpy order (outermost first): the reverse
    of the file's ``ne``, and what safetensors stores."""

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]
    params: int              # elements (logical weights)
    nbytes: int
    file: str                # the file's name (its split)
    offset: int              # absolute file offset of the data

    @property
    def row_bytes(self) -> int:
        rows = 1
        for d in self.shape[:-1]:
            rows *= d
        return self.nbytes // rows if rows else 0


@dataclass(frozen=True)
class GGUFFile:
    name: str
    size: int                # file bytes
    tensors: int
    split_no: int


class _Walk:
    """A bounded walk over one file's header (``gguf.cpp``'s checks): no length may pass the
    end of the file.  Returns the tensor infos (name, type, ne, relative offset) and alignment."""

    def __init__(self, buf, size: int, path: str):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise TruncatedFileError(f"the file ends inside its GGUF header ({what} at byte {self.pos:,}; "
                                     f"the file has {self.size:,} bytes)", file=self.path)

    def take(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return out if len(out) > 1 else out[0]

    def string(self, what: str) -> bytes:
        n = self.take("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw

    def value(self, kind: int, key: str, *, in_array: bool = False) -> Any:
        if kind == STRING:
            return self.string(f"string value of {key!r}")
        if kind in _SCALAR_BYTES:
            n = _SCALAR_BYTES[kind]
            self.need(n, f"value of {key!r}")
            raw = bytes(self.buf[self.pos:self.pos + n])
            self.pos += n
            return raw
        if kind == ARRAY and not in_array:
            item, count = self.take("<IQ", f"array header of {key!r}")
            if item == ARRAY:
                raise InvalidFileError(f"metadata {key!r} is an array of arrays, which ggml does not read",
                                       file=self.path)
            if item in _SCALAR_BYTES:
                self.need(count * _SCALAR_BYTES[item], f"{count:,} array items of {key!r}")
                self.pos += count * _SCALAR_BYTES[item]
            elif item == STRING:
                self.need(count * 8, f"{count:,} strings of {key!r}")   # each at least its length
                for _ in range(count):
                    self.pos += 8
                    n = struct.unpack_from("<Q", self.buf, self.pos - 8)[0]
                    self.need(n, f"a string of {key!r}")
                    self.pos += n
            else:
                raise InvalidFileError(f"metadata {key!r}: unknown array item type {item}", file=self.path)
            return None
        raise InvalidFileError(f"metadata {key!r}: unknown value type {kind}", file=self.path)

    def run(self):
        import gguf

        magic, version = self.take("<4sI", "magic and version")
        if magic != MAGIC:
            raise InvalidFileError("not a GGUF file (no GGUF magic)", file=self.path)
        if version & 0xFFFF == 0 and version:
            raise UnsupportedError("a big-endian GGUF file; k3ckpt reads little-endian GGUF", file=self.path)
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedError(f"GGUF version {version}; k3ckpt reads versions "
                                   f"{', '.join(map(str, SUPPORTED_VERSIONS))}", file=self.path)
        n_tensors, n_kv = self.take("<QQ", "tensor and metadata counts")
        # every entry takes at least 12 bytes: refuse counts the file cannot hold before looping on them
        self.need((n_tensors + n_kv) * 12, f"{n_tensors:,} tensor infos and {n_kv:,} metadata entries")
        alignment, keys = 32, set()
        for _ in range(n_kv):
            key = self.string("a metadata key").decode("utf-8", "replace")
            if key in keys:
                raise InvalidFileError(f"metadata key {key!r} appears twice", file=self.path)
            keys.add(key)
            kind = self.take("<I", f"type of {key!r}")
            raw = self.value(kind, key)
            if key == "general.alignment":
                if kind != UINT32:
                    raise InvalidFileError("general.alignment is not a UINT32", file=self.path)
                alignment = struct.unpack("<I", raw)[0]
                if alignment == 0 or alignment & (alignment - 1):
                    raise InvalidFileError(f"general.alignment {alignment} is not a power of two", file=self.path)
        infos, names = [], set()
        for _ in range(n_tensors):
            name = self.string("a tensor name").decode("utf-8", "replace")
            if name in names:
                raise InvalidFileError(f"tensor {name!r} is listed twice", file=self.path)
            names.add(name)
            n_dims = self.take("<I", f"dims of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise InvalidFileError(f"tensor {name!r} has {n_dims} dims (ggml takes 1 to {MAX_DIMS})",
                                       file=self.path)
            ne = self.take(f"<{n_dims}Q", f"dims of tensor {name!r}")
            ne = (ne,) if n_dims == 1 else tuple(ne)
            ggml_type, offset = self.take("<IQ", f"type and offset of tensor {name!r}")
            try:
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise UnsupportedError(f"tensor {name!r} has ggml type {ggml_type}, which the gguf package "
                                       "does not know", file=self.path) from None
            if ne[0] % block:
                raise InvalidFileError(f"tensor {name!r}: rows of {ne[0]} values do not split into blocks of "
                                       f"{block}", file=self.path)
            numel = 1
            for d in ne:
                numel *= d
            infos.append((name, ggml_type, ne, offset, numel // block * size))
        data = pad(self.pos, alignment)
        for name, _, _, offset, nbytes in infos:
            if offset % alignment:
                raise InvalidFileError(f"tensor {name!r}: data offset {offset} is not a multiple of the "
                                       f"alignment {alignment}", file=self.path)
            end = data + offset + nbytes
            if end > self.size:
                raise TruncatedFileError(f"tensor {name!r} ends at byte {end:,} but the file has {self.size:,} "
                                         "bytes (truncated?)", file=self.path)
        return infos


def _walk_header(path: Path) -> None:
    size = path.stat().st_size
    if size < 8:
        raise InvalidFileError(f"not a GGUF file ({size} bytes)", file=str(path))
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise InvalidFileError("not a GGUF file (no GGUF magic)", file=str(path))
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            _Walk(mm, size, str(path)).run()


def _reader(path: Path):
    """``gguf.GGUFReader`` of a file whose header ``_walk_header`` passed."""
    import gguf

    _walk_header(path)
    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:   # what the walk does not check
        raise InvalidFileError(f"the gguf package cannot read it: {exc}", file=str(path)) from None


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


class GGUFSet:
    """One GGUF file or a whole split set, opened (``open_gguf``).  ``kv`` holds the first
    split's metadata fields (``gguf.ReaderField``); ``tensors`` every tensor in file order."""

    def __init__(self, paths: list[Path], readers: list):
        self.paths = tuple(paths)
        self._readers = readers
        self.kv = {k: f for k, f in readers[0].fields.items() if not k.startswith("GGUF.")}
        self.version = int(_field(readers[0], "GGUF.version"))
        self.alignment = int(readers[0].alignment)
        tensors: dict[str, GGUFTensor] = {}
        files = []
        for p, r in zip(paths, readers):
            for t in r.tensors:
                if t.name in tensors:
                    raise InvalidFileError(f"tensor {t.name!r} is in {tensors[t.name].file} and in {p.name}",
                                           file=str(p))
                tensors[t.name] = GGUFTensor(t.name, int(t.tensor_type), t.tensor_type.name,
                                             tuple(int(d) for d in t.shape[::-1]), int(t.n_elements),
                                             int(t.n_bytes), p.name, int(t.data_offset))
            files.append(GGUFFile(p.name, p.stat().st_size, len(r.tensors), int(_field(r, SPLIT_NO) or 0)))
        self.tensors = tensors
        self.files = tuple(files)
        self._fds: dict[str, int] = {}

    def value(self, key: str, default=None):
        """The metadata value of ``key`` (a list for arrays), or ``default``."""
        f = self.kv.get(key)
        return default if f is None else f.contents()

    def array_len(self, key: str) -> int | None:
        """Items of an array key without building them (the vocabulary has 163,840)."""
        f = self.kv.get(key)
        return None if f is None else len(f.data)

    @property
    def architecture(self) -> str | None:
        return self.value("general.architecture")

    def read_rows(self, tensor: GGUFTensor, r0: int, r1: int) -> bytes:
        """Bytes of rows ``[r0, r1)`` of ``tensor`` (rows: its flattened outer dims)."""
        if tensor.file not in self._fds:
            path = next(p for p in self.paths if p.name == tensor.file)
            self._fds[tensor.file] = os.open(path, os.O_RDONLY)
        fd, rb = self._fds[tensor.file], tensor.row_bytes
        want, at, parts = (r1 - r0) * rb, tensor.offset + r0 * rb, []
        while want:
            got = os.pread(fd, want, at)
            if not got:
                raise TruncatedFileError("the file ended while reading it", file=tensor.file, tensor=tensor.name)
            parts.append(got)
            want -= len(got)
            at += len(got)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._readers.clear()    # drops the memory maps

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _split_keys(reader, path: Path) -> tuple[int, int, int | None]:
    """(split.no, split.count, split.tensors.count) of one file; a file without them is 0 of 1."""
    no, count, total = (_field(reader, k) for k in (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT))
    if count is None:
        if no is not None:
            raise InvalidFileError(f"has {SPLIT_NO} but no {SPLIT_COUNT}", file=str(path))
        return 0, 1, None
    no = 0 if no is None else int(no)
    if not 0 <= no < int(count):
        raise InvalidFileError(f"{SPLIT_NO} {no} is not below {SPLIT_COUNT} {count}", file=str(path))
    return no, int(count), None if total is None else int(total)


def open_gguf(path: str | os.PathLike) -> GGUFSet:
    """Open a GGUF file, or the whole split set any of its splits belongs to (module docstring)."""
    path = Path(path)
    if not path.exists():
        raise NotFoundError("no such GGUF file", file=str(path))
    if not path.is_file():
        raise UsageError("is not a file; give a .gguf file (any split of a set)", file=str(path))
    first = _reader(path)
    no, count, total = _split_keys(first, path)
    m = _SPLIT.match(path.name)
    if count == 1:
        if m and int(m["count"]) > 1:
            raise InvalidFileError(f"is named as split {int(m['no'])} of {int(m['count'])} but has no "
                                   f"{SPLIT_COUNT} key", file=str(path))
        return GGUFSet([path], [first])
    if m is None or int(m["count"]) != count or int(m["no"]) != no + 1:
        raise InvalidFileError(f"is split {no + 1} of {count} by its {SPLIT_NO}/{SPLIT_COUNT} keys, which its "
                               f"name does not say (llama.cpp names splits PREFIX-{no + 1:05d}-of-{count:05d}.gguf)",
                               file=str(path))
    paths = [path.with_name(split_name(m["prefix"], i, count)) for i in range(count)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise NotFoundError(f"{len(missing)} of {count} splits missing beside {path.name}, first {missing[0]}",
                            file=str(path.parent))
    readers = []
    for i, p in enumerate(paths):
        r = first if p == path else _reader(p)
        sno, scount, stotal = _split_keys(r, p)
        if scount != count:
            raise InvalidFileError(f"has {SPLIT_COUNT} {scount} where {path.name} has {count}", file=str(p))
        if sno != i:
            raise InvalidFileError(f"has {SPLIT_NO} {sno} (split {sno + 1}) but is named as split {i + 1}",
                                   file=str(p))
        if stotal != total:
            raise InvalidFileError(f"has {SPLIT_TENSORS_COUNT} {stotal} where {path.name} has {total}", file=str(p))
        readers.append(r)
    found = sum(len(r.tensors) for r in readers)
    if total is not None and found != total:
        raise InvalidFileError(f"the {count} splits hold {found} tensors, {SPLIT_TENSORS_COUNT} says {total}",
                               file=str(paths[0]))
    return GGUFSet(paths, readers)


# ------------------------------------------------------------------ metadata as JSON
def _json_value(field) -> Any:
    """One field value for JSON: strings that are not UTF-8 as ``{"hex": ...}``, so nothing is lost."""
    import gguf

    main = field.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [_text(bytes(field.parts[i])) for i in field.data]
        return field.contents()
    if main == gguf.GGUFValueType.STRING:
        return _text(bytes(field.parts[-1]))
    return field.contents()


def _text(raw: bytes):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": raw.hex()}


def type_label(field) -> str:
    """``UINT32``, ``STRING``, ``ARRAY[INT32]``: a field's GGUF value type as gguf-py names it."""
    import gguf

    if field.types[0] != gguf.GGUFValueType.ARRAY:
        return field.types[0].name
    # parts: key length, key, value type, item type, length, items (an empty array has no item types)
    return f"ARRAY[{gguf.GGUFValueType(int(field.parts[3][0])).name}]"


def metadata_json(gs: GGUFSet) -> dict[str, Any]:
    """Every metadata key of the set with its GGUF type and value (arrays in full)."""
    return {k: {"type": type_label(f), "value": _json_value(f)} for k, f in gs.kv.items()}
