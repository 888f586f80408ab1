"""Requantization error reports: aggregate per-tensor results, write and read them.

A ``RequantReport`` holds the run's ``TensorResult`` records and aggregates
computed from them (per projection, per expert, per layer, per format, overall,
and the worst experts).  ``write_report`` stores it as three files in one
folder, each written atomically:

- ``requant_report.json``: the stable schema of docs/requant-report.md;
- ``requant_report.md``: summary, per-layer table, worst experts, picture link;
- ``requant_report.svg``: layer x expert SNR heatmap and per-tensor SNR histogram.

Aggregates pool the *sums* behind each tensor's ``ErrorStats`` (signal energy
``sum x^2 = n ref_rms^2``, error energy ``sum e^2 = n err_rms^2``, error sum
``n mean_bias``) with ``math.fsum`` and apply the definitions of
``k3ckpt.requant.metrics`` to them, so a group's SNR is what ``error_stats``
would give over the group's concatenated tensors (up to rounding), never an
average of dBs.  Cosine similarity is not pooled: the per-tensor summaries do
not determine it.

Nothing here stores a clock time, so the same results give the same bytes
(a resumed run rewrites an identical report).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from .. import __version__
from ..errors import InvalidFileError, NotFoundError, UsageError
from ..io.writer import atomic_write_bytes, atomic_write_chunks
from .results import TensorResult, _float_out
from .metrics import snr_from_sums

# Renderers are part of the report API; they import nothing from here at run time.
from .heatmap import DEFAULT_COLUMNS, render_svg  # noqa: E402
from .report_render import render_markdown, render_text  # noqa: E402,F401

SCHEMA_VERSION = 1
REPORT_KIND = "k3ckpt-requant-report"
JSON_NAME = "requant_report.json"
MARKDOWN_NAME = "requant_report.md"
SVG_NAME = "requant_report.svg"
DEFAULT_WORST = 10

# Section name -> names of the key fields of its rows (docs/requant-report.md).
GROUP_KEYS: dict[str, tuple[str, ...]] = {
    "by_format": ("format",),
    "by_projection": ("projection",),
    "by_layer": ("layer",),
    "by_expert": ("layer", "expert"),
}


def _json_normal(obj: Any, what: str) -> Any:
    """``obj`` as it will read back from JSON (tuples become lists, ...)."""
    try:
        return json.loads(json.dumps(obj, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise UsageError(f"{what} must be JSON-serialisable without NaN/inf: {e}") from None


@dataclass(frozen=True)
class ReportMeta:
    """Where the results come from and how they were made."""

    source: str                              # SRC as the user gave it
    formats: tuple[str, ...] = ()            # format ids requested (empty: taken from the tensors)
    source_commit: str | None = None         # hub commit / revision of SRC, when known
    k3ckpt_version: str = __version__
    options: Mapping[str, Any] = field(default_factory=dict)   # command options, JSON values
    # the importance matrix of an --imatrix run (importance.Importance.describe), else None
    imatrix: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            raise UsageError(f"report meta: source must be a string, found {type(self.source).__name__}")
        if isinstance(self.formats, str):
            raise UsageError("report meta: formats must be a sequence of format ids, not one string")
        if self.source_commit is not None and not isinstance(self.source_commit, str):
            raise UsageError(f"report meta: source_commit must be a string or None, "
                             f"found {type(self.source_commit).__name__}")
        if not isinstance(self.k3ckpt_version, str):
            raise UsageError(f"report meta: k3ckpt_version must be a string, "
                             f"found {type(self.k3ckpt_version).__name__}")
        object.__setattr__(self, "formats", tuple(str(f) for f in self.formats))
        if not isinstance(self.options, Mapping):
            raise UsageError(f"report meta: options must be a mapping, found {type(self.options).__name__}")
        # Normalise to what JSON gives back, so a loaded report equals the written one.
        object.__setattr__(self, "options", _json_normal(dict(self.options), "report meta options"))
        if self.imatrix is not None:
            object.__setattr__(self, "imatrix", _json_normal(dict(self.imatrix), "report meta imatrix"))

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "source_commit": self.source_commit,
            "formats": list(self.formats),
            "k3ckpt_version": self.k3ckpt_version,
            "options": dict(self.options),
            **({} if self.imatrix is None else {"imatrix": dict(self.imatrix)}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReportMeta:
        commit = d.get("source_commit")
        return cls(
            source=d["source"],
            formats=tuple(d.get("formats", ())),
            source_commit=None if commit is None else str(commit),
            k3ckpt_version=str(d["k3ckpt_version"]),
            options=d.get("options", {}),
            imatrix=d.get("imatrix"),
        )


@dataclass(frozen=True)
class Aggregate:
    """Pooled error and size of a group of tensors (one row of a report table)."""

    key: tuple                  # group key values, named by GROUP_KEYS; () for overall
    tensors: int
    params: int
    bytes: int
    count: int                  # finite value pairs pooled
    nonfinite: int
    sum_ref_sq: float           # sum x^2 over the group
    sum_err_sq: float           # sum e^2
    sum_err: float              # sum e
    max_abs: float              # largest |e|
    max_row_bias: float         # largest per-row |bias| / RMS of any tensor in the group
    zero_fraction: float        # source zero codes / weights (params-weighted)
    code_histogram: tuple[int, ...]   # summed; () when tensors disagree on the code count
    scale_changes: int | None   # summed over tensors that report it; None if none do
    # --imatrix: the tensors with an importance entry, and their weighted sums (metrics.weighted_sums)
    weighted_tensors: int = 0
    sum_wref_sq: float = 0.0
    sum_werr_sq: float = 0.0

    @property
    def bpw(self) -> float:
        """Bits written per logical weight."""
        return 8.0 * self.bytes / self.params if self.params else 0.0

    @property
    def snr_db(self) -> float:
        return snr_from_sums(self.sum_ref_sq, self.sum_err_sq)

    @property
    def weighted_snr_db(self) -> float | None:
        """Importance-weighted SNR of the tensors with an importance entry; None without any."""
        return snr_from_sums(self.sum_wref_sq, self.sum_werr_sq) if self.weighted_tensors else None

    @property
    def rel_mse(self) -> float:
        if self.sum_err_sq == 0.0:
            return 0.0
        if self.sum_ref_sq == 0.0:
            return math.inf
        return self.sum_err_sq / self.sum_ref_sq

    @property
    def rel_rms(self) -> float:
        return math.sqrt(self.rel_mse)

    @property
    def mean_bias(self) -> float:
        return self.sum_err / self.count if self.count else 0.0

    @property
    def ref_rms(self) -> float:
        return math.sqrt(self.sum_ref_sq / self.count) if self.count else 0.0

    @property
    def err_rms(self) -> float:
        return math.sqrt(self.sum_err_sq / self.count) if self.count else 0.0

    @property
    def bias_rel_rms(self) -> float:
        b = self.mean_bias
        if b == 0.0:
            return 0.0
        r = self.ref_rms
        return math.copysign(math.inf, b) if r == 0.0 else b / r

    def to_dict(self, key_names: tuple[str, ...] = ()) -> dict:
        assert len(key_names) == len(self.key)
        out: dict[str, Any] = dict(zip(key_names, self.key))
        out.update(
            tensors=self.tensors,
            params=self.params,
            bytes=self.bytes,
            bpw=self.bpw,
            snr_db=_float_out(self.snr_db),
            rel_mse=_float_out(self.rel_mse),
            rel_rms=_float_out(self.rel_rms),
            mean_bias=_float_out(self.mean_bias),
            bias_rel_rms=_float_out(self.bias_rel_rms),
            max_abs=_float_out(self.max_abs),
            max_row_bias=_float_out(self.max_row_bias),
            ref_rms=_float_out(self.ref_rms),
            err_rms=_float_out(self.err_rms),
            zero_fraction=_float_out(self.zero_fraction),
            count=self.count,
            nonfinite=self.nonfinite,
            sum_ref_sq=_float_out(self.sum_ref_sq),
            sum_err_sq=_float_out(self.sum_err_sq),
            sum_err=_float_out(self.sum_err),
            code_histogram=list(self.code_histogram),
            scale_changes=self.scale_changes,
        )
        if self.weighted_tensors:   # only in --imatrix runs, so other reports read as before
            out.update(weighted_tensors=self.weighted_tensors, weighted_snr_db=_float_out(self.weighted_snr_db),
                       sum_wref_sq=_float_out(self.sum_wref_sq), sum_werr_sq=_float_out(self.sum_werr_sq))
        return out


def _terms(r: TensorResult) -> tuple:
    """One tensor's contribution to every pooled field (see ``_pool``)."""
    s = r.stats
    n = s.count
    # Sums recovered from the tensor's ErrorStats (definitions in metrics.py).
    return (r.params, r.bytes, n, s.nonfinite, n * s.ref_rms * s.ref_rms, n * s.err_rms * s.err_rms,
            n * s.mean_bias, s.max_abs, r.max_row_bias, r.source_zero_fraction * r.params,
            r.code_histogram, r.scale_changes, r.weighted)


def _pool(terms: list[tuple], key: tuple) -> Aggregate:
    if not terms:
        return Aggregate(key=tuple(key), tensors=0, params=0, bytes=0, count=0, nonfinite=0, sum_ref_sq=0.0,
                         sum_err_sq=0.0, sum_err=0.0, max_abs=0.0, max_row_bias=0.0, zero_fraction=0.0,
                         code_histogram=(), scale_changes=None)
    (params, nbytes, count, bad, sxx, see, se, maxabs, rowbias, zeros, hists, changes, weighted) = zip(*terms)
    weighted = [w for w in weighted if w is not None]
    params_total = sum(params)
    hist_lens = {len(h) for h in hists}
    if len(hist_lens) == 1 and 0 not in hist_lens:
        hist = tuple(sum(c) for c in zip(*hists))
    else:
        hist = ()
    changed = [c for c in changes if c is not None]
    return Aggregate(
        key=tuple(key),
        tensors=len(terms),
        params=params_total,
        bytes=sum(nbytes),
        count=sum(count),
        nonfinite=sum(bad),
        # fsum: the pooled sums are exact to one rounding whatever the group size.
        sum_ref_sq=math.fsum(sxx),
        sum_err_sq=math.fsum(see),
        sum_err=math.fsum(se),
        max_abs=max(maxabs),
        max_row_bias=max(rowbias),
        zero_fraction=math.fsum(zeros) / params_total if params_total else 0.0,
        code_histogram=hist,
        scale_changes=sum(changed) if changed else None,
        weighted_tensors=len(weighted),
        sum_wref_sq=math.fsum(w[0] for w in weighted),
        sum_werr_sq=math.fsum(w[1] for w in weighted),
    )


def aggregate(results: Iterable[TensorResult], key: tuple = ()) -> Aggregate:
    """Pool ``results`` (see the module docstring for how)."""
    return _pool([_terms(r) for r in results], key)


def _sort_key(v) -> tuple:
    # None sorts first, then numbers, then strings (projection order gate, up, down is kept below).
    if v is None:
        return (0, 0, "")
    if isinstance(v, (int, float)):
        return (1, v, "")
    return (2, _PROJ_ORDER.get(v, len(_PROJ_ORDER)), str(v))


_PROJ_ORDER = {"gate": 0, "up": 1, "gate_up": 2, "down": 3}


def _grouped(results: tuple[TensorResult, ...], terms: list[tuple], keyfn) -> tuple[Aggregate, ...]:
    groups: dict[tuple, list[tuple]] = defaultdict(list)
    for r, t in zip(results, terms):
        k = keyfn(r)
        if k is not None:
            groups[k].append(t)
    keys = sorted(groups, key=lambda k: tuple(_sort_key(v) for v in k))
    return tuple(_pool(groups[k], k) for k in keys)


def worst(experts: Iterable[Aggregate], n: int) -> tuple[Aggregate, ...]:
    """The ``n`` experts of lowest pooled SNR; ties by (layer, expert).  NaN SNR counts as worst."""
    def rank(a: Aggregate):
        s = a.snr_db
        return (-math.inf if math.isnan(s) else s, a.key)

    return tuple(sorted(experts, key=rank)[: max(0, n)])


@dataclass(frozen=True)
class RequantReport:
    """A run's per-tensor results and everything aggregated from them."""

    meta: ReportMeta
    tensors: tuple[TensorResult, ...]
    worst_n: int
    overall: Aggregate
    by_format: tuple[Aggregate, ...]
    by_projection: tuple[Aggregate, ...]    # tensors with a projection
    by_layer: tuple[Aggregate, ...]         # tensors with a layer
    by_expert: tuple[Aggregate, ...]        # tensors with a layer and an expert; key (layer, expert)
    worst_experts: tuple[Aggregate, ...]    # lowest SNR first

    @property
    def formats(self) -> tuple[str, ...]:
        """Formats written, in by_format order."""
        return tuple(a.key[0] for a in self.by_format)

    def to_json(self, *, lazy: bool = False) -> dict:
        """The stable JSON form (docs/requant-report.md); with ``lazy`` the tensor rows come
        as an iterator (for ``json_chunks``)."""
        out: dict[str, Any] = {"kind": REPORT_KIND, "schema_version": SCHEMA_VERSION}
        out.update(self._summary_json())
        rows = (_tensor_json(r) for r in self.tensors)
        out["tensors"] = rows if lazy else list(rows)
        return out

    def _summary_json(self) -> dict:
        # Every section but the tensors: what load_report checks against the file.
        out: dict[str, Any] = {
            "meta": self.meta.to_dict(),
            "worst_n": self.worst_n,
            "overall": self.overall.to_dict(),
        }
        for section, names in GROUP_KEYS.items():
            out[section] = [a.to_dict(names) for a in getattr(self, section)]
        out["worst_experts"] = [a.to_dict(GROUP_KEYS["by_expert"]) for a in self.worst_experts]
        return out


def _tensor_json(r: TensorResult) -> dict:
    """A tensor row of the report's JSON: ``r.to_dict()`` plus ``bpw``."""
    return {**r.to_dict(), "bpw": r.bpw}   # bpw: derived, for readers; ignored on load


_ROW_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def dump_json(obj: dict) -> str:
    """The report's JSON text: top-level keys one per line, one compact row per line
    in the row lists (readable with grep and diff, and far faster than indent=)."""
    return "".join(json_chunks(obj))


def json_chunks(obj: Mapping[str, Any]) -> Iterator[str]:
    """``dump_json``'s text in pieces.  A value may also be an iterator of row dicts, encoded
    as it is consumed: K3's report has about 247,000 tensor rows (200 MB of JSON)."""
    enc = _ROW_ENCODER.encode
    yield "{\n"
    items = list(obj.items())
    for i, (k, v) in enumerate(items):
        comma = "," if i + 1 < len(items) else ""
        rows = iter(v) if isinstance(v, Iterator) or (
            isinstance(v, list) and v and all(isinstance(x, dict) for x in v)) else None
        first = next(rows, None) if rows is not None else None
        if first is None:
            yield f"{enc(k)}:{enc([] if rows is not None else v)}{comma}\n"
            continue
        yield f"{enc(k)}:[\n{enc(first)}"
        for x in rows:
            yield ",\n" + enc(x)
        yield f"\n]{comma}\n"
    yield "}\n"


def build_report(results: Iterable[TensorResult], meta: ReportMeta | Mapping[str, Any], *,
                 worst_n: int = DEFAULT_WORST) -> RequantReport:
    """Aggregate ``results`` into a report.  ``meta`` may be a ``ReportMeta`` or its dict."""
    if not isinstance(meta, ReportMeta):
        if not isinstance(meta, Mapping):
            raise UsageError(f"report meta must be a ReportMeta or a mapping, found {type(meta).__name__}")
        try:
            meta = ReportMeta(**meta)
        except TypeError as e:
            raise UsageError(f"report meta: {e}") from None
    if isinstance(worst_n, bool) or not isinstance(worst_n, int) or worst_n < 0:
        raise UsageError(f"worst_n must be an integer >= 0, found {worst_n!r}")
    rs = tuple(results)
    for r in rs:
        if not isinstance(r, TensorResult):
            raise UsageError(f"report results must be TensorResult records, found {type(r).__name__}")
    names = [r.name for r in rs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[0]
        raise UsageError(f"report results name tensor {dup!r} more than once")
    terms = [_terms(r) for r in rs]
    by_expert = _grouped(rs, terms, lambda r: None if r.layer is None or r.expert is None else (r.layer, r.expert))
    if not meta.formats:
        meta = replace(meta, formats=tuple(sorted({r.format for r in rs})))
    return RequantReport(
        meta=meta,
        tensors=rs,
        worst_n=worst_n,
        overall=_pool(terms, ()),
        by_format=_grouped(rs, terms, lambda r: (r.format,)),
        by_projection=_grouped(rs, terms, lambda r: None if r.projection is None else (r.projection,)),
        by_layer=_grouped(rs, terms, lambda r: None if r.layer is None else (r.layer,)),
        by_expert=by_expert,
        worst_experts=worst(by_expert, worst_n),
    )


def with_worst(report: RequantReport, n: int) -> RequantReport:
    """``report`` with its worst-experts list recomputed for ``n``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise UsageError(f"worst_n must be an integer >= 0, found {n!r}")
    return replace(report, worst_n=n, worst_experts=worst(report.by_expert, n))


@dataclass(frozen=True)
class ReportPaths:
    json: Path
    markdown: Path
    svg: Path


def _atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_report(results: Iterable[TensorResult] | RequantReport, dst, *,
                 meta: ReportMeta | Mapping[str, Any] | None = None, worst_n: int = DEFAULT_WORST,
                 heatmap_columns: int | None = None) -> ReportPaths:
    """Write the JSON, markdown and SVG reports into the folder ``dst`` (created if missing).

    ``results`` is either the run's ``TensorResult`` records (then ``meta`` is
    required) or a built ``RequantReport``.  ``heatmap_columns`` caps the
    heatmap's expert columns (experts are binned beyond it).
    """
    if isinstance(results, RequantReport):
        if meta is not None:
            raise UsageError("write_report takes meta= only with TensorResult records, not with a RequantReport")
        report = results
    else:
        if meta is None:
            raise UsageError("write_report needs meta= when given TensorResult records")
        report = build_report(results, meta, worst_n=worst_n)
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"report destination {dst} exists and is not a folder")
    dst.mkdir(parents=True, exist_ok=True)
    paths = ReportPaths(json=dst / JSON_NAME, markdown=dst / MARKDOWN_NAME, svg=dst / SVG_NAME)
    svg = render_svg(report, max_columns=DEFAULT_COLUMNS if heatmap_columns is None else heatmap_columns)
    # Picture and markdown first: once the JSON exists, what it points to exists too.
    _atomic_write_text(paths.svg, svg)
    _atomic_write_text(paths.markdown, render_markdown(report, svg_name=SVG_NAME))
    atomic_write_chunks(paths.json, json_chunks(report.to_json(lazy=True)))
    return paths


def resolve_report_path(path) -> Path:
    """``path`` itself, or ``path/requant_report.json`` for a folder."""
    p = Path(path)
    if p.is_dir():
        p = p / JSON_NAME
    if not p.is_file():
        raise NotFoundError(f"no requant report at {p}" + ("" if p.name == JSON_NAME else
                            f" (give a {JSON_NAME} file or the folder holding it)"))
    return p


def load_report(path) -> RequantReport:
    """Read a report written by ``write_report`` (a JSON file or its folder).

    Strict: another kind of file, another schema version, missing fields or
    aggregates that disagree with the tensors raise ``InvalidFileError``.
    """
    p = resolve_report_path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise InvalidFileError(f"not UTF-8 text: {e}", file=str(p)) from None
    except json.JSONDecodeError as e:
        raise InvalidFileError(f"not JSON: {e}", file=str(p)) from None
    if not isinstance(data, dict) or data.get("kind") != REPORT_KIND:
        found = data.get("kind") if isinstance(data, dict) else type(data).__name__
        raise InvalidFileError(f"not a k3ckpt requant report: expected kind {REPORT_KIND!r}, found {found!r}",
                               file=str(p))
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise InvalidFileError(f"requant report schema_version {version!r} is not supported "
                               f"(this k3ckpt {__version__} reads version {SCHEMA_VERSION})", file=str(p))
    try:
        meta = ReportMeta.from_dict(data["meta"])
        worst_n = data["worst_n"]
        if not isinstance(data["tensors"], list):
            raise TypeError("tensors is not a list")
        tensors = [TensorResult.from_dict(t) for t in data["tensors"]]
        report = build_report(tensors, meta, worst_n=worst_n)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise InvalidFileError(f"malformed requant report: {what}", file=str(p)) from None
    # Stored aggregates must be what the tensors give (catches hand edits and
    # truncated tensor lists).  Keys added later in version 1 are ignored.
    fresh = report._summary_json()
    for section in fresh:
        if data.get(section) != fresh[section]:
            raise InvalidFileError(f"requant report section {section!r} does not match its tensors",
                                   file=str(p))
    return report

