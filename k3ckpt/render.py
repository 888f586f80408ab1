"""How numbers and tables read, for the CLI and for library reports (``scan``,
``requant.report_render``): the one fixed-width text table, sizes, counts, durations and dB.
Below the CLI so library code never imports it."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from .units import human_bytes, human_count, human_duration

__all__ = ["table", "fmt_db", "human_bytes", "human_count", "human_duration"]


def fmt_db(v: float) -> str:
    """A dB figure with two decimals; NaN and the infinities spelled out."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.2f}"


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str], align: str | None = None) -> str:
    """A fixed-width text table; ``align`` is one 'l'/'r' per column (default:
    first column left, the rest right); None cells show as ``-``."""
    rows = [[("-" if c is None else str(c)) for c in r] for r in rows]
    align = align or ("l" + "r" * (len(headers) - 1))
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return "\n".join(out)
