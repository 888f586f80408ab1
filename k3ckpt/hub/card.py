"""The model card (README.md) pushed with a converted checkpoint.

Built only from what the output folder holds, so a rerun writes the same
bytes: the run manifest (source repo and pinned commit, options), the
``quantization_config`` in config.json (formats and their spec pages) and
the requant report (its summary table and the heatmap picture).  YAML front
matter follows the Hub's model-card metadata: ``base_model`` (the source
repo, when it came from the Hub) with ``base_model_relation: quantized``,
``library_name`` and ``tags``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .. import __version__

CARD_NAME = "README.md"
REPORT_MD = "requant_report.md"
REPORT_SVG = "requant_report.svg"


def _formats(config: dict[str, Any]) -> list[tuple[str, str | None, str | None, Any]]:
    """(format, method, spec page, bits per weight) per quantization group, in group order."""
    qc = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config") or {}
    out = []
    for g in (qc.get("config_groups") or {}).values():
        if isinstance(g, dict) and g.get("format"):
            out.append((str(g["format"]), g.get("method"), g.get("spec"), g.get("bits_per_weight")))
    return out


def _summary_table(report_md: str) -> str | None:
    """The report's "## Summary" section (table and notes), without its heading."""
    m = re.search(r"^## Summary\n(.*?)(?=^## |\Z)", report_md, re.S | re.M)
    return m.group(1).strip() if m else None


def _yaml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML double-quoted scalar


def model_card(folder: str | os.PathLike, repo_id: str) -> str:
    """README.md text for the output in ``folder`` pushed as ``repo_id``."""
    from ..io.manifest import RunManifest

    folder = Path(folder)
    manifest = RunManifest.load(folder)
    source = manifest.source
    base, commit = source.get("repo_id"), source.get("commit")
    config: dict[str, Any] = {}
    if (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    formats = _formats(config)
    tags = ["k3ckpt", "safetensors", "mixture-of-experts", "quantized"]
    tags += [f for f, *_ in formats if f not in tags]

    lines = ["---"]
    if base:
        lines += [f"base_model: {_yaml_str(base)}", "base_model_relation: quantized"]
    lines += ["library_name: k3ckpt", "tags:"] + [f"- {_yaml_str(t)}" for t in tags] + ["---", ""]
    lines += [f"# {repo_id.split('/')[-1]}", ""]
    what = {"requant": "requantized", "shard": "sharded"}.get(manifest._data.get("job"), "converted")
    if base:
        lines.append(f"[{base}](https://huggingface.co/{base}) at commit `{commit}`, {what} with k3ckpt "
                     f"{__version__}.")
    else:
        lines.append(f"A checkpoint {what} with k3ckpt {__version__} from a local source.")
    lines.append("")
    if formats:
        lines += ["## Format", "", "| format | method | bits per weight | spec |", "|---|---|---:|---|"]
        for f, method, spec, bpw in formats:
            lines.append(f"| `{f}` | {method or '-'} | {bpw if bpw is not None else '-'} | "
                         f"{'k3ckpt `' + spec + '`' if spec else '-'} |")
        lines += ["", "Every other tensor is the source's, byte for byte. `config.json` carries the "
                  "`quantization_config` naming the formats (the source's own block is kept in "
                  "`source_quantization_config`).", ""]
    report = folder / REPORT_MD
    table = _summary_table(report.read_text(encoding="utf-8")) if report.is_file() else None
    if table:
        lines += ["## Error against the source", "", table, ""]
        if (folder / REPORT_SVG).is_file():
            lines += [f"![layer x expert SNR heatmap and per-tensor SNR histogram]({REPORT_SVG})", ""]
        lines += [f"Full report: [{REPORT_MD}]({REPORT_MD}) (machine-readable: `requant_report.json`).", ""]
    opts = json.dumps(manifest.options, sort_keys=True)
    lines += ["## Provenance", "", f"- source: `{base}@{commit}`" if base else "- source: local",
              f"- options: `{opts}`", "- `k3ckpt-manifest.json` lists every file with its size and sha256.", ""]
    return "\n".join(lines)
