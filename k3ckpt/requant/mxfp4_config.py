"""The ``quantization_config`` of an MXFP4 output (``k3ckpt requant --format mxfp4``), as
each ecosystem reads it (docs/requant.md): compressed-tensors, or transformers' gpt-oss
``mxfp4``.  Other outputs carry k3ckpt's own block (``checkpoint.qconfig.build_config``).
"""

from __future__ import annotations

import re
from typing import Iterable

from ..checkpoint.qconfig import FORMAT_VERSION, source_quantization_config, targets_for
from ..formats import ids

_LAYER_INDEX = re.compile(r"(?<=\.layers\.)\d+(?=\.)")
# compressed-tensors' MXFP4 weight scheme, as Kimi K3's config.json states it
_CT_MXFP4_WEIGHTS = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                     "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                     "symmetric": True, "type": "float", "zp_dtype": None}


def _module(weight: str) -> str:
    return weight[: -len(".weight")] if weight.endswith(".weight") else weight


def _still_quantized(ckpt, names: Iterable[str]) -> list[str]:
    """Storage ids of the copied tensors that are quantized in a format other than MXFP4."""
    from ..profiles import detect

    profile = detect(ckpt.config, ckpt.tensors.keys())
    out = set()
    for n in names:
        tr = profile.classify(n, ckpt.entry(n).dtype)
        if tr.quantized and tr.storage not in ids.MXFP4_LAYOUTS:
            out.add(tr.storage)
    return sorted(out)


def mxfp4_config(ckpt, plan) -> dict:
    """The ``quantization_config`` of an MXFP4 output, as each ecosystem reads it (docs/requant.md).

    compressed-tensors layout: ``quant_method: compressed-tensors``, format
    ``mxfp4-pack-quantized``, one config group whose ``targets`` are exactly
    the modules written (anchored ``re:`` patterns).  gpt-oss layout:
    transformers' ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``
    listing every copied linear module (layer numbers as ``*``).  Both carry a
    ``k3ckpt`` block (ignored by their readers) with the producer, the layout,
    the source's own block, and which other quantized storages the copied
    tensors still use (then the file is not loadable by that ecosystem as is).
    """
    from .. import __version__
    from .plan import GPT_OSS_MXFP4, MXFP4

    groups = plan.groups()
    modules = [_module(w) for w in groups.get((MXFP4, None), []) + groups.get((GPT_OSS_MXFP4, None), [])]
    meta = {"producer": f"k3ckpt {__version__}", "format_version": FORMAT_VERSION, "layout": plan.layout,
            "source_quantization_config": source_quantization_config(ckpt.config),
            "other_quantized_storage": _still_quantized(ckpt, plan.copies)}
    if plan.layout == "gpt-oss":
        keep = sorted({_LAYER_INDEX.sub("*", _module(n)) for n in plan.copies
                       if n.endswith(".weight") and len(ckpt.entry(n).shape) >= 2})
        return {"quant_method": "mxfp4", "modules_to_not_convert": keep, "k3ckpt": meta}
    return {
        "quant_method": "compressed-tensors", "format": MXFP4, "quantization_status": "compressed",
        "config_groups": {"group_0": {"format": MXFP4, "targets": targets_for(modules),
                                      "weights": dict(_CT_MXFP4_WEIGHTS), "input_activations": None,
                                      "output_activations": None}},
        "ignore": [], "kv_cache_scheme": None, "global_compression_ratio": None, "k3ckpt": meta,
    }
