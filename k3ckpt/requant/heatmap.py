"""The report's picture: a self-contained SVG (no plotting library needed).

Top panel: SNR per (layer, expert) as a heatmap, one row per layer that has
experts, one column per expert bin.  With more experts than ``max_columns``
(K3: 896 per layer) consecutive experts share a column; a cell's SNR is pooled
from the bin's error and signal energies, like every aggregate in the report.
Colour: viridis-like, low SNR dark.  With many cells the scale spans the 1st
to 99th percentile so one outlier does not flatten the rest; values beyond
are clamped and the legend's end labels say so.  The scale is at least
``MIN_SPAN_DB`` (3 dB) wide, centred on the median cell, so experts that differ
by noise (a k3-tiny run spans 8.79-8.88 dB) share a colour; the legend states the
span.  Cells holding experts kept in their source format (``--target-bpw``) are
outlined and say so in their tooltip.  Each cell carries a ``<title>`` tooltip
with its exact figures.

Bottom panel: histogram of per-tensor SNR, stacked by projection.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

from ..errors import UsageError
from ..render import fmt_db

if TYPE_CHECKING:  # pragma: no cover
    from .report import Aggregate, RequantReport

DEFAULT_COLUMNS = 128
PERCENTILE_CELLS = 100      # above this many cells the colour scale uses 1st..99th percentile
MIN_SPAN_DB = 3.0           # narrowest colour scale (dB), centred on the median cell

# Samples of matplotlib's viridis at t = 0, 1/8, ..., 1 (perceptually even, colour-blind safe).
_VIRIDIS = ((0x44, 0x01, 0x54), (0x48, 0x28, 0x78), (0x3E, 0x49, 0x89), (0x31, 0x68, 0x8E), (0x26, 0x82, 0x8E),
            (0x1F, 0x9E, 0x89), (0x35, 0xB7, 0x79), (0x6E, 0xCE, 0x58), (0xFD, 0xE7, 0x25))
_NAN_COLOUR = "#b0b0b0"
_PROJ_COLOURS = {"gate": "#1f77b4", "up": "#ff7f0e", "gate_up": "#9467bd", "down": "#2ca02c"}
_OTHER_COLOUR = "#7f7f7f"
_FONT = 'font-family="sans-serif"'


def colour(t: float) -> str:
    """Viridis-like colour for ``t`` in [0, 1] (clamped)."""
    t = min(1.0, max(0.0, t)) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    f = t - i
    a, b = _VIRIDIS[i], _VIRIDIS[i + 1]
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b))


def _pooled_snr(aggs: list[Aggregate]) -> float:
    from .metrics import snr_from_sums

    return snr_from_sums(math.fsum(a.sum_ref_sq for a in aggs), math.fsum(a.sum_err_sq for a in aggs))


def _percentile(sorted_vals: list[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default), on a sorted list.
    pos = (len(sorted_vals) - 1) * q
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _nice_step(span: float, target: int) -> float:
    raw = span / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    step = _nice_step(hi - lo, target)
    first = math.ceil(lo / step - 1e-9) * step
    out = []
    v = first
    while v <= hi + 1e-9 * step:
        out.append(round(v, 10))
        v += step
    return out


def heatmap_grid(report: RequantReport, max_columns: int = DEFAULT_COLUMNS):
    """(layers, bin_width, n_experts, cells): ``cells[(row, col)] = (snr, first_expert, last_expert)``.

    ``layers`` lists the layers with experts (rows, ascending); experts
    ``[c*bin_width, (c+1)*bin_width)`` fall in column ``c``.
    """
    if max_columns < 1:
        raise UsageError(f"heatmap max_columns must be >= 1, found {max_columns}")
    experts = report.by_expert
    if not experts:
        return [], 1, 0, {}
    layers = sorted({a.key[0] for a in experts})
    row_of = {layer: i for i, layer in enumerate(layers)}
    n_experts = max(a.key[1] for a in experts) + 1
    width = max(1, math.ceil(n_experts / max_columns))
    groups: dict[tuple[int, int], list[Aggregate]] = defaultdict(list)
    for a in experts:
        groups[(row_of[a.key[0]], a.key[1] // width)].append(a)
    cells = {}
    for (r, c), aggs in groups.items():
        ids = [a.key[1] for a in aggs]
        cells[(r, c)] = (_pooled_snr(aggs), min(ids), max(ids))
    return layers, width, n_experts, cells


def kept_cells(report: RequantReport, max_columns: int = DEFAULT_COLUMNS) -> dict[tuple[int, int], int]:
    """(row, col) of ``heatmap_grid`` -> how many tensors there were kept in their source format."""
    from .report_render import kept_tensors

    kept = kept_tensors(report)
    if not kept:
        return {}
    layers, width, _, _ = heatmap_grid(report, max_columns)
    row_of = {layer: i for i, layer in enumerate(layers)}
    out: dict[tuple[int, int], int] = defaultdict(int)
    for r in kept:
        if r.layer in row_of and r.expert is not None:
            out[(row_of[r.layer], r.expert // width)] += 1
    return dict(out)


def _colour_range(values: list[float]) -> tuple[float, float, bool, bool]:
    """(lo, hi, clamped_low, clamped_high) of the colour scale over finite ``values``."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return 0.0, 1.0, False, False
    lo, hi = finite[0], finite[-1]
    if len(finite) > PERCENTILE_CELLS:
        lo, hi = _percentile(finite, 0.01), _percentile(finite, 0.99)
    clamp_lo = any(v < lo for v in values if not math.isnan(v))
    clamp_hi = any(v > hi for v in values if not math.isnan(v))
    if hi - lo < MIN_SPAN_DB:
        # Experts a few tenths of a dB apart are noise, not bad experts: at least MIN_SPAN_DB,
        # centred on the median, so colour differences mean differences worth a look.
        mid = _percentile(finite, 0.5)
        lo, hi = mid - MIN_SPAN_DB / 2, mid + MIN_SPAN_DB / 2
    return lo, hi, clamp_lo, clamp_hi


def _heatmap_svg(report: RequantReport, x0: int, y0: int, max_columns: int) -> tuple[list[str], int, int]:
    """Heatmap panel at (x0, y0); returns (elements, width, height)."""
    layers, bw, n_experts, cells = heatmap_grid(report, max_columns)
    out: list[str] = []
    if not cells:
        out.append(f'<text x="{x0}" y="{y0 + 20}" {_FONT} font-size="13">no per-expert results: no heatmap</text>')
        return out, 320, 40
    ncols = math.ceil(n_experts / bw)
    nrows = len(layers)
    cw = max(2, min(24, 840 // ncols))
    ch = max(2, min(24, 560 // nrows))
    W, H = ncols * cw, nrows * ch
    lo, hi, clo, chi = _colour_range([v[0] for v in cells.values()])
    kept = kept_cells(report, max_columns)
    bins = "one column per expert" if bw == 1 else f"{bw} experts per column, SNR pooled over the column"
    out.append(f'<text x="{x0}" y="{y0 - 24}" {_FONT} font-size="15" font-weight="bold">'
               f'SNR (dB) per layer and expert</text>')
    out.append(f'<text x="{x0}" y="{y0 - 8}" {_FONT} font-size="11" fill="#444">'
               f'{nrows} layers x {n_experts} experts; {escape(bins)}</text>')
    out.append(f'<rect x="{x0}" y="{y0}" width="{W}" height="{H}" fill="#eeeeee"/>')
    out.append('<g class="cells" shape-rendering="crispEdges">')
    for (r, c) in sorted(cells):
        snr, first, last = cells[(r, c)]
        fill = _NAN_COLOUR if math.isnan(snr) else colour((snr - lo) / (hi - lo))
        who = f"expert {first}" if first == last else f"experts {first}-{last}"
        note = f"; {kept[(r, c)]} tensor(s) kept in MXFP4" if (r, c) in kept else ""
        out.append(f'<rect class="cell" x="{x0 + c * cw}" y="{y0 + r * ch}" width="{cw}" height="{ch}" '
                   f'fill="{fill}"><title>layer {layers[r]}, {who}: {fmt_db(snr)} dB{note}</title></rect>')
    out.append("</g>")
    if kept:
        out.append('<g class="kept" fill="none" stroke="#ff2d55" stroke-width="1.5">')
        for (r, c) in sorted(kept):
            out.append(f'<rect x="{x0 + c * cw + 0.75}" y="{y0 + r * ch + 0.75}" width="{max(0.5, cw - 1.5)}" '
                       f'height="{max(0.5, ch - 1.5)}"/>')
        out.append("</g>")
    # Axes: layers down the left, expert index along the bottom.
    out.append(f'<g {_FONT} font-size="10" fill="#222">')
    step = max(1, math.ceil(nrows / max(1, H // 14)))
    for r in range(0, nrows, step):
        out.append(f'<text x="{x0 - 4}" y="{y0 + r * ch + ch / 2 + 3.5:.1f}" text-anchor="end">{layers[r]}</text>')
    cstep = max(1, math.ceil(ncols / 8))
    for c in range(0, ncols, cstep):
        x = x0 + c * cw + (cw / 2 if bw == 1 else 0)   # one expert: mark its centre; a bin: its first expert
        out.append(f'<line x1="{x:g}" y1="{y0 + H}" x2="{x:g}" y2="{y0 + H + 4}" stroke="#222"/>')
        out.append(f'<text x="{x:g}" y="{y0 + H + 15}" text-anchor="middle">{c * bw}</text>')
    out.append("</g>")
    out.append(f'<text x="{x0 + W / 2:.1f}" y="{y0 + H + 32}" {_FONT} font-size="12" text-anchor="middle">'
               f'expert</text>')
    out.append(f'<text transform="translate({x0 - 48},{y0 + H / 2:.1f}) rotate(-90)" {_FONT} font-size="12" '
               f'text-anchor="middle">layer</text>')
    # Colour legend: a vertical bar of 64 steps, high SNR on top.
    lx, lh, steps = x0 + W + 24, min(H, 320), 64
    lh = max(lh, 120)
    out.append('<g class="legend" shape-rendering="crispEdges">')
    for i in range(steps):
        t = 1.0 - (i + 0.5) / steps
        out.append(f'<rect x="{lx}" y="{y0 + i * lh / steps:.2f}" width="14" height="{lh / steps + 0.5:.2f}" '
                   f'fill="{colour(t)}"/>')
    out.append("</g>")
    out.append(f'<rect x="{lx}" y="{y0}" width="14" height="{lh}" fill="none" stroke="#222" stroke-width="0.5"/>')
    out.append(f'<g {_FONT} font-size="10" fill="#222">')
    for v in _ticks(lo, hi, 6):
        y = y0 + (1.0 - (v - lo) / (hi - lo)) * lh
        out.append(f'<line x1="{lx + 14}" y1="{y:.1f}" x2="{lx + 18}" y2="{y:.1f}" stroke="#222"/>')
        out.append(f'<text x="{lx + 21}" y="{y + 3.5:.1f}">{v:g}</text>')
    notes = ["SNR dB", f"span {hi - lo:.1f} dB"]
    if hi - lo <= MIN_SPAN_DB + 1e-9:
        notes.append(f"(min {MIN_SPAN_DB:g}, median-centred)")
    if chi:
        notes.append(f"top: &#8805; {hi:.2f}")
    if clo:
        notes.append(f"bottom: &#8804; {lo:.2f}")
    if kept:
        notes.append('<tspan fill="#ff2d55">outlined:</tspan> kept')
        notes.append("in MXFP4")
    for i, text in enumerate(notes):
        out.append(f'<text class="legend-note" x="{lx}" y="{y0 + lh + 14 + 14 * i}">{text}</text>')
    out.append("</g>")
    return out, W + 24 + 110, max(H, lh + 14 * len(notes)) + 40


def _histogram_svg(report: RequantReport, x0: int, y0: int) -> tuple[list[str], int, int]:
    """Per-tensor SNR histogram at (x0, y0), stacked by projection."""
    out: list[str] = [f'<text x="{x0}" y="{y0 - 24}" {_FONT} font-size="15" font-weight="bold">'
                      f'Per-tensor SNR (dB)</text>']
    snrs = [(r.stats.snr_db, r.projection) for r in report.tensors]
    finite = [(s, p) for s, p in snrs if math.isfinite(s)]
    n_inf = sum(1 for s, _ in snrs if math.isinf(s) and s > 0)
    n_other = len(snrs) - len(finite) - n_inf
    notes = [f"{len(snrs):,} tensors"]
    if n_inf:
        notes.append(f"{n_inf:,} exact (SNR inf) not drawn")
    if n_other:
        notes.append(f"{n_other:,} with SNR -inf/nan not drawn")
    out.append(f'<text x="{x0}" y="{y0 - 8}" {_FONT} font-size="11" fill="#444">{escape("; ".join(notes))}</text>')
    W, H = 640, 200
    if not finite:
        out.append(f'<text x="{x0}" y="{y0 + 20}" {_FONT} font-size="13">no finite SNR to draw</text>')
        return out, W, 40
    vals = [s for s, _ in finite]
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-6:
        lo, hi = lo - 0.5, hi + 0.5
    nb = min(40, max(5, math.ceil(math.sqrt(len(vals)))))
    width = (hi - lo) / nb
    projs = sorted({p for _, p in finite}, key=lambda p: (p is None, list(_PROJ_COLOURS).index(p)
                                                         if p in _PROJ_COLOURS else 99, str(p)))
    counts = [defaultdict(int) for _ in range(nb)]
    for s, p in finite:
        counts[min(nb - 1, int((s - lo) / width))][p] += 1
    top = max(sum(c.values()) for c in counts)
    bw = W / nb
    out.append(f'<rect x="{x0}" y="{y0}" width="{W}" height="{H}" fill="none" stroke="#222" stroke-width="0.5"/>')
    out.append('<g class="bars" shape-rendering="crispEdges">')
    for i, c in enumerate(counts):
        base = 0
        for p in projs:
            k = c.get(p, 0)
            if not k:
                continue
            h = H * k / top
            y = y0 + H - H * (base + k) / top
            fill = _PROJ_COLOURS.get(p, _OTHER_COLOUR)
            out.append(f'<rect class="bar" x="{x0 + i * bw:.2f}" y="{y:.2f}" width="{bw:.2f}" height="{h:.2f}" '
                       f'fill="{fill}" stroke="#fff" stroke-width="0.3"><title>{fmt_db(lo + i * width)} to '
                       f'{fmt_db(lo + (i + 1) * width)} dB, {escape(str(p or "other"))}: {k}</title></rect>')
            base += k
    out.append("</g>")
    out.append(f'<g {_FONT} font-size="10" fill="#222">')
    for v in _ticks(lo, hi, 6):
        x = x0 + (v - lo) / (hi - lo) * W
        out.append(f'<line x1="{x:.1f}" y1="{y0 + H}" x2="{x:.1f}" y2="{y0 + H + 4}" stroke="#222"/>')
        out.append(f'<text x="{x:.1f}" y="{y0 + H + 15}" text-anchor="middle">{v:g}</text>')
    for v in [t for t in _ticks(0, top, 4) if t == int(t)]:   # counts are whole
        y = y0 + H - H * v / top
        out.append(f'<line x1="{x0 - 4}" y1="{y:.1f}" x2="{x0}" y2="{y:.1f}" stroke="#222"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 3.5:.1f}" text-anchor="end">{v:g}</text>')
    out.append("</g>")
    out.append(f'<text x="{x0 + W / 2}" y="{y0 + H + 32}" {_FONT} font-size="12" text-anchor="middle">'
               f'SNR dB (vs source)</text>')
    out.append(f'<text transform="translate({x0 - 56},{y0 + H / 2}) rotate(-90)" {_FONT} font-size="12" '
               f'text-anchor="middle">tensors</text>')
    # Projection key.
    out.append(f'<g {_FONT} font-size="11" fill="#222">')
    for i, p in enumerate(projs):
        x = x0 + W + 16
        y = y0 + 10 + i * 18
        out.append(f'<rect x="{x}" y="{y - 9}" width="12" height="12" fill="{_PROJ_COLOURS.get(p, _OTHER_COLOUR)}"/>')
        out.append(f'<text x="{x + 18}" y="{y + 1}">{escape(str(p or "other"))}</text>')
    out.append("</g>")
    return out, W + 90, H + 40


def render_svg(report: RequantReport, *, max_columns: int = DEFAULT_COLUMNS) -> str:
    """The whole picture as SVG text (UTF-8, no external references)."""
    margin_left, top = 84, 72
    heat, hw, hh = _heatmap_svg(report, margin_left, top, max_columns)
    hist_top = top + hh + 48
    hist, gw, gh = _histogram_svg(report, margin_left, hist_top)
    width = margin_left + max(hw, gw) + 20
    height = hist_top + gh + 20
    title = f"k3ckpt requant report: {report.meta.source}"
    head = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{margin_left}" y="20" {_FONT} font-size="12" fill="#444">{escape(_caption(report))}</text>',
    ]
    return "\n".join(head + heat + hist + ["</svg>"]) + "\n"


def _caption(report: RequantReport) -> str:
    o = report.overall
    fm = ", ".join(report.meta.formats) or "-"
    return (f"{report.meta.source} -> {fm}: {o.tensors:,} tensors, {o.bpw:.4f} bits/weight, "
            f"pooled SNR {fmt_db(o.snr_db)} dB")


__all__ = ["DEFAULT_COLUMNS", "colour", "heatmap_grid", "render_svg"]
