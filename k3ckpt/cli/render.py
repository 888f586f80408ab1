"""Plain-text rendering helpers shared by the commands (tables, sizes)."""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

import click


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


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str], align: str | None = None) -> str:
    """A fixed-width text table; ``align`` is one 'l'/'r' per column (default:
    first column left, the rest right)."""
    rows = [[("-" if c is None else str(c)) for c in r] for r in rows]
    align = align or ("l" + "r" * (len(headers) - 1))
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))
