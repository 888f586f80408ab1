"""GGUF v3 container bytes: key-value metadata, tensor infos, splits.

Everything a GGUF file holds before its tensor data is fixed here, from the
metadata and the list of tensors alone, so a writer knows every tensor's final
offset before any data exists and can stream data in (docs/formats/gguf.md).
The layout follows ggml's ``gguf.cpp`` (the reader llama.cpp uses): little
endian, strings as u64 length + UTF-8, tensor dims innermost first, data offsets
relative to the aligned start of the data section, each tensor padded to the
alignment.  Splits follow llama.cpp's ``gguf-split``: all metadata in the first
file, ``split.no`` / ``split.count`` / ``split.tensors.count`` in every file,
files named ``PREFIX-00001-of-00003.gguf``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import ShapeError, UsageError

MAGIC = b"GGUF"
VERSION = 3
DEFAULT_ALIGNMENT = 32            # ggml's GGUF_DEFAULT_ALIGNMENT

# GGUF value types (ggml gguf.h, enum gguf_type), and their struct codes.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
           BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"


@dataclass(frozen=True, slots=True)
class KV:
    """One metadata entry. ``kind`` is a GGUF value type; arrays give ``item_kind``."""

    key: str
    kind: int
    value: Any
    item_kind: int | None = None

    def __post_init__(self) -> None:
        if not self.key or not isinstance(self.key, str):
            raise UsageError(f"GGUF metadata key must be a non-empty string, got {self.key!r}")
        if self.kind == ARRAY:
            if self.item_kind is None or self.item_kind == ARRAY:
                raise UsageError(f"GGUF array {self.key!r} needs a scalar or string item type")
        elif self.kind not in _SCALAR and self.kind != STRING:
            raise UsageError(f"GGUF metadata {self.key!r}: unknown value type {self.kind}")

    def encode(self) -> bytes:
        out = [_string(self.key), struct.pack("<I", self.kind)]
        if self.kind == ARRAY:
            items = list(self.value)
            out.append(struct.pack("<IQ", self.item_kind, len(items)))
            out.extend(_value(self.item_kind, v) for v in items)
        else:
            out.append(_value(self.kind, self.value))
        return b"".join(out)


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, v: Any) -> bytes:
    if kind == STRING:
        return _string(v)
    return struct.pack(_SCALAR[kind], v)


def type_sizes(ggml_type: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type, from the gguf package's table."""
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise UsageError(f"unknown ggml type {ggml_type}") from None


def type_name(ggml_type: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(ggml_type).name


def type_id(name: str) -> int:
    """ggml's type id of its name (``"IQ2_XS"`` -> 17)."""
    import gguf

    return int(gguf.GGMLQuantizationType[name])


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor as GGUF stores it. ``shape`` is numpy order (outermost first), as the
    ``gguf`` package takes it; the file stores the reverse (ggml's ``ne``)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not self.name or len(self.name.encode("utf-8")) >= 64:
            raise UsageError(f"GGUF tensor name must be 1-63 bytes (ggml's GGML_MAX_NAME), got {self.name!r}")
        if not 1 <= len(self.shape) <= 4 or any(d <= 0 for d in self.shape):
            raise ShapeError(f"GGUF tensors have 1-4 positive dims, got {self.shape}", tensor=self.name)
        block, _ = type_sizes(self.ggml_type)
        if self.shape[-1] % block:
            raise ShapeError(f"rows of {self.shape[-1]} values do not split into {type_name(self.ggml_type)} "
                             f"blocks of {block}", tensor=self.name)

    @property
    def row_bytes(self) -> int:
        block, size = type_sizes(self.ggml_type)
        return self.shape[-1] // block * size

    @property
    def nbytes(self) -> int:
        rows = 1
        for d in self.shape[:-1]:
            rows *= d
        return rows * self.row_bytes

    def encode(self, offset: int) -> bytes:
        dims = self.shape[::-1]
        return (_string(self.name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                + struct.pack("<IQ", self.ggml_type, offset))


def pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class FileLayout:
    """One GGUF file: its header bytes (through the padding before the data) and where each
    tensor's data starts, as an absolute file offset."""

    header: bytes
    tensors: tuple[TensorInfo, ...]
    offsets: tuple[int, ...]
    size: int                                   # whole file, data padding included
    index: dict[str, int] = field(repr=False)   # tensor name -> position

    @classmethod
    def build(cls, kvs: Sequence[KV], tensors: Sequence[TensorInfo], alignment: int = DEFAULT_ALIGNMENT):
        if alignment <= 0 or alignment % 8:
            raise UsageError(f"GGUF alignment must be a positive multiple of 8, got {alignment}")
        seen: dict[str, int] = {}
        for i, t in enumerate(tensors):
            if t.name in seen:
                raise UsageError(f"GGUF tensor {t.name!r} listed twice")
            seen[t.name] = i
        keys = [kv.key for kv in kvs]
        if len(set(keys)) != len(keys):
            raise UsageError(f"GGUF metadata keys repeat: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
        rel, at = [], 0
        for t in tensors:
            rel.append(at)
            at += pad(t.nbytes, alignment)
        head = [MAGIC, struct.pack("<IQQ", VERSION, len(tensors), len(kvs))]
        head += [kv.encode() for kv in kvs]
        head += [t.encode(o) for t, o in zip(tensors, rel)]
        body = b"".join(head)
        start = pad(len(body), alignment)
        header = body + b"\0" * (start - len(body))
        return cls(header, tuple(tensors), tuple(start + o for o in rel), start + at, seen)


def split_name(prefix: str, no: int, count: int) -> str:
    """llama.cpp's ``llama_split_path``: ``PREFIX-%05d-of-%05d.gguf``, ``no`` counted from 0."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def plan_splits(tensors: Sequence[TensorInfo], max_bytes: int | None,
                alignment: int = DEFAULT_ALIGNMENT) -> list[list[TensorInfo]]:
    """Tensors in order, cut before a tensor that would take a split's data past ``max_bytes``
    (gguf-split's ``--split-max-size`` rule: padded tensor sizes, metadata not counted; a
    tensor larger than the limit gets a split of its own)."""
    if max_bytes is None:
        return [list(tensors)]
    if max_bytes <= 0:
        raise UsageError(f"--split-max-size must be positive, got {max_bytes}")
    splits: list[list[TensorInfo]] = [[]]
    size = 0
    for t in tensors:
        n = pad(t.nbytes, alignment)
        if splits[-1] and size + n > max_bytes:
            splits.append([])
            size = 0
        splits[-1].append(t)
        size += n
    return splits


def split_kvs(kvs: Sequence[KV], no: int, count: int, total_tensors: int) -> list[KV]:
    """The metadata of split ``no``: everything in the first, then the split keys (as gguf-split
    writes them: u16, u16, i32). A single file carries no split keys, as the converter writes it."""
    if count == 1:
        return list(kvs)
    own = list(kvs) if no == 0 else []
    return own + [KV(SPLIT_NO, UINT16, no), KV(SPLIT_COUNT, UINT16, count),
                  KV(SPLIT_TENSORS_COUNT, INT32, total_tensors)]
