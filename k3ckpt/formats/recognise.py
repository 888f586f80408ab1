"""Which format a checkpoint's ``quantization_config`` declares, asked of the registry.

Each format lists the declarations that name it (``FormatInfo.declared_as``): the
``quant_method``, or ``quant_method/format`` where one method covers several formats
(compressed-tensors' ``format``, fp8 with a ``weight_block_size``, ModelOpt's
``quant_algo``).  ``inspect``, ``plan``, ``requant`` and ``dequant`` read a config through
``recognise``, so a format added to the registry is recognised everywhere at once.
"""

from __future__ import annotations

from typing import Mapping

from .base import list_formats

__all__ = ["K3CKPT_METHOD", "declaration", "recognise"]

K3CKPT_METHOD = "k3ckpt"   # the quant_method k3ckpt requant writes (docs/requant.md)


def declaration(qc: Mapping) -> str | None:
    """The key ``declared_as`` entries are matched against, or None for no quant_method."""
    method = qc.get("quant_method")
    if not isinstance(method, str):
        return None
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = qc.get("config_groups")
        if not fmt and isinstance(groups, Mapping):
            fmt = next((g.get("format") for g in groups.values() if isinstance(g, Mapping) and g.get("format")), None)
        return f"{method}/{fmt}" if fmt else None
    if method == "fp8":
        return "fp8/block" if qc.get("weight_block_size") else "fp8"
    if method == "modelopt":
        return "modelopt/nvfp4" if "NVFP4" in str(qc.get("quant_algo", "")).upper() else None
    return method


def recognise(qc: Mapping | None) -> str | None:
    """The registry id of the format a ``quantization_config`` block declares, or None.

    A k3ckpt requant output names its own formats per group (``checkpoint.qconfig``); the
    weights in no group keep the source's format, which this returns."""
    if not isinstance(qc, Mapping):
        return None
    if qc.get("quant_method") == K3CKPT_METHOD:
        return recognise(qc.get("source_quantization_config"))
    key = declaration(qc)
    return next((info.id for info in list_formats() if key in info.declared_as), None) if key else None

