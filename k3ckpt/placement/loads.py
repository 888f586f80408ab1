"""Reading and checking expert-load statistics and routing traces.

Loads are ``[moe_layers, experts]`` non-negative floats in layer order (row ``i``
is the ``i``-th MoE layer).  Accepted files:

* ``.npy``: a 2-D numeric array.
* ``.json``: ``{"logical_count": [[...], ...]}`` (the SGLang / DeepSeek dump) or a
  plain nested list.
* ``.csv``: one row per layer, comma separated, no header (a header line of
  non-numbers is skipped).

A file may also hold one row per *model* layer (dense layers included, as the
DeepSeek-V3 dumps do: 61 rows, the first 3 zero); rows are then picked by the
model's ``layer_ids``.

Traces are ``.npy`` integer arrays ``[tokens, moe_layers, top_k]`` of expert ids.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from ..errors import InvalidFileError, NotFoundError, UsageError

__all__ = [
    "read_loads",
    "check_loads",
    "write_loads",
    "read_trace",
    "check_trace",
    "loads_from_trace",
    "read_keep_tiers",
]


def _geometry_shape(geometry) -> tuple[int, int, tuple[int, ...]]:
    return int(geometry.moe_layers), int(geometry.experts), tuple(int(i) for i in geometry.layer_ids)


def check_loads(loads, geometry=None, *, file: str | None = None) -> np.ndarray:
    """Validate loads and return them as float64 ``[moe_layers, experts]``.

    With a geometry, a file with one row per model layer is cut to the MoE rows
    (``layer_ids``).  Negative, NaN or infinite entries, a wrong shape, or no load at
    all raise ``UsageError``.
    """
    try:
        arr = np.asarray(loads, dtype=np.float64)
    except (TypeError, ValueError):
        raise UsageError("loads must be a rectangular table of numbers", file=file) from None
    if arr.ndim != 2:
        raise UsageError(f"loads must be 2-D [moe_layers, experts], found {arr.ndim}-D {list(arr.shape)}", file=file)
    if geometry is not None:
        L, E, ids = _geometry_shape(geometry)
        if arr.shape[1] != E:
            raise UsageError(f"loads have {arr.shape[1]} experts per layer, the model has {E}", file=file)
        if arr.shape[0] != L:
            if ids and arr.shape[0] > max(ids) and arr.shape[0] != L:
                arr = arr[list(ids)]
            else:
                raise UsageError(
                    f"loads have {arr.shape[0]} layers; the model has {L} MoE layers"
                    + (f" (ids {ids[0]}..{ids[-1]})" if ids else ""),
                    file=file,
                )
    if not np.isfinite(arr).all():
        l, e = np.argwhere(~np.isfinite(arr))[0]
        raise UsageError(f"load of layer row {l}, expert {e} is {arr[l, e]} (NaN or infinite)", file=file)
    if (arr < 0).any():
        l, e = np.argwhere(arr < 0)[0]
        raise UsageError(f"load of layer row {l}, expert {e} is negative ({arr[l, e]})", file=file)
    if arr.size == 0 or arr.sum() <= 0:
        raise UsageError("loads are all zero: nothing to balance", file=file)
    return arr


def _read_json(path: Path):
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidFileError(f"not valid JSON: {exc}", file=str(path)) from None
    if isinstance(data, dict):
        for key in ("logical_count", "loads", "expert_load"):
            if key in data:
                return data[key]
        raise UsageError("JSON loads need a 'logical_count' table or a plain nested list", file=str(path))
    return data


def _read_csv(path: Path):
    text = path.read_bytes().decode("utf-8", errors="strict")
    rows = [r for r in csv.reader(io.StringIO(text)) if r and any(c.strip() for c in r)]
    if rows:
        try:
            [float(c) for c in rows[0]]
        except ValueError:
            rows = rows[1:]  # header
    try:
        return [[float(c) for c in r] for r in rows]
    except ValueError as exc:
        raise UsageError(f"CSV loads must be numbers: {exc}", file=str(path)) from None


def read_loads(path: str | Path, geometry=None) -> np.ndarray:
    """Read ``[moe_layers, experts]`` loads from NPY, JSON or CSV (see module doc)."""
    path = Path(path)
    if not path.is_file():
        raise NotFoundError("loads file not found", file=str(path))
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            raw = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise InvalidFileError(f"not a readable NPY array: {exc}", file=str(path)) from None
        if not (np.issubdtype(raw.dtype, np.number) or raw.dtype == bool):
            raise UsageError(f"NPY loads must be numeric, found dtype {raw.dtype}", file=str(path))
    elif suffix == ".json":
        raw = _read_json(path)
    elif suffix == ".csv":
        raw = _read_csv(path)
    else:
        raise UsageError(f"unknown loads format {suffix!r}; use .npy, .json or .csv", file=str(path))
    if isinstance(raw, list) and raw and isinstance(raw[0], list):
        widths = {len(r) for r in raw}
        if len(widths) != 1:
            raise UsageError(f"rows have different lengths {sorted(widths)}", file=str(path))
    return check_loads(raw, geometry, file=str(path))


def write_loads(path: str | Path, loads: np.ndarray) -> None:
    """Write loads in the format named by the suffix (``.npy``, ``.json``, ``.csv``)."""
    path = Path(path)
    arr = np.asarray(loads, dtype=np.float64)
    suffix = path.suffix.lower()
    if suffix == ".npy":
        np.save(path, arr)
    elif suffix == ".json":
        path.write_text(json.dumps({"logical_count": arr.tolist()}))
    elif suffix == ".csv":
        path.write_text("\n".join(",".join(repr(float(v)) for v in row) for row in arr) + "\n")
    else:
        raise UsageError(f"unknown loads format {suffix!r}; use .npy, .json or .csv", file=str(path))


def check_trace(trace, geometry=None, *, file: str | None = None) -> np.ndarray:
    """Validate a routing trace ``[tokens, moe_layers, top_k]`` of expert ids.

    Ids must be integers in ``[0, experts)``, and a token's ids in one layer
    distinct (top-k picks each expert once).
    """
    arr = np.asarray(trace)
    if not np.issubdtype(arr.dtype, np.integer):
        raise UsageError(f"a routing trace holds integer expert ids, found dtype {arr.dtype}", file=file)
    if arr.ndim != 3 or arr.shape[0] < 1:
        raise UsageError(f"a routing trace is [tokens, moe_layers, top_k], found shape {list(arr.shape)}", file=file)
    if geometry is not None:
        L, E, _ = _geometry_shape(geometry)
        k = int(geometry.top_k)
        if arr.shape[1:] != (L, k):
            raise UsageError(f"trace is [*, {arr.shape[1]}, {arr.shape[2]}], the model needs [*, {L}, {k}]", file=file)
        if arr.min() < 0 or arr.max() >= E:
            raise UsageError(f"trace names expert {int(arr.max())} (or a negative one); the model has {E}", file=file)
    elif arr.min() < 0:
        raise UsageError("trace holds negative expert ids", file=file)
    srt = np.sort(arr, axis=2)
    dup = (srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2)
    if dup.any():
        t, l = np.argwhere(dup)[0]
        raise UsageError(f"token {t} picks one expert twice in layer row {l}", file=file)
    return arr.astype(np.int32, copy=False)


def read_trace(path: str | Path, geometry=None) -> np.ndarray:
    """Read a ``.npy`` routing trace and validate it (``check_trace``)."""
    path = Path(path)
    if not path.is_file():
        raise NotFoundError("trace file not found", file=str(path))
    if path.suffix.lower() != ".npy":
        raise UsageError("routing traces are .npy arrays [tokens, moe_layers, top_k]", file=str(path))
    try:
        raw = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise InvalidFileError(f"not a readable NPY array: {exc}", file=str(path)) from None
    return check_trace(raw, geometry, file=str(path))


def loads_from_trace(trace: np.ndarray, experts: int) -> np.ndarray:
    """``[moe_layers, experts]`` selection counts of a trace ``[tokens, moe_layers, top_k]``."""
    T, L, k = trace.shape
    flat = (np.arange(L)[None, :, None] * experts + trace).ravel()
    return np.bincount(flat, minlength=L * experts).reshape(L, experts).astype(np.float64)


def read_keep_tiers(paths: list[str | Path], geometry) -> np.ndarray:
    """``[moe_layers, experts]`` tier per expert: how many keep-lists name it.

    Each file is a REAP-style ``{"layers": {"<layer id>": {"keep": [ids...]}}}``
    (layer ids are model layer numbers, matched to ``geometry.layer_ids``).
    """
    L, E, ids = _geometry_shape(geometry)
    tiers = np.zeros((L, E), dtype=np.int64)
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise NotFoundError("keep-list file not found", file=str(p))
        try:
            data = json.loads(p.read_bytes().decode("utf-8"))
            layers = data["layers"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InvalidFileError(f"not a keep-list JSON ({exc})", file=str(p)) from None
        for row, lid in enumerate(ids):
            entry = layers.get(str(lid))
            if entry is None:
                raise UsageError(f"keep-list has no layer {lid}", file=str(p))
            keep = np.asarray(entry.get("keep", []), dtype=np.int64)
            if keep.size and (keep.min() < 0 or keep.max() >= E):
                raise UsageError(f"layer {lid} keeps expert {int(keep.max())}; the model has {E}", file=str(p))
            tiers[row, keep] += 1
    return tiers
