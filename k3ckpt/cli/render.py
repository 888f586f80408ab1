"""Plain-text rendering helpers shared by the commands (tables, sizes)."""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

import click

from ..units import human_bytes, human_count  # noqa: F401  (re-exported for the commands)


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
