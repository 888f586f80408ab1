"""Sizes and counts: reading sizes users type, writing human-readable ones.

Decimal units (``GB`` = 1e9, ``TB`` = 1e12) and binary ones (``GiB`` = 2**30).  Every
size option (``--host-dram``, ``--max-disk``, ``--max-shard-size``, ``--reserve-*``,
``--nvme`` capacities, device-set files) reads through ``parse_size``.
"""

from __future__ import annotations

import math
import re

from .errors import UsageError

_UNITS = {"B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
          "TB": 10**12, "P": 10**15, "PB": 10**15, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int | float, what: str = "size") -> int:
    """``"512GB"``, ``"1.5TB"``, ``"80GiB"``, ``"4096B"`` -> int bytes.

    Text needs a unit: a bare ``"512"`` would be 512 bytes, which nobody means for
    host DRAM or a disk budget (``llama-quantize`` and ``hf`` users type ``512G``).
    A Python int or float is taken as bytes (API callers compute them)."""
    if isinstance(text, bool):
        raise UsageError(f"{what}: expected a size, found {text!r}")
    if isinstance(text, (int, float)):
        if not math.isfinite(text) or text < 0:
            raise UsageError(f"{what}: expected a non-negative size, found {text!r}")
        return int(text)
    m = _SIZE.fullmatch(str(text))
    if m and not m.group(2):
        raise UsageError(f"{what}: {str(text).strip()!r} has no unit; give a unit, e.g. {m.group(1)}GB "
                         f"(or {m.group(1)}B for bytes)")
    if not m or m.group(2).upper() not in _UNITS:
        raise UsageError(f"{what}: cannot read {text!r} as a size (examples: 512GB, 1.5TB, 80GiB)")
    return int(round(float(m.group(1)) * _UNITS[m.group(2).upper()]))


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_count(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}" if unit == "" else f"{n:.2f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_duration(seconds: float | None) -> str:
    """``18267`` -> ``"5.1 h"``; ``95`` -> ``"1.6 min"``; ``4.2`` -> ``"4.2 s"``; days past 48 h."""
    if seconds is None:
        return "-"
    x = float(seconds)
    if not math.isfinite(x) or x < 0:
        return "-"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if x >= (2 * size if unit == "d" else size):
            return f"{x / size:.1f} {unit}"
    return f"{x:.1f} s" if x >= 0.1 else f"{x * 1000:.0f} ms"
