"""Text renderings of a ``RequantReport``: markdown for the report folder, plain text for terminals.

Both take the report object only (no file access) and return a string; the
CLI prints it and ``write_report`` stores it.  Numbers use one formatting
throughout: SNR in dB with 2 decimals, relative figures in 3 significant
digits, bias relative to the source RMS with its sign.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..formats import ids
from ..render import fmt_db, table
from ..units import human_bytes as fmt_bytes
from ..units import human_count as fmt_count

if TYPE_CHECKING:  # pragma: no cover
    from .report import Aggregate, RequantReport

SUMMARY_HEADERS = ("group", "tensors", "params", "bytes", "bits/weight", "SNR dB", "rel RMS",
                   "bias/RMS", "max abs err", "max row bias")


def fmt_g(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    if math.isinf(v) or math.isnan(v):
        return str(v)
    return f"{v:+.3g}" if signed else f"{v:.3g}"


def _summary_cells(label: str, a: Aggregate) -> list[str]:
    return [label, f"{a.tensors:,}", fmt_count(a.params), fmt_bytes(a.bytes), f"{a.bpw:.4f}", fmt_db(a.snr_db),
            fmt_g(a.rel_rms), fmt_g(a.bias_rel_rms, signed=True), fmt_g(a.max_abs), fmt_g(a.max_row_bias)]


def summary_rows(report: RequantReport) -> list[list[str]]:
    """Overall, then each format and each projection (only when there is more than one); with
    an importance matrix, the weighted SNR as a last column (``summary_headers``)."""
    weighted = report.overall.weighted_tensors > 0

    def cells(label: str, a: Aggregate) -> list[str]:
        row = _summary_cells(label, a)
        return row + [fmt_db(a.weighted_snr_db) if a.weighted_tensors else "-"] if weighted else row

    rows = [cells("all", report.overall)]
    for section, label in (("by_format", "format"), ("by_projection", "projection")):
        groups = getattr(report, section)
        if len(groups) > 1 or (groups and groups[0].tensors != report.overall.tensors):
            rows += [cells(f"{label} {a.key[0]}", a) for a in groups]
    return rows


def summary_headers(report: RequantReport) -> tuple[str, ...]:
    return SUMMARY_HEADERS + (("weighted SNR dB",) if report.overall.weighted_tensors else ())


def importance_line(report: RequantReport) -> str:
    """What the run's errors are weighted by: the importance matrix (file, datasets, chunks,
    weights without an entry), or that there was none."""
    m, o = report.meta.imatrix, report.overall
    if not m:
        return "none: errors are unweighted and the encoders weigh every column alike (give --imatrix FILE)"
    data = ", ".join(m.get("datasets") or []) or "datasets not recorded"
    chunks = f"{m.get('chunk_count', 0):,} chunks" + (f" of {m['chunk_size']:,}" if m.get("chunk_size") else "")
    text = (f"{m.get('file')} ({m.get('kind')}; {data}; {chunks}): weighted SNR {fmt_db(o.weighted_snr_db)} dB "
            f"over {o.weighted_tensors:,} tensor(s)")
    missing = int(m.get("weights_without_entry", 0))
    if missing:
        first = ", ".join(m.get("without_entry", [])[:3])
        text += f"; {missing:,} weight(s) had no entry (all-ones weights), e.g. {first}"
    return text


def layer_rows(report: RequantReport) -> list[list[str]]:
    experts: dict[int, list[Aggregate]] = defaultdict(list)
    for a in report.by_expert:
        experts[a.key[0]].append(a)
    rows = []
    for a in report.by_layer:
        ex = experts.get(a.key[0], [])
        lowest = min(ex, key=lambda e: e.snr_db) if ex else None
        rows.append([str(a.key[0]), f"{len(ex):,}", f"{a.tensors:,}", fmt_count(a.params), f"{a.bpw:.4f}",
                     fmt_db(a.snr_db),
                     "-" if lowest is None else f"{fmt_db(lowest.snr_db)} (expert {lowest.key[1]})",
                     fmt_g(a.rel_rms), fmt_g(a.bias_rel_rms, signed=True), fmt_g(a.max_abs)])
    return rows


LAYER_HEADERS = ("layer", "experts", "tensors", "params", "bits/weight", "SNR dB", "lowest expert SNR dB",
                 "rel RMS", "bias/RMS", "max abs err")
WORST_HEADERS = ("rank", "layer", "expert", "SNR dB", "rel RMS", "bias/RMS", "max abs err", "max row bias",
                 "params", "bits/weight")


def worst_rows(report: RequantReport) -> list[list[str]]:
    return [[str(i + 1), str(a.key[0]), str(a.key[1]), fmt_db(a.snr_db), fmt_g(a.rel_rms),
             fmt_g(a.bias_rel_rms, signed=True), fmt_g(a.max_abs), fmt_g(a.max_row_bias), fmt_count(a.params),
             f"{a.bpw:.4f}"] for i, a in enumerate(report.worst_experts)]


def code_line(a: Aggregate) -> str | None:
    """'code 0: 12.0%, ...' for the output code histogram, or None without one."""
    total = sum(a.code_histogram)
    if not a.code_histogram or total == 0:
        return None
    return ", ".join(f"code {i}: {100.0 * c / total:.1f}%" for i, c in enumerate(a.code_histogram))


# ---------------------------------------------------------------- reference points

# What each target gives on synthetic MXFP4 weights (docs/BENCHMARKS.md, tools/bench_requant.py,
# [3072, 3584]): Gaussian, and Student-t (5 dof) with a log-normal spread of row scales, the
# heavy-tailed shape of trained expert weights.  Trained checkpoints land near the second.
REFERENCE_SNR = {f"{ids.MOET_W2}:refit": (9.20, 8.11), f"{ids.MOET_W2}:keep-scales": (9.05, 7.64),
                 ids.MX2: (9.54, 8.60), ids.GGUF_IQ2_XS: (10.77, 10.24)}


def kept_tensors(report: RequantReport) -> list:
    """Tensors left in their source format (``--target-bpw``'s kept weights, ``keep`` overrides):
    those whose format is none of the formats the run asked for."""
    from .plan import FORMAT_ALIASES

    asked = {FORMAT_ALIASES.get(f.partition(":")[0], f.partition(":")[0]) for f in report.meta.formats}
    return [r for r in report.tensors if r.format not in asked]


def _target_key(spec: str) -> str:
    """The REFERENCE_SNR key of a format spec as given (``moet-w2`` means its refit method)."""
    fmt, _, method = spec.partition(":")
    return f"{fmt}:{method or 'refit'}" if fmt == ids.MOET_W2 else fmt


def reference_for(spec: str, snr: float, *, kept: int = 0) -> str | None:
    """``snr`` (dB, pooled) beside what format ``spec`` gives on heavy-tailed and Gaussian
    weights; None for a format without reference figures."""
    key = _target_key(spec)
    ref = REFERENCE_SNR.get(key)
    if ref is None:
        return None
    gauss, heavy = ref
    if not math.isfinite(snr):
        where = ""
    elif snr < heavy - 0.5:
        where = f"; {fmt_db(snr)} dB is below that range: look at the worst experts"
    elif snr > gauss + 0.5:
        where = f"; {fmt_db(snr)} dB is above that range" + (
            f" ({kept:,} tensor(s) kept as stored count as exact)" if kept else "")
    else:
        where = f"; {fmt_db(snr)} dB is within that range"
    return (f"{key.replace(':', ' ')} gives {heavy:.2f} dB on heavy-tailed (trained-like) and "
            f"{gauss:.2f} dB on Gaussian weights (docs/BENCHMARKS.md){where}")


def reference_line(report: RequantReport) -> str | None:
    """The overall SNR beside its format's reference figures (``reference_for``), and beside the
    keep-scales tensors of the same run when a refit run has some; None without a reference."""
    if not report.meta.formats:
        return None
    spec = report.meta.formats[0]
    parts = [reference_for(spec, report.overall.snr_db, kept=len(kept_tensors(report)))]
    keep = [r for r in report.tensors if r.format == ids.MOET_W2 and r.method == "keep-scales"]
    if keep and _target_key(spec) == f"{ids.MOET_W2}:refit" and len(keep) < len(report.tensors):
        from .report import aggregate

        parts.append(f"keep-scales baseline in this run: {fmt_db(aggregate(keep).snr_db)} dB "
                     f"over its {len(keep):,} tensor(s)")
    return "; ".join(p for p in parts if p) or None


# ---------------------------------------------------------------- markdown

def _md_cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def md_table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> str:
    out = ["| " + " | ".join(_md_cell(h) for h in headers) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _md_code(s: str) -> str:
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def render_markdown(report: RequantReport, *, svg_name: str | None = "requant_report.svg") -> str:
    """The ``requant_report.md`` text; ``svg_name`` is the picture linked (None: no link)."""
    m = report.meta
    o = report.overall
    lines = ["# k3ckpt requant report", ""]
    src = _md_code(m.source) + (f" (commit {_md_code(m.source_commit)})" if m.source_commit else "")
    lines += [
        f"- source: {src}",
        f"- formats: {', '.join(_md_code(f) for f in m.formats) or '-'}",
        f"- k3ckpt {m.k3ckpt_version}; options: {_md_code(json.dumps(dict(m.options), sort_keys=True))}",
        f"- {o.tensors:,} tensors, {o.params:,} weights, {o.bytes:,} bytes written "
        f"({o.bpw:.4f} bits per weight); SNR pooled from error and signal energies",
        "",
        "## Summary",
        "",
        md_table(summary_rows(report), summary_headers(report)),
        "",
    ]
    extra = [f"- importance: {importance_line(report)}"]
    codes = code_line(o)
    if codes:
        extra.append(f"- output codes: {codes}")
    extra.append(f"- zero codes in the source: {100.0 * o.zero_fraction:.2f}%")
    if o.scale_changes is not None:
        extra.append(f"- block scales changed from the source: {o.scale_changes:,}")
    if o.nonfinite:
        extra.append(f"- values left out as NaN/inf: {o.nonfinite:,}")
    ref = reference_line(report)
    if ref:
        extra.insert(0, f"- reference: {ref}")
    lines += extra + [""]
    if svg_name:
        lines += ["## Picture", "", f"![layer x expert SNR heatmap and per-tensor SNR histogram]({svg_name})", ""]
    if report.worst_experts:
        lines += [f"## Worst experts ({len(report.worst_experts)} lowest SNR)", "",
                  md_table(worst_rows(report), WORST_HEADERS), ""]
    if report.by_layer:
        lines += ["## Per layer", "", md_table(layer_rows(report), LAYER_HEADERS), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- terminal

def render_text(report: RequantReport) -> str:
    """Summary lines and the worst experts, for a terminal."""
    m = report.meta
    o = report.overall
    lines = [
        f"source        {m.source}" + (f" @ {m.source_commit}" if m.source_commit else ""),
        f"formats       {', '.join(m.formats) or '-'} (k3ckpt {m.k3ckpt_version})",
        f"overall       {o.tensors:,} tensors, {fmt_count(o.params)} weights, {fmt_bytes(o.bytes)}, "
        f"{o.bpw:.4f} bits/weight",
        f"error         SNR {fmt_db(o.snr_db)} dB, rel RMS {fmt_g(o.rel_rms)}, bias/RMS "
        f"{fmt_g(o.bias_rel_rms, signed=True)}, max abs {fmt_g(o.max_abs)}, max row bias {fmt_g(o.max_row_bias)}",
    ]
    lines.append(f"importance    {importance_line(report)}")
    ref = reference_line(report)
    if ref:
        lines.append(f"reference     {ref}")
    codes = code_line(o)
    if codes:
        lines.append(f"codes         {codes}")
    if o.scale_changes is not None:
        lines.append(f"scales        {o.scale_changes:,} block scale(s) changed from the source")
    if o.nonfinite:
        lines.append(f"nonfinite     {o.nonfinite:,} value(s) left out as NaN/inf")
    lines += ["", table(summary_rows(report), summary_headers(report))]
    if report.by_layer:
        snrs = [a for a in report.by_layer]
        lo = min(snrs, key=lambda a: a.snr_db)
        hi = max(snrs, key=lambda a: a.snr_db)
        lines += ["", f"layers        {len(snrs)}: SNR from {fmt_db(lo.snr_db)} dB (layer {lo.key[0]}) "
                      f"to {fmt_db(hi.snr_db)} dB (layer {hi.key[0]})"]
    if report.worst_experts:
        lines += ["", f"worst {len(report.worst_experts)} experts (of {len(report.by_expert):,})",
                  table(worst_rows(report), WORST_HEADERS)]
    return "\n".join(lines)
