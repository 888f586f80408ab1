"""``k3ckpt verify``: re-read a ``k3ckpt shard``, ``requant`` or ``dequant`` output against its
manifests (and the source).

Without a source: every file the run manifest lists must exist with its size
and sha256; nothing unlisted may sit beside them; every k3ckpt pack record
must match its sha256 (and zero padding); every moet sidecar must describe its
pack.  With the source: every tensor of every rank's safetensors equals the
source tensor byte for byte, every k3ckpt pack record equals the source
expert's tensors, and every moet row decodes to the values the runtime's map
gives the source MXFP4 expert (NaN where the source scale is 0xFF).
A requant or dequant output with the source: its tensors against the job's plan rebuilt from
the source and the manifest's options (``verify_convert``): copies byte for byte, re-encoded or
decoded weights by presence, dtype and shape.  The Moet runtime's own files beside a moet pack
(``<stem>.lock``, ``<stem>.pack.heat.json``: docs/formats/moet-pack.md) are not ours and are
allowed unlisted.  One tensor or one record in memory at a time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidFileError, NotFoundError
from ..io.manifest import MANIFEST_NAME, RunManifest, sha256_file
from ..io.reader import Checkpoint, open_checkpoint
from .packs import ExpertPack, sha256_bytes

__all__ = ["VerifyReport", "verify_output"]

_CHUNK = 64 << 20
_JOBS = ("shard", "requant", "dequant")
_MAX_PROBLEMS = 1000


@dataclass(frozen=True)
class VerifyReport:
    dst: str
    files_checked: int
    bytes_checked: int
    records_checked: int
    tensors_checked: int
    source_checked: bool
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


class _Checker:
    def __init__(self, root: Path):
        self.root = root
        self.problems: list[str] = []
        self.files = self.bytes = self.records = self.tensors = 0

    def bad(self, msg: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(msg)


def verify_output(dst, *, source: Checkpoint | str | os.PathLike | None = None) -> VerifyReport:
    """Check ``dst`` (see the module docstring).  Problems are collected, not raised; a folder
    that is not a k3ckpt output raises ``InvalidFileError`` / ``NotFoundError``."""
    root = Path(dst)
    if not root.is_dir():
        raise NotFoundError("no such output folder", file=str(root))
    manifest = RunManifest.load(root)
    job = manifest._data.get("job")
    if job not in _JOBS:
        raise InvalidFileError(f"the manifest is of job {job!r}, not one of {', '.join(_JOBS)}", file=str(root))
    c = _Checker(root)
    if manifest.state != "complete":
        c.bad(f"the run is not complete (state {manifest.state!r}): resume it with --resume")
    for name, rec in sorted(manifest.records.items()):
        path = root / name
        if not path.is_file():
            c.bad(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != rec.size:
            c.bad(f"{name}: {size:,} bytes, the manifest says {rec.size:,}")
            continue
        if sha256_file(path) != rec.sha256:
            c.bad(f"{name}: sha256 differs from the manifest")
        c.files += 1
        c.bytes += size
    listed = set(manifest.records) | {MANIFEST_NAME} | _runtime_files(root, manifest)
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in listed:
            c.bad(f"{rel}: not listed in the manifest")
    ckpt = None
    own = False
    if source is not None:
        if isinstance(source, Checkpoint):
            ckpt = source
        else:
            ckpt, own = open_checkpoint(source), True
    try:
        if job != "shard" and ckpt is not None:
            _check_converted(c, root, manifest, job, ckpt)
        # rank folders by their safetensors index, packs by their manifests: a lost
        # rank.json must not hide the checks of what is still there
        for name in sorted(manifest.records):
            folder, _, base = name.rpartition("/")
            if base == "model.safetensors.index.json" and ckpt is not None and job == "shard" \
                    and (root / name).is_file():
                _check_safetensors(c, root / folder, ckpt)
            elif base.endswith(".pack.json") and folder and (root / name).is_file():
                _check_k3_pack(c, root / folder, base, ckpt)
            elif base == "rank.json" and (root / name).is_file():
                info = json.loads((root / name).read_bytes())
                if info.get("moet"):
                    _check_moet(c, root, info["moet"], ckpt)
    finally:
        if own:
            ckpt.close()
    return VerifyReport(str(root), c.files, c.bytes, c.records, c.tensors, ckpt is not None, tuple(c.problems))


def _runtime_files(root: Path, manifest: RunManifest) -> set[str]:
    """The Moet runtime's files beside each moet pack this output lists: its ``flock`` file
    ``<stem>.lock`` and its hot set ``<stem>.pack.heat.json`` (``TieredPackStore``)."""
    out = set()
    for name in manifest.records:
        if name.rpartition("/")[2] == "rank.json" and (root / name).is_file():
            try:
                info = json.loads((root / name).read_bytes())
            except ValueError:
                continue   # reported by the record's sha256 check
            for entry in ((info.get("moet") or {}).get("packs") or []) if isinstance(info, dict) else []:
                pack = str(entry.get("pack", ""))
                if pack.endswith(".pack"):
                    out |= {pack[: -len(".pack")] + ".lock", pack + ".heat.json"}
    return out


def _check_converted(c: _Checker, root: Path, manifest: RunManifest, job: str, ckpt: Checkpoint) -> None:
    """A requant or dequant output against the plan its source implies (``verify_convert``)."""
    from .verify_convert import plan_source_check

    try:
        out = open_checkpoint(root)
    except InvalidFileError as exc:
        c.bad(f"the output's safetensors do not open: {exc}")
        return
    with out:
        plan = plan_source_check(out, ckpt, job, manifest.options, source_identity=manifest.source, root=root)
        for p in plan.problems:
            c.bad(p)
        c.tensors += plan.transformed
        for name in plan.compare:
            c.tensors += 1
            e = out.entry(name)
            for pos in range(0, e.nbytes, _CHUNK):
                end = min(e.nbytes, pos + _CHUNK)
                if out.read_bytes(name, pos, end) != ckpt.read_bytes(name, pos, end):
                    c.bad(f"{name}: bytes differ from the source")
                    break


def _check_safetensors(c: _Checker, folder: Path, ckpt: Checkpoint) -> None:
    try:
        out = open_checkpoint(folder)
    except InvalidFileError as exc:
        c.bad(f"{folder.name}: safetensors do not open: {exc}")
        return
    with out:
        for name, e in out.tensors.items():
            c.tensors += 1
            if name not in ckpt:
                c.bad(f"{folder.name}: tensor {name!r} is not in the source")
                continue
            s = ckpt.entry(name)
            if (s.dtype, s.shape) != (e.dtype, e.shape):
                c.bad(f"{folder.name}: {name}: {e.dtype} {list(e.shape)}, source {s.dtype} {list(s.shape)}")
                continue
            for pos in range(0, e.nbytes, _CHUNK):
                end = min(e.nbytes, pos + _CHUNK)
                if out.read_bytes(name, pos, end) != ckpt.read_bytes(name, pos, end):
                    c.bad(f"{folder.name}: {name}: bytes differ from the source")
                    break


def _check_k3_pack(c: _Checker, folder: Path, manifest_name: str, ckpt: Checkpoint | None) -> None:
    where = f"{folder.name}/{manifest_name[: -len('.json')]}"
    try:
        pack = ExpertPack.load(folder / manifest_name)
    except InvalidFileError as exc:
        c.bad(f"{where}: {exc}")
        return
    path = folder / pack.pack
    if not path.is_file() or path.stat().st_size != pack.file_size:
        c.bad(f"{where}: missing or not {pack.file_size:,} bytes")
        return
    pad = pack.stride - pack.record_bytes
    with open(path, "rb") as f:
        for r in pack.records:
            c.records += 1
            data = os.pread(f.fileno(), pack.stride, r.offset)
            rec = data[: r.size]
            if sha256_bytes(rec) != r.sha256:
                c.bad(f"{where}: record (layer {r.layer}, expert {r.expert}) sha256 differs")
            if pad and data[r.size:] != bytes(pad):
                c.bad(f"{where}: record (layer {r.layer}, expert {r.expert}) padding is not zero")
            if ckpt is None:
                continue
            names = pack.tensor_names(r.layer, r.expert)
            if names is None:
                c.bad(f"{where}: no tensor names to compare with the source")
                return
            want = b"".join(ckpt.read_bytes(n) if n in ckpt else b"\xff" for n in names)
            if want != rec:
                c.bad(f"{where}: record (layer {r.layer}, expert {r.expert}) differs from the source tensors")


def _check_moet(c: _Checker, root: Path, m: dict, ckpt: Checkpoint | None) -> None:
    from .moet_pack import PackIdentity, SlotGeometry, tp_slice_expert

    ident = PackIdentity(m["ckpt_id"], m["zero_mode"], m["tag"], m["n_layers"], m["E"], m["slot_bytes"], m["stride"])
    geom = SlotGeometry(m["n13"], m["k13"], m["n2"], m["k2"])
    keys = {int(layer): int(k) for layer, k in m["layer_keys"]}
    tp = int(m["tp"])
    files = []
    for entry in m["packs"]:
        where, t = entry["pack"], int(entry["tp_rank"])
        try:
            side = json.loads((root / entry["sidecar"]).read_bytes())
        except (OSError, ValueError) as exc:
            c.bad(f"{entry['sidecar']}: unreadable sidecar ({exc})")
            continue
        if side != ident.sidecar(keys.values()):
            c.bad(f"{entry['sidecar']}: sidecar does not match the pack identity")
        if not Path(where).name.startswith(ident.stem(t, tp)):
            c.bad(f"{where}: file name does not carry rank {t} of {tp} and the identity hash {ident.key20}")
        path = root / where
        if not path.is_file() or path.stat().st_size != ident.file_size:
            c.bad(f"{where}: missing or not {ident.file_size:,} bytes")
            continue
        files.append((t, where, open(path, "rb")))
    from .source import read_source

    src = read_source(ckpt, moet=True, tp=tp) if ckpt is not None else None
    try:
        for layer, key in sorted(keys.items()):
            for e in range(ident.E):
                triple = None
                if src is not None:
                    arrays = {n: ckpt.read_raw(n) for n, _, _ in src.expert_entries((layer, e))}
                    triple = src.mxfp4_triple((layer, e), arrays)
                for t, where, f in files:
                    c.records += 1
                    row = os.pread(f.fileno(), ident.stride, ident.row_offset(key, e))
                    if row[geom.slot_bytes:] != bytes(ident.stride - geom.slot_bytes):
                        c.bad(f"{where}: row (layer {layer}, expert {e}) padding is not zero")
                    if triple is not None and not _row_matches(geom, row, *tp_slice_expert(*triple, t, tp)):
                        c.bad(f"{where}: row (layer {layer}, expert {e}) does not decode to the source's values")
    finally:
        for _, _, f in files:
            f.close()


def _row_matches(geom, row: bytes, gate, up, down) -> bool:
    """Decode equality without floats: the four levels are distinct and the E8M0 scale map is
    one to one, so a row decodes to the runtime map's values exactly when its codes equal the
    map's codes and its scales equal the source scales (tests hold this against ``slot_values``)."""
    from ..formats.moet_w2 import pack_codes
    from .moet_pack import expected_codes_from_mxfp4, split_slot

    p = split_slot(geom, row)
    codes13 = np.concatenate([pack_codes(expected_codes_from_mxfp4(gate[0])),
                              pack_codes(expected_codes_from_mxfp4(up[0]))])
    return (np.array_equal(p["codes13"], codes13) and np.array_equal(p["sc13"], np.concatenate([gate[1], up[1]]))
            and np.array_equal(p["codes2"], pack_codes(expected_codes_from_mxfp4(down[0])))
            and np.array_equal(p["sc2"], down[1]))
