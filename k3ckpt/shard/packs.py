"""NVMe expert packs: the k3ckpt pack layout and the in-place file builder both layouts use.

k3ckpt layout (spec: docs/formats/expert-pack.md): a header-less file of records,
one per (layer, expert), each record the expert's source tensors byte for byte
(gate parts, then up, then down; within a projection in source order),
records ``stride`` apart (the record size rounded up to 4 KiB, zero padding),
grouped by layer in plan order; and a JSON manifest ``<pack>.json`` with the
part table, every record's offset, size and sha256.

``PackBuilder`` writes a big file in place under a hidden ``.<name>.building``
name, commits it layer by layer (fdatasync, then the layer list in the run
manifest) so an interrupted run resumes at the first unfinished layer, and
renames it to its final name at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidFileError, ShapeError, UsageError

__all__ = ["ALIGN", "PACK_FORMAT", "PACK_VERSION", "RecordPart", "PackRecord", "ExpertPack", "PackBuilder",
           "record_parts", "name_template"]

PACK_FORMAT = "k3ckpt-expert-pack"
PACK_VERSION = 1
ALIGN = 4096
PROJECTION_ORDER = ("gate", "up", "down", "gate_up")


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class RecordPart:
    """One source tensor inside every record: ``[offset, offset + nbytes)`` of the record."""

    projection: str     # gate | up | down (| gate_up)
    part: str           # packed | scale | weight | ... (the profile's part name)
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PackRecord:
    layer: int          # model layer number (0-indexed decoder layer)
    expert: int
    offset: int
    size: int
    sha256: str


def record_parts(entries: list[tuple[str, Any, str, str]]) -> tuple[RecordPart, ...]:
    """Part table of one expert from ``(name, entry, projection, part)`` in source order.

    Parts go gate, up, down (then anything else), source order within a
    projection, packed back to back (record offsets are sums of sizes).
    """
    rank = {p: i for i, p in enumerate(PROJECTION_ORDER)}
    ordered = sorted(enumerate(entries), key=lambda t: (rank.get(t[1][2] or "", len(rank)), t[0]))
    out, pos = [], 0
    for _, (_name, e, proj, part) in ordered:
        out.append(RecordPart(proj or "", part, e.dtype, tuple(e.shape), pos, e.nbytes))
        pos += e.nbytes
    return tuple(out)


def name_template(names: list[str], layer: int, expert: int) -> str | None:
    """A ``str.format`` template with ``{layer}`` and ``{expert}`` that gives every name of this
    expert back, or None when the numbers cannot be placed unambiguously."""
    out = []
    for name in names:
        esc = name.replace("{", "{{").replace("}", "}}")
        m = re.fullmatch(rf"(.*?\.){layer}(\..*?\.){expert}(\..*)", esc)
        if m is None:
            return None
        t = f"{m.group(1)}{{layer}}{m.group(2)}{{expert}}{m.group(3)}"
        if t.format(layer=layer, expert=expert) != name:
            return None
        out.append(t)
    return out[0] if out else None


# ------------------------------------------------------------------ manifest
@dataclass(frozen=True)
class ExpertPack:
    """A k3ckpt pack's JSON manifest (``<pack>.json``): what a reader needs, nothing more.

    ``record(layer, expert)`` gives a record; its bytes are ``pack[offset:offset+size]``
    and part ``p`` is ``[offset + p.offset, offset + p.offset + p.nbytes)``; the source
    tensor name of part ``i`` is ``name_templates[i].format(layer=..., expert=...)``
    (see docs/formats/expert-pack.md).
    """

    pack: str
    rank: int
    source_format: str
    record_bytes: int
    stride: int
    file_size: int
    parts: tuple[RecordPart, ...]
    name_templates: tuple[str, ...] | None
    records: tuple[PackRecord, ...]
    align: int = ALIGN
    format: str = PACK_FORMAT
    version: int = PACK_VERSION

    def __post_init__(self):
        if self.format != PACK_FORMAT or self.version != PACK_VERSION:
            raise InvalidFileError(f"not a {PACK_FORMAT} v{PACK_VERSION} manifest "
                                   f"(format {self.format!r}, version {self.version!r})")
        if self.align != ALIGN or self.stride % ALIGN or self.stride < self.record_bytes:
            raise InvalidFileError(f"stride {self.stride} must be a multiple of {ALIGN} holding {self.record_bytes}")
        if sum(p.nbytes for p in self.parts) != self.record_bytes:
            raise InvalidFileError("part sizes do not add up to the record size")
        pos = 0
        for p in self.parts:
            if p.offset != pos:
                raise InvalidFileError(f"part {p.projection} {p.part} at {p.offset}, expected {pos} "
                                       "(parts are back to back)")
            pos += p.nbytes
        seen = set()
        for i, r in enumerate(self.records):
            if r.offset != i * self.stride or r.size != self.record_bytes:
                raise InvalidFileError(f"record {i} (layer {r.layer}, expert {r.expert}) at {r.offset} size {r.size};"
                                       f" expected {i * self.stride} size {self.record_bytes}")
            if (r.layer, r.expert) in seen:
                raise InvalidFileError(f"record (layer {r.layer}, expert {r.expert}) appears twice")
            seen.add((r.layer, r.expert))
        layers = [r.layer for r in self.records]
        if any(a > b for a, b in zip(layers, layers[1:])):
            raise InvalidFileError("records are not grouped by layer in ascending layer order")
        if self.file_size != len(self.records) * self.stride:
            raise InvalidFileError(f"file_size {self.file_size} != {len(self.records)} records x {self.stride}")
        if self.name_templates is not None and len(self.name_templates) != len(self.parts):
            raise InvalidFileError(f"{len(self.name_templates)} name templates for {len(self.parts)} parts")
        if any(not re.fullmatch(r"[0-9a-f]{64}", r.sha256) for r in self.records):
            raise InvalidFileError("record sha256 must be 64 lowercase hex digits")
        object.__setattr__(self, "_index", {(r.layer, r.expert): r for r in self.records})

    def record(self, layer: int, expert: int) -> PackRecord:
        try:
            return self._index[(int(layer), int(expert))]
        except KeyError:
            raise UsageError(f"pack {self.pack} has no record for layer {layer}, expert {expert}") from None

    def tensor_names(self, layer: int, expert: int) -> list[str] | None:
        if self.name_templates is None:
            return None
        return [t.format(layer=layer, expert=expert) for t in self.name_templates]

    def to_dict(self) -> dict:
        return {
            "format": self.format, "version": self.version, "pack": self.pack, "rank": self.rank,
            "source_format": self.source_format, "align": self.align, "record_bytes": self.record_bytes,
            "stride": self.stride, "file_size": self.file_size,
            "parts": [{**asdict(p), "shape": list(p.shape)} for p in self.parts],
            "name_templates": None if self.name_templates is None else list(self.name_templates),
            "layers": _layer_runs(self.records, self.stride),
            "records": [[r.layer, r.expert, r.offset, r.size, r.sha256] for r in self.records],
        }

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "pack manifest") -> ExpertPack:
        try:
            parts = tuple(RecordPart(p["projection"], p["part"], p["dtype"], tuple(p["shape"]),
                                   int(p["offset"]), int(p["nbytes"])) for p in d["parts"])
            records = tuple(PackRecord(int(a), int(b), int(c), int(s), str(h)) for a, b, c, s, h in d["records"])
            nt = d["name_templates"]
            kw = dict(pack=str(d["pack"]), rank=int(d["rank"]), source_format=str(d["source_format"]),
                      record_bytes=int(d["record_bytes"]), stride=int(d["stride"]), file_size=int(d["file_size"]),
                      parts=parts, name_templates=None if nt is None else tuple(str(t) for t in nt),
                      records=records, align=int(d["align"]), format=d["format"], version=d["version"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidFileError(f"malformed k3ckpt pack manifest ({exc!r})", file=source) from None
        try:
            out = cls(**kw)
        except InvalidFileError as exc:
            raise InvalidFileError(exc.detail, file=source) from None
        if d.get("layers") != _layer_runs(out.records, out.stride):
            raise InvalidFileError("'layers' does not match the records", file=source)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> ExpertPack:
        path = Path(path)
        try:
            d = json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidFileError(f"pack manifest is not valid JSON: {exc}", file=str(path)) from None
        if not isinstance(d, dict):
            raise InvalidFileError("pack manifest must be a JSON object", file=str(path))
        return cls.from_dict(d, source=str(path))


def _layer_runs(records, stride) -> list[dict]:
    runs: list[dict] = []
    for r in records:
        if runs and runs[-1]["layer"] == r.layer:
            runs[-1]["count"] += 1
        else:
            runs.append({"layer": r.layer, "offset": r.offset, "count": 1})
    return runs


# ------------------------------------------------------------------ builder
class PackBuilder:
    """A file of known size written in place and committed layer by layer.

    ``progress_key`` names this file's entry in the run manifest
    (``{"size": ..., "layers": [...]}``); a resumed run with the same size keeps the
    ``.building`` file and the layers listed there, anything else starts afresh.
    """

    def __init__(self, root: Path, name: str, size: int, manifest, progress_key: str):
        self.root = Path(root)
        self.name = name
        self.final = self.root / name
        if "/" in name or name.startswith("."):
            raise UsageError(f"pack name {name!r} must be a plain file name")
        self.tmp = self.root / f".{name}.building"
        self.size = int(size)
        self.manifest = manifest
        self.key = progress_key
        prog = manifest.get(progress_key) if manifest is not None else None
        self.done_layers: set[int] = set()
        if (isinstance(prog, dict) and prog.get("size") == self.size and self.tmp.is_file()
                and self.tmp.stat().st_size == self.size):
            self.done_layers = {int(x) for x in prog.get("layers", [])}
            self.fd = os.open(self.tmp, os.O_RDWR)
        else:
            self.tmp.parent.mkdir(parents=True, exist_ok=True)
            self.tmp.unlink(missing_ok=True)
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(self.fd, self.size)  # sparse: unwritten rows stay holes (read as zeros)
            self._save()

    def _save(self) -> None:
        if self.manifest is not None:
            self.manifest.put(self.key, {"size": self.size, "layers": sorted(self.done_layers)})

    def pwrite(self, offset: int, data) -> None:
        view = memoryview(data).cast("B")
        if offset < 0 or offset + view.nbytes > self.size:
            raise ShapeError(f"write of {view.nbytes} bytes at {offset} passes the end of {self.name} ({self.size})")
        while view:
            n = os.pwrite(self.fd, view, offset)
            view = view[n:]
            offset += n

    def pread(self, offset: int, n: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def commit_layer(self, layer: int) -> None:
        os.fdatasync(self.fd)   # the layer's bytes are durable before the manifest says so
        self.done_layers.add(int(layer))
        self._save()

    def finish(self) -> Path:
        os.fsync(self.fd)
        os.fchmod(self.fd, 0o644)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.final)
        if self.manifest is not None:
            self.manifest.put(self.key, None)
        return self.final

    def close(self) -> None:
        """Stop without finishing: the ``.building`` file stays for a resumed run."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def sha256_bytes(data) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()
