"""Streaming, atomic GGUF writer: one file or llama.cpp-style splits.

The whole layout (every split's header and every tensor's offset) is fixed from
the metadata and tensor list before any data is written, so tensor data can be
streamed in pieces (a 3-D expert tensor one expert at a time) and never has to
be held whole.  Each split is written as a hidden partial file beside its final
name, sized up front, and renamed (after fsync, mode 0644) once every byte of
every tensor in it has arrived; an error or ``abort()`` removes the partial
files and never touches a final name.  ``done_splits`` lets a resumed run keep
splits an earlier run finished: their headers are checked against the plan.
Each split's sha256 is computed as its bytes arrive in file order (``sha256``),
so a manifest can record it without reading the file again.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Sequence

from ..errors import InvalidFileError, OutputExistsError, ShapeError, UsageError
from ..io.writer import FILE_MODE, as_bytes_view, fsync_dir, pwrite_all
from .container import DEFAULT_ALIGNMENT, KV, FileLayout, TensorInfo, plan_splits, split_kvs, split_name


@dataclass
class _Split:
    layout: FileLayout
    final: Path
    tmp: Path
    written: dict[str, int]          # tensor -> bytes written so far (in order)
    fd: int | None = None
    done: bool = False
    hasher: object = None            # sha256 of bytes [0, hashed): None once writes left file order
    hashed: int = 0

    @property
    def pending(self) -> bool:
        return any(self.written[t.name] != t.nbytes for t in self.layout.tensors)


def partial_path(final: Path) -> Path:
    """The hidden file a split is written under until it is complete."""
    return final.with_name(f".{final.name}.partial")


def split_paths(out: str | os.PathLike, count: int) -> list[Path]:
    """The final file names: ``out`` itself for one file, ``PREFIX-0000i-of-0000N.gguf`` beside it
    (``PREFIX`` is ``out`` without ``.gguf``) for several, as llama.cpp's ``gguf-split`` names them."""
    out = Path(out)
    if count == 1:
        return [out]
    prefix = out.name[: -len(".gguf")] if out.name.endswith(".gguf") else out.name
    return [out.with_name(split_name(prefix, i, count)) for i in range(count)]


def plan_files(out: str | os.PathLike, kvs: Sequence[KV], tensors: Sequence[TensorInfo], *,
               split_max_bytes: int | None = None,
               alignment: int = DEFAULT_ALIGNMENT) -> list[tuple[Path, FileLayout]]:
    """Each file ``GGUFWriter`` would write, with its layout (nothing is touched on disk)."""
    groups = plan_splits(tensors, split_max_bytes, alignment)
    paths = split_paths(out, len(groups))
    return [(final, FileLayout.build(split_kvs(kvs, no, len(groups), len(tensors)), group, alignment))
            for no, (group, final) in enumerate(zip(groups, paths))]


class GGUFWriter:
    """Write ``tensors`` (in this order) with metadata ``kvs`` into ``out`` or its splits.

    ``write(name, data)`` appends bytes to a tensor: pieces of one tensor arrive in order,
    tensors in any order; a split is final as soon as its tensors are complete.
    ``close()`` checks every byte arrived and returns the final paths.
    """

    def __init__(self, out: str | os.PathLike, kvs: Sequence[KV], tensors: Sequence[TensorInfo], *,
                 split_max_bytes: int | None = None, alignment: int = DEFAULT_ALIGNMENT,
                 done_splits: Collection[str] = (), overwrite: bool = False,
                 on_split_final: Callable[[Path], None] | None = None):
        self._splits: list[_Split] = []
        self._where: dict[str, _Split] = {}
        for final, layout in plan_files(out, kvs, tensors, split_max_bytes=split_max_bytes, alignment=alignment):
            sp = _Split(layout, final, partial_path(final), {t.name: 0 for t in layout.tensors})
            self._splits.append(sp)
            for t in layout.tensors:
                self._where[t.name] = sp
        self._lock = threading.Lock()
        self._on_split_final = on_split_final
        self.sha256: dict[str, str] = {}     # final file name -> hex sha256, for splits written here
        self._closed = False
        done = set(done_splits)
        unknown = done - {sp.final.name for sp in self._splits}
        if unknown:
            raise UsageError(f"resume names splits this plan does not have: {sorted(unknown)}")
        for sp in self._splits:
            if sp.final.name in done:
                self._check_done(sp)
            elif sp.final.exists() and not overwrite:
                raise OutputExistsError(f"{sp.final} exists", file=str(sp.final))

    @property
    def paths(self) -> list[Path]:
        return [sp.final for sp in self._splits]

    @property
    def layouts(self) -> list[FileLayout]:
        return [sp.layout for sp in self._splits]

    @property
    def total_size(self) -> int:
        return sum(sp.layout.size for sp in self._splits)

    def needs(self, name: str) -> bool:
        """False for a tensor whose split an earlier run already finished."""
        return not self._split_of(name).done

    def _split_of(self, name: str) -> _Split:
        try:
            return self._where[name]
        except KeyError:
            raise UsageError(f"tensor {name!r} is not in this GGUF plan") from None

    def _check_done(self, sp: _Split) -> None:
        """A split from an earlier run must be exactly this plan's: same size, same header bytes."""
        head = sp.layout.header
        try:
            with open(sp.final, "rb") as f:
                got = f.read(len(head))
                size = os.fstat(f.fileno()).st_size
        except OSError as exc:
            raise InvalidFileError(f"cannot read a finished split: {exc.strerror}", file=str(sp.final)) from None
        if got != head or size != sp.layout.size:
            raise InvalidFileError("finished split does not match this run's plan (other options or source?)",
                                   file=str(sp.final))
        sp.done = True
        sp.written = {t.name: t.nbytes for t in sp.layout.tensors}

    def _open(self, sp: _Split) -> int:
        if sp.fd is None:
            sp.fd = os.open(sp.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(sp.fd, sp.layout.size)      # padding stays zero without writing it
            pwrite_all(sp.fd, memoryview(sp.layout.header), 0)
            sp.hasher, sp.hashed = hashlib.sha256(sp.layout.header), len(sp.layout.header)
        return sp.fd

    def write(self, name: str, data) -> None:
        """Append ``data`` (bytes, memoryview or C-contiguous array) to tensor ``name``."""
        view = as_bytes_view(data, tensor=name)
        with self._lock:
            if self._closed:
                raise UsageError("GGUF writer is closed")
            sp = self._split_of(name)
            if sp.done:
                raise UsageError(f"tensor {name!r} is in a finished split", tensor=name)
            i = sp.layout.index[name]
            info = sp.layout.tensors[i]
            at = sp.written[name]
            if at + len(view) > info.nbytes:
                raise ShapeError(f"{at + len(view):,} bytes written, tensor holds {info.nbytes:,}", tensor=name)
            pwrite_all(self._open(sp), view, sp.layout.offsets[i] + at)
            self._hash(sp, i, sp.layout.offsets[i] + at, view)
            sp.written[name] = at + len(view)
            if not sp.pending:
                self._finalize(sp)

    @staticmethod
    def _hash(sp: _Split, i: int, at: int, view: memoryview) -> None:
        """Feed bytes written at ``at`` of tensor ``i`` to the split's hash while they come in file
        order (with the zero padding after each tensor); anything else drops the running hash."""
        if sp.hasher is None:
            return
        if at != sp.hashed:
            sp.hasher = None          # out of order: hashed from the file at the end instead
            return
        sp.hasher.update(view)
        sp.hashed += len(view)
        lay = sp.layout
        if sp.hashed == lay.offsets[i] + lay.tensors[i].nbytes:
            nxt = lay.offsets[i + 1] if i + 1 < len(lay.offsets) else lay.size
            sp.hasher.update(bytes(nxt - sp.hashed))
            sp.hashed = nxt

    @staticmethod
    def _file_sha256(fd: int, size: int) -> str:
        h, at = hashlib.sha256(), 0
        while at < size:
            chunk = os.pread(fd, min(8 << 20, size - at), at)
            if not chunk:
                raise InvalidFileError(f"partial file ended at {at:,} of {size:,} bytes")
            h.update(chunk)
            at += len(chunk)
        return h.hexdigest()

    def _finalize(self, sp: _Split) -> None:
        fd = self._open(sp)      # a split of empty tensors only is opened here
        try:
            if sp.hasher is not None and sp.hashed == sp.layout.size:
                digest = sp.hasher.hexdigest()
            else:
                digest = self._file_sha256(fd, sp.layout.size)
            os.fsync(fd)
            os.fchmod(fd, FILE_MODE)
        finally:
            os.close(fd)
            sp.fd = None
        os.replace(sp.tmp, sp.final)
        fsync_dir(sp.final.parent)
        sp.done = True
        sp.hasher = None
        self.sha256[sp.final.name] = digest
        if self._on_split_final is not None:
            self._on_split_final(sp.final)

    def missing(self) -> dict[str, int]:
        """Tensors not yet complete, with the bytes they still lack."""
        with self._lock:
            return {t.name: t.nbytes - sp.written[t.name] for sp in self._splits for t in sp.layout.tensors
                    if sp.written[t.name] != t.nbytes}

    def close(self) -> list[Path]:
        if self._closed:
            raise UsageError("GGUF writer is already closed")
        missing = self.missing()
        if missing:
            self.abort()
            first = next(iter(missing))
            raise ShapeError(f"{len(missing)} tensor(s) incomplete at close, e.g. {first!r} lacks "
                             f"{missing[first]:,} bytes", tensor=first)
        with self._lock:
            for sp in self._splits:
                if not sp.done:
                    self._finalize(sp)
            self._closed = True
        return self.paths

    def abort(self) -> None:
        """Remove partial files; finished splits and final names are left as they are."""
        with self._lock:
            self._closed = True
            for sp in self._splits:
                if sp.fd is not None:
                    os.close(sp.fd)
                    sp.fd = None
                if not sp.done:
                    sp.tmp.unlink(missing_ok=True)

    def __enter__(self) -> GGUFWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()
