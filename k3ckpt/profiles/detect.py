"""Pick the profile for a checkpoint from its config.json and tensor names.

The config's ``model_type`` decides when it names a known family; otherwise
(no config, or an unknown type) the tensor names do.  Anything unrecognised
gets the generic profile, which still classifies every tensor (unknown ones as
``Role.OTHER``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..formats import ids
from .base import Profile, get_profile
from .declared import declared_parts
from .geometry import names_quant_hint, quant_hint, text_config

_DEEPSEEK_TYPES = frozenset({"deepseek_v3", "deepseek_v32", "kimi_k2"})


def detect_id(config: Mapping[str, Any] | None, names: Iterable[str] = ()) -> str:
    """The profile id for a config (may be None) and tensor names (may be empty)."""
    if config:
        mt = config.get("model_type")
        inner = text_config(config).get("model_type")
        archs = " ".join(str(a) for a in config.get("architectures") or ())
        if mt == "kimi_k3" or "KimiK3" in archs:
            return "kimi_k3"
        if mt == "kimi_linear":
            return "kimi_linear"
        if mt in _DEEPSEEK_TYPES or inner in _DEEPSEEK_TYPES:
            # K2-Thinking keeps the DeepSeek-V3 model type; its experts are INT4.
            return "kimi_k2_thinking" if quant_hint(config) == ids.INT4_PACK else "deepseek_v3"
        if mt == "gpt_oss":
            return "gpt_oss"
    return _id_from_names(names)


def _id_from_names(names: Iterable[str]) -> str:
    latent = kimi_moe = kda = fused_blocks = per_expert_packed = scale_inv = False
    for n in names:
        if ".block_sparse_moe." in n:
            kimi_moe = kimi_moe or ".block_sparse_moe.shared_experts." in n
            if ".block_sparse_moe.routed_expert_" in n:
                latent = True
                break  # only K3 has LatentMoE projections
        elif ".mlp.experts." in n:
            if n.endswith("_proj_blocks"):
                fused_blocks = True
            elif n.endswith(".weight_packed"):
                per_expert_packed = True
            elif n.endswith(".weight_scale_inv"):
                scale_inv = True
        if not kda and (".self_attn.f_a_proj." in n or n.endswith(".self_attn.A_log")):
            kda = True
    if latent:
        return "kimi_k3"
    if kda or kimi_moe:  # Mixtral shares block_sparse_moe but has neither shared experts nor KDA
        return "kimi_linear"
    if fused_blocks:
        return "gpt_oss"
    if per_expert_packed:
        return "kimi_k2_thinking"
    if scale_inv:
        return "deepseek_v3"
    return "generic"


def detect(config: Mapping[str, Any] | None, names: Iterable[str] = ()) -> Profile:
    """The profile for a checkpoint, with geometry from ``config`` when given.

    When the config declares no quantization, part suffixes that only one
    layout uses (ModelOpt's ``weight_scale_2``) give the storage hint.  A
    k3ckpt-written config declares the format of each weight it wrote
    (``profiles.declared``)."""
    if not hasattr(names, "__len__"):  # a one-shot iterator: both passes need the names
        names = list(names)
    hint = None if quant_hint(config) else names_quant_hint(names)
    return get_profile(detect_id(config, names), config, quant=hint, declared=declared_parts(config, names))
