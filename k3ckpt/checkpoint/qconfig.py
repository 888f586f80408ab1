"""The ``quantization_config`` a requantized checkpoint carries (see docs/requant.md).

``k3ckpt requant`` replaces config.json's ``quantization_config`` with::

    {"quant_method": "k3ckpt", "format_version": 1, "producer": "k3ckpt 0.1.0",
     "config_groups": {"group_0": {"format": "moet-w2", "method": "refit",
                                   "bits_per_weight": 2.25, "block_size": 32,
                                   "parts": {"packed": ".weight_packed", "scale": ".weight_scale"},
                                   "spec": "docs/formats/moet-w2.md#stored-tensors",
                                   "weights": 96, "targets": ["re:^...$", ...]}},
     "ignore": [],
     "source_quantization_config": {...the source's own block, unchanged...}}

A logical weight (``<base>.weight`` for a tensor ``<base>.weight_packed``) is
stored in a group's format iff it matches one of the group's ``targets``
(``re:`` + a Python regular expression, fully anchored); the targets list
exactly the weights written, so a reader needs nothing else.  Quantized
weights in no group keep the source's format, which
``source_quantization_config`` describes.

``--format mxfp4`` output carries the config its ecosystem reads instead
(``requant.mxfp4_config``: compressed-tensors, or transformers' gpt-oss ``mxfp4``).

Reading a config (``declared_groups``, ``source_quantization_config``) and writing one
(``build_config``, ``with_config``) live here, below every command that does either.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable, Mapping

FORMAT_VERSION = 1
QUANT_METHOD = "k3ckpt"
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def logical_weight_name(base: str, first_suffix: str) -> str:
    """The logical weight of stored tensors ``base + suffix``: ``base.weight`` for
    compressed-tensors style suffixes (``.weight_packed``), else ``base``."""
    return base + ".weight" if first_suffix.startswith(".weight") else base


def targets_for(weights: Iterable[str]) -> list[str]:
    """Anchored ``re:`` patterns matching exactly ``weights`` (and nothing else).

    Names are grouped by template (integer components as slots); a template
    whose names are the full product of the indices seen per slot becomes one
    pattern with an alternation per slot, any other name is listed literally.
    """
    by_template: dict[tuple[str, ...], set[tuple[str, ...]]] = defaultdict(set)
    for w in weights:
        pieces = _INDEX.split(w)
        by_template[tuple(pieces)].add(tuple(_INDEX.findall(w)))
    out = []
    for pieces, idx in sorted(by_template.items()):
        slots = [sorted({t[i] for t in idx}, key=int) for i in range(len(pieces) - 1)]
        product = 1
        for s in slots:
            product *= len(s)
        if product == len(idx):
            body = re.escape(pieces[0])
            for s, text in zip(slots, pieces[1:]):
                body += (s[0] if len(s) == 1 else "(?:" + "|".join(s) + ")") + re.escape(text)
            out.append(f"re:^{body}$")
        else:
            for t in sorted(idx, key=lambda t: tuple(map(int, t))):
                name = pieces[0] + "".join(i + p for i, p in zip(t, pieces[1:]))
                out.append(f"re:^{re.escape(name)}$")
    return out


def build_config(source_config: Mapping | None, groups: Mapping[tuple[str, str | None], list[str]], *,
                 ignore: Iterable[str] = ()) -> dict:
    """The ``quantization_config`` block for ``groups``: (format id, method) -> logical weights."""
    from .. import __version__
    from ..formats import get_format

    qc: dict = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "producer": f"k3ckpt {__version__}",
                "config_groups": {}, "ignore": sorted(ignore)}
    for i, ((fid, method), weights) in enumerate(sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))):
        info = get_format(fid).info
        parts = {p.role: p.suffix for p in info.parts}
        parts.update((t.role, t.suffix) for t in info.tensor_parts)
        qc["config_groups"][f"group_{i}"] = {
            "format": fid, "method": method, "bits_per_weight": info.bits_per_weight,
            "tensor_bytes": info.tensor_bytes, "block_size": info.block, "parts": parts, "spec": info.spec,
            "weights": len(weights), "targets": targets_for(weights),
        }
    src = source_quantization_config(source_config)
    qc["source_quantization_config"] = src
    return qc


def source_quantization_config(config: Mapping | None) -> dict | None:
    """The ``quantization_config`` block of ``config`` (top level, else ``text_config``'s), or None."""
    if not config:
        return None
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping) and isinstance(config.get("text_config"), Mapping):
        qc = config["text_config"].get("quantization_config")
    return dict(qc) if isinstance(qc, Mapping) else None


def with_config(config: dict, qc: dict) -> dict:
    """``config`` with its quantization_config (top level, and in text_config when there) replaced."""
    import copy

    out = copy.deepcopy(config)
    holders = [out] + ([out["text_config"]] if isinstance(out.get("text_config"), dict) else [])
    placed = False
    for h in holders:
        if "quantization_config" in h:
            h["quantization_config"] = qc
            placed = True
    if not placed:
        out["quantization_config"] = qc
    return out


def declared_groups(config: Mapping | None) -> list[tuple[str, list[re.Pattern[str]]]]:
    """(format id, compiled targets) of a k3ckpt ``quantization_config``; [] for any other config."""
    qc = source_quantization_config(config)
    if not qc or qc.get("quant_method") != QUANT_METHOD:
        return []
    out = []
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping):
        return []
    for g in groups.values():
        if not isinstance(g, Mapping) or not isinstance(g.get("format"), str):
            continue
        pats = []
        for t in g.get("targets") or ():
            if isinstance(t, str) and t.startswith("re:"):
                try:
                    pats.append(re.compile(t[3:]))
                except re.error:
                    continue
        out.append((g["format"], pats))
    return out
