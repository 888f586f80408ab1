"""llama.cpp importance matrices (``llama-imatrix`` output): the GGUF kind and the legacy ``.dat``.

``read_imatrix(path)`` reads a file's index (names, shapes, counts, metadata) and
returns an ``Imatrix``; ``Imatrix.entry(name)`` reads one weight's values from the
file when asked, so memory stays at one weight's importance (a K3 expert tensor's
is 896 x 7168 floats), never the model's.

Values are what ``llama-quantize`` hands its quantizers (tools/quantize/quantize.cpp
``load_imatrix``, common/imatrix-loader.cpp):

- **GGUF** (``general.type`` = ``imatrix``): per weight ``<name>.in_sum2`` F32
  ``{n_per_row, n_mat}`` (numpy ``[n_mat, n_per_row]``: sums of squared
  activations per column, one row per expert) and ``<name>.counts`` F32
  ``{1, n_mat}`` (tokens seen per expert, read rounded to the nearest integer);
  each expert's row is divided by its count in float32, and an expert with count
  0 gets all ones.  Metadata ``imatrix.datasets`` (strings),
  ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32).
- **legacy** ``.dat``, little-endian: int32 entry count; per entry int32 name
  length, the name's bytes, int32 ``ncall``, int32 ``nval``, ``nval`` float32
  (already ``mean * ncall``); then, optionally, int32 chunk count, int32 dataset
  name length and the name.  Values are divided by ``ncall`` (kept when
  ``ncall <= 0``); the file does not say how many experts an entry holds, so its
  values are one row of ``nval`` (``Imatrix.columns`` splits it by the weight's
  row length).

Every malformed file is one ``InvalidFileError`` naming the file and what is wrong.
"""

from __future__ import annotations

import math
import struct
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

from .errors import InvalidFileError, NotFoundError, UsageError

__all__ = ["Imatrix", "ImatrixEntry", "read_imatrix"]

GGUF_MAGIC = b"GGUF"
MAX_NAME = 1 << 16          # bytes of a legacy entry name: llama.cpp's names are < 64
SUM2, COUNTS = ".in_sum2", ".counts"


@dataclass(frozen=True)
class ImatrixEntry:
    """One weight's importance: ``values`` float32 ``[n_mat, n_per_row]`` (read-only), the mean
    squared activation per input column, one row per expert (GGUF) or all of it in one row (legacy);
    ``counts`` the tokens per expert (GGUF) or ``(ncall,)`` (legacy)."""

    name: str
    values: np.ndarray
    counts: tuple[int, ...]

    @property
    def n_mat(self) -> int:
        return int(self.values.shape[0])

    @property
    def n_per_row(self) -> int:
        return int(self.values.shape[1])


@dataclass(frozen=True)
class _Ref:
    """Where an entry's numbers are in the file."""

    offset: int                    # of the float32 values
    shape: tuple[int, int]         # [n_mat, n_per_row]
    counts: tuple[int, ...]
    divide: bool                   # GGUF: divide each row by its count; legacy: by ncall


@dataclass(frozen=True)
class Imatrix:
    """An importance-matrix file's index and metadata; ``entry`` / ``columns`` read values."""

    path: str
    kind: str                          # "gguf" or "legacy"
    datasets: tuple[str, ...]
    chunk_count: int
    chunk_size: int                    # 0 in the legacy kind
    _refs: Mapping[str, _Ref] = field(repr=False)

    @property
    def names(self) -> tuple[str, ...]:
        """The weights it covers, sorted."""
        return tuple(sorted(self._refs))

    def __contains__(self, name: object) -> bool:
        return name in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    def entry(self, name: str) -> ImatrixEntry:
        """The importance of weight ``name``, normalised as llama-quantize does (module docstring)."""
        ref = self._ref(name)
        n_mat, n_per_row = ref.shape
        raw = np.fromfile(self.path, dtype="<f4", count=n_mat * n_per_row, offset=ref.offset)
        if raw.size != n_mat * n_per_row:
            raise InvalidFileError(f"entry {name!r} ends past the end of the file", file=self.path)
        raw = raw.astype(np.float32).reshape(n_mat, n_per_row)
        if not np.isfinite(raw).all():
            raise InvalidFileError(f"entry {name!r} holds non-finite values", file=self.path)
        if ref.divide:
            out = np.ones_like(raw)
            for j, c in enumerate(ref.counts):
                if c > 0:
                    out[j] = raw[j] / np.float32(c)
        else:
            ncall = ref.counts[0]
            out = raw / np.float32(ncall) if ncall > 0 else raw
        out = out.astype(np.float32)
        out.flags.writeable = False
        return ImatrixEntry(name, out, ref.counts)

    def matrices(self, name: str, k: int) -> int:
        """How many matrices of rows of ``k`` values entry ``name`` holds (from the index, nothing
        read).  Raises ``NotFoundError`` without the entry, ``UsageError`` when ``k`` does not fit."""
        ref = self._ref(name)
        total = ref.shape[0] * ref.shape[1]
        if k <= 0 or total % k:
            raise UsageError(f"importance entry {name!r} has {total} values, not a multiple of rows of {k}",
                             file=self.path)
        return total // k

    def columns(self, name: str, k: int, expert: int | None = None) -> np.ndarray:
        """float32 ``[k]``: the importance per input column for a weight ``name`` whose rows hold
        ``k`` values; ``expert`` picks one matrix of a stacked expert tensor (needed when there are
        several).  Reads those ``k`` values only, normalised as ``entry`` normalises them.  Raises
        ``UsageError`` when the entry does not fit ``k`` / ``expert``."""
        n = self.matrices(name, k)
        ref = self._refs[name]
        if expert is None:
            if n != 1:
                raise UsageError(f"importance entry {name!r} holds {n} matrices of {k}: pass expert=", file=self.path)
            expert = 0
        if not 0 <= expert < n:
            raise UsageError(f"importance entry {name!r} holds {n} matrices of {k}, no expert {expert}",
                             file=self.path)
        start = expert * k
        raw = np.fromfile(self.path, dtype="<f4", count=k, offset=ref.offset + 4 * start).astype(np.float32)
        if raw.size != k:
            raise InvalidFileError(f"entry {name!r} ends past the end of the file", file=self.path)
        if not np.isfinite(raw).all():
            raise InvalidFileError(f"entry {name!r} holds non-finite values", file=self.path)
        if ref.divide:     # each value by the count of the matrix row it sits in; count 0: all ones
            counts = np.asarray(ref.counts, np.float32)[(start + np.arange(k)) // ref.shape[1]]
            with np.errstate(divide="ignore", invalid="ignore"):
                out = np.where(counts > 0, raw / counts, np.float32(1)).astype(np.float32)
        else:
            ncall = ref.counts[0]
            out = raw / np.float32(ncall) if ncall > 0 else raw
        out = out.astype(np.float32)
        out.flags.writeable = False
        return out

    def _ref(self, name: str) -> _Ref:
        ref = self._refs.get(name)
        if ref is None:
            close = [n for n in self.names if name.split(".")[-1] in n][:3]
            hint = f"; entries like {', '.join(close)}" if close else ""
            raise NotFoundError(f"no importance entry {name!r} ({len(self)} entries{hint})", file=self.path)
        return ref


def read_imatrix(path) -> Imatrix:
    """Read the index of llama.cpp importance-matrix file ``path`` (GGUF or legacy ``.dat``).

    Raises:
        NotFoundError: no such file.
        InvalidFileError: anything malformed, in one line.
    """
    p = Path(path)
    if not p.is_file():
        raise NotFoundError("no such importance-matrix file", file=str(p))
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        return _read_gguf(p)
    return _read_legacy(p)


# ---------------------------------------------------------------------- GGUF
def _read_gguf(p: Path) -> Imatrix:
    import gguf

    try:
        reader = gguf.GGUFReader(p, "r")
    except Exception as exc:  # noqa: BLE001 - gguf-py raises assorted errors for bad files
        raise InvalidFileError(f"not a readable GGUF file ({type(exc).__name__}: {exc})", file=str(p)) from None
    kind = _kv_str(reader, "general.type", p)
    if kind != "imatrix":
        raise InvalidFileError(f"not an importance matrix: general.type is {kind!r}, not 'imatrix'", file=str(p))
    datasets = _kv_strs(reader, "imatrix.datasets", p)
    chunk_count = _kv_u32(reader, "imatrix.chunk_count", p)
    chunk_size = _kv_u32(reader, "imatrix.chunk_size", p)
    found: dict[str, dict[str, object]] = {}
    for t in reader.tensors:
        for suffix in (SUM2, COUNTS):
            if t.name.endswith(suffix) and len(t.name) > len(suffix):
                if t.tensor_type != gguf.GGMLQuantizationType.F32:
                    raise InvalidFileError(f"tensor {t.name!r} is {t.tensor_type.name}, not F32", file=str(p))
                found.setdefault(t.name[: -len(suffix)], {})[suffix] = t
    if not found:
        raise InvalidFileError("no <weight>.in_sum2 / <weight>.counts tensors: no importance data", file=str(p))
    refs = {}
    for name, pair in found.items():
        if set(pair) != {SUM2, COUNTS}:
            missing = COUNTS if SUM2 in pair else SUM2
            raise InvalidFileError(f"weight {name!r} has no {missing} tensor", file=str(p))
        sums, counts = pair[SUM2], pair[COUNTS]
        n_per_row, n_mat = _dims2(sums, p)
        c1, c_mat = _dims2(counts, p)
        if c1 != 1 or c_mat != n_mat:
            raise InvalidFileError(f"{counts.name!r} is {{{c1}, {c_mat}}}, expected {{1, {n_mat}}} for "
                                   f"{sums.name!r} {{{n_per_row}, {n_mat}}}", file=str(p))
        cvals = np.asarray(counts.data, dtype=np.float32).reshape(-1)
        if not np.isfinite(cvals).all() or (cvals < 0).any():
            raise InvalidFileError(f"{counts.name!r} holds negative or non-finite counts", file=str(p))
        refs[name] = _Ref(int(sums.data_offset), (n_mat, n_per_row),
                          tuple(int(math.floor(float(c) + 0.5)) for c in cvals), True)   # lround
    return Imatrix(str(p), "gguf", datasets, chunk_count, chunk_size, types.MappingProxyType(refs))


def _dims2(t, p: Path) -> tuple[int, int]:
    dims = [int(d) for d in t.shape]
    if len(dims) == 1:
        dims.append(1)
    if len(dims) != 2 or min(dims) < 1:
        raise InvalidFileError(f"tensor {t.name!r} has shape {dims}, expected two dimensions", file=str(p))
    return dims[0], dims[1]


def _field(reader, key: str):
    return reader.fields.get(key)


def _kv_str(reader, key: str, p: Path) -> str | None:
    f = _field(reader, key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # noqa: BLE001
        raise InvalidFileError(f"metadata {key} is not a string", file=str(p)) from None


def _kv_strs(reader, key: str, p: Path) -> tuple[str, ...]:
    f = _field(reader, key)
    if f is None:
        return ()
    v = f.contents()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise InvalidFileError(f"metadata {key} is not an array of strings", file=str(p))
    return tuple(v)


def _kv_u32(reader, key: str, p: Path) -> int:
    f = _field(reader, key)
    if f is None:
        return 0
    v = f.contents()
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise InvalidFileError(f"metadata {key} is not a non-negative integer", file=str(p))
    return int(v)


# -------------------------------------------------------------------- legacy
def _read_legacy(p: Path) -> Imatrix:
    size = p.stat().st_size
    with open(p, "rb") as f:
        def take(n: int, what: str) -> bytes:
            b = f.read(n)
            if len(b) != n:
                raise InvalidFileError(f"legacy importance matrix ends inside {what}", file=str(p))
            return b

        def i32(what: str) -> int:
            return struct.unpack("<i", take(4, what))[0]

        if size < 4:
            raise InvalidFileError("not an importance matrix: shorter than its entry count", file=str(p))
        n = i32("the entry count")
        if n < 1:
            raise InvalidFileError(f"not an importance matrix: entry count {n}", file=str(p))
        refs: dict[str, _Ref] = {}
        for i in range(n):
            length = i32(f"entry {i}'s name length")
            if not 0 < length <= MAX_NAME:
                raise InvalidFileError(f"entry {i}: name length {length} (not a legacy importance matrix?)",
                                       file=str(p))
            try:
                name = take(length, f"entry {i}'s name").decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidFileError(f"entry {i}: name is not UTF-8", file=str(p)) from None
            ncall = i32(f"entry {name!r}'s call count")
            nval = i32(f"entry {name!r}'s value count")
            if nval < 1:
                raise InvalidFileError(f"entry {name!r}: {nval} values", file=str(p))
            offset = f.tell()
            if offset + 4 * nval > size:
                raise InvalidFileError(f"legacy importance matrix ends inside entry {name!r}'s values",
                                       file=str(p))
            if name in refs:
                raise InvalidFileError(f"entry {name!r} appears twice", file=str(p))
            refs[name] = _Ref(offset, (1, nval), (ncall,), False)
            f.seek(offset + 4 * nval)
        chunk_count, datasets = 0, ()
        rest = size - f.tell()
        if rest:
            chunk_count = i32("the chunk count")
            if f.tell() < size:
                length = i32("the dataset name length")
                if length < 0 or f.tell() + length != size:
                    raise InvalidFileError(f"dataset name of {length} bytes does not end the file", file=str(p))
                if length:
                    try:
                        datasets = (take(length, "the dataset name").decode("utf-8"),)
                    except UnicodeDecodeError:
                        raise InvalidFileError("dataset name is not UTF-8", file=str(p)) from None
    return Imatrix(str(p), "legacy", datasets, chunk_count, 0, types.MappingProxyType(refs))
