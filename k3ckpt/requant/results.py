"""Per-tensor results of a requantization run (the report's input).

``TensorResult`` is the one record the pipeline produces per requantized
weight; ``k3ckpt.requant.report`` and the run manifest both store it through
``to_dict`` / ``from_dict``.  Infinite floats (an exact copy has
``snr_db = inf``) travel as the strings "inf" / "-inf" so the JSON stays
standard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .metrics import ErrorStats


def _float_in(v) -> float:
    if isinstance(v, str):
        if v in ("inf", "+inf"):
            return math.inf
        if v == "-inf":
            return -math.inf
        if v == "nan":
            return math.nan
    return float(v)


def _float_out(v: float):
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if math.isnan(v):
        return "nan"
    return v


def stats_from_dict(d: dict) -> ErrorStats:
    """Inverse of ``ErrorStats.to_dict``."""
    kw = {}
    for f in fields(ErrorStats):
        v = d[f.name]
        kw[f.name] = int(v) if f.name in ("count", "nonfinite") else _float_in(v)
    return ErrorStats(**kw)


@dataclass(frozen=True, slots=True)
class TensorResult:
    """What happened to one logical weight."""

    name: str                 # logical weight name, e.g. "model.layers.3.mlp.experts.17.w1.weight"
    layer: int | None
    expert: int | None
    projection: str | None    # "gate" | "up" | "down" (profile's TensorRole.projection)
    format: str               # registered format id written, e.g. "moet-w2"
    method: str | None        # "refit" | "keep-scales" | None
    params: int               # logical weights
    bytes: int                # bytes written for this weight (all its parts)
    stats: ErrorStats         # error_stats(decoded source, decoded output)
    max_row_bias: float       # max over rows of |mean(out - src)| / source RMS
    source_zero_fraction: float   # fraction of E2M1 zero codes (+0/-0) in the source
    code_histogram: tuple[int, ...]  # counts per output code value (4 for 2-bit formats), () if n/a
    scale_changes: int | None        # blocks whose E8M0 exponent differs from the source (moet refit), else None
    # --imatrix: (sum w x^2, sum w e^2) over the weight, w its importance per column
    # (metrics.weighted_sums); None without an importance entry for it
    weighted: tuple[float, float] | None = None

    @property
    def weighted_snr_db(self) -> float | None:
        """The importance-weighted SNR (dB), or None without an importance entry."""
        from .metrics import snr_from_sums

        return None if self.weighted is None else snr_from_sums(*self.weighted)

    @property
    def bpw(self) -> float:
        """Bits written per logical weight (all parts)."""
        return 8.0 * self.bytes / self.params if self.params else 0.0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "layer": self.layer,
            "expert": self.expert,
            "projection": self.projection,
            "format": self.format,
            "method": self.method,
            "params": self.params,
            "bytes": self.bytes,
            "stats": self.stats.to_dict(),
            "max_row_bias": _float_out(self.max_row_bias),
            "source_zero_fraction": _float_out(self.source_zero_fraction),
            "code_histogram": list(self.code_histogram),
            "scale_changes": self.scale_changes,
            **({} if self.weighted is None else {
                "weighted": [_float_out(v) for v in self.weighted],
                "weighted_snr_db": _float_out(self.weighted_snr_db)}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> TensorResult:
        return cls(
            name=str(d["name"]),
            layer=None if d.get("layer") is None else int(d["layer"]),
            expert=None if d.get("expert") is None else int(d["expert"]),
            projection=d.get("projection"),
            format=str(d["format"]),
            method=d.get("method"),
            params=int(d["params"]),
            bytes=int(d["bytes"]),
            stats=stats_from_dict(d["stats"]),
            max_row_bias=_float_in(d["max_row_bias"]),
            source_zero_fraction=_float_in(d["source_zero_fraction"]),
            code_histogram=tuple(int(c) for c in d.get("code_histogram", ())),
            scale_changes=None if d.get("scale_changes") is None else int(d["scale_changes"]),
            weighted=None if d.get("weighted") is None else tuple(_float_in(v) for v in d["weighted"]),
        )
