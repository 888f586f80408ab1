"""``inspect --scan``: statistics that need the tensor data, read in bounded chunks.

Per role: the E8M0 scale histogram and its NaN (0xFF) count, the E2M1 code
histogram (so the fraction of zero codes), NaN/Inf counts of float tensors and
the largest magnitude.  Memory is bounded by ``chunk_bytes`` per read, whatever
the checkpoint's size.  MXFP4 codes are paired with their scales row by row so
amax is the decoded value (code magnitude x scale), not a code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .formats import ids
from .formats.e2m1 import E2M1_VALUES, E8M0_F32, E8M0_NAN
from .io.dtypes import lookup, value_dtype
from .io.reader import Checkpoint
from .profiles import detect

# Byte -> its low and high E2M1 codes, and the larger magnitude code of the two.
_LO = (np.arange(256) & 0xF).astype(np.uint8)
_HI = (np.arange(256) >> 4).astype(np.uint8)
_MAXMAG = np.maximum(_LO & 7, _HI & 7).astype(np.uint8)
_FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"})


@dataclass
class RoleScan:
    """Accumulated statistics of one role (mutable while scanning)."""

    role: str
    tensors: int = 0
    elements: int = 0
    scale_hist: np.ndarray = field(default_factory=lambda: np.zeros(256, np.int64))
    code_hist: np.ndarray = field(default_factory=lambda: np.zeros(16, np.int64))
    nan: int = 0
    inf: int = 0
    amax: float = 0.0

    @property
    def nan_scales(self) -> int:
        return int(self.scale_hist[E8M0_NAN])

    @property
    def zero_code_fraction(self) -> float | None:
        total = int(self.code_hist.sum())
        return None if total == 0 else int(self.code_hist[0] + self.code_hist[8]) / total

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "tensors": self.tensors,
            "elements": self.elements,
            "scale_histogram": {f"0x{i:02x}": int(c) for i, c in enumerate(self.scale_hist) if c},
            "nan_scales": self.nan_scales,
            "code_histogram": [int(c) for c in self.code_hist] if self.code_hist.any() else None,
            "zero_code_fraction": self.zero_code_fraction,
            "nan": self.nan,
            "inf": self.inf,
            "amax": self.amax if math.isfinite(self.amax) else str(self.amax),
        }


@dataclass(frozen=True)
class ScanReport:
    roles: tuple[RoleScan, ...]
    bytes_read: int

    def to_json(self) -> dict[str, Any]:
        return {"bytes_read": self.bytes_read, "roles": [r.to_json() for r in self.roles]}

    def render(self) -> str:
        from .render import table

        rows = []
        for r in self.roles:
            nz = np.nonzero(r.scale_hist)[0]
            span = "-" if not len(nz) else f"0x{nz[0]:02x}-0x{nz[-1]:02x} ({len(nz)} codes)"
            zf = r.zero_code_fraction
            rows.append((r.role, r.tensors, f"{r.elements:,}", span, r.nan_scales,
                         "-" if zf is None else f"{zf:.2%}", r.nan, r.inf, f"{r.amax:.4g}"))
        # an MXFP4 weight's codes and scales are one weight here; "by role" counts them as two tensors
        head = ["scan by role", "weights", "elements", "E8M0 scales", "0xFF", "zero codes", "NaN", "Inf", "amax"]
        return table(rows, head)


def _mx_partner(name: str) -> str | None:
    """The scale tensor of an MXFP4 code tensor (compressed-tensors or gpt-oss naming)."""
    if name.endswith(".weight_packed"):
        return name[: -len("_packed")] + "_scale"
    if name.endswith("_blocks"):
        return name[: -len("_blocks")] + "_scales"
    return None


def _rows_per_chunk(row_bytes: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // max(1, row_bytes))


def _scan_mxfp4(ckpt: Checkpoint, codes: str, scales: str, acc: RoleScan, chunk_bytes: int) -> int:
    ce = ckpt.entry(codes)
    rows = ce.shape[0] if ce.shape else 1
    step = _rows_per_chunk(ce.nbytes // max(rows, 1), chunk_bytes)
    read = 0
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        p = ckpt.read_rows(codes, r0, r1).reshape(-1)
        s = ckpt.read_rows(scales, r0, r1).reshape(-1)
        read += p.nbytes + s.nbytes
        byte_hist = np.bincount(p, minlength=256)
        np.add.at(acc.code_hist, _LO, byte_hist)
        np.add.at(acc.code_hist, _HI, byte_hist)
        acc.scale_hist += np.bincount(s, minlength=256)
        if s.size and p.size == s.size * 16:
            block_max = _MAXMAG[p].reshape(-1, 16).max(axis=1)
            vals = E2M1_VALUES[block_max] * E8M0_F32[s]
            ok = s != E8M0_NAN
            if ok.any():
                acc.amax = max(acc.amax, float(vals[ok].max()))
    acc.elements += ce.nbytes * 2
    return read


def _scan_float(ckpt: Checkpoint, name: str, acc: RoleScan, chunk_bytes: int) -> int:
    e = ckpt.entry(name)
    vdt = value_dtype(e.dtype)
    rows = e.shape[0] if e.shape else 1
    step = _rows_per_chunk(e.nbytes // max(rows, 1), chunk_bytes)
    read = 0
    for r0 in range(0, rows, step):
        raw = ckpt.read_rows(name, r0, min(rows, r0 + step)) if e.shape else ckpt.read_raw(name)
        read += raw.nbytes
        x = np.asarray(raw).view(vdt).astype(np.float32).reshape(-1)
        finite = np.isfinite(x)
        acc.nan += int(np.count_nonzero(np.isnan(x)))
        acc.inf += int(np.count_nonzero(np.isinf(x)))
        if finite.any():
            acc.amax = max(acc.amax, float(np.abs(x[finite]).max()))
    acc.elements += math.prod(e.shape)
    return read


def scan_checkpoint(ckpt: Checkpoint, *, progress: bool = False, chunk_bytes: int = 32 << 20) -> ScanReport:
    """Read every tensor once, ``chunk_bytes`` at a time, and summarise by role."""
    from tqdm import tqdm

    profile = detect(ckpt.config, ckpt.tensors.keys())
    roles: dict[str, RoleScan] = {}
    total = sum(e.nbytes for e in ckpt.tensors.values())
    bytes_read = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc="scan", disable=not progress) as bar:
        for name, e in ckpt.tensors.items():
            tr = profile.classify(name, e.dtype)
            acc = roles.setdefault(tr.role.value, RoleScan(tr.role.value))
            partner = _mx_partner(name)
            read = 0
            if e.dtype == "U8" and partner in ckpt and ckpt.entry(partner).dtype == "U8" \
                    and tr.storage in ids.MXFP4_LAYOUTS:
                acc.tensors += 1
                read = _scan_mxfp4(ckpt, name, partner, acc, chunk_bytes)
            elif tr.part in ("scale", "scales") and e.dtype == "U8" and tr.storage in ids.MXFP4_LAYOUTS:
                read = 0  # read with its codes
            elif e.dtype in _FLOAT_DTYPES and lookup(e.dtype).bits >= 8:
                acc.tensors += 1
                read = _scan_float(ckpt, name, acc, chunk_bytes)
            else:
                acc.tensors += 1  # integer / packed tensors of other formats: counted, not decoded
            bytes_read += read
            bar.update(e.nbytes)
    ordered = tuple(sorted(roles.values(), key=lambda r: r.role))
    return ScanReport(roles=ordered, bytes_read=bytes_read)
