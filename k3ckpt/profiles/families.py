"""The model families k3ckpt knows, each a registered ``Profile``.

Only what differs from generic Hugging Face naming is written here; the
generic rules in ``base.GENERIC_RULES`` run after each family's own.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from ..formats import ids
from .base import Profile, Rule, rule
from .geometry import ModelGeometry, deepseek_geometry, kimi_geometry, text_config
from .roles import Role

# Keys without a default in the Kimi and DeepSeek geometry readers.
_REQUIRED = ("num_hidden_layers", "hidden_size")


def _unless_missing(read, config: Mapping[str, Any]) -> ModelGeometry | None:
    """``read(config)``, or None when the config lacks the layer count or the
    width (a partial or hand-made config.json): names still classify, as with
    the generic profile.  Keys that are present but wrong still raise."""
    cfg = text_config(config)
    if any(cfg.get(k) is None for k in _REQUIRED):
        return None
    return read(config)


_K3_RULES: tuple[Rule, ...] = (
    # LatentMoE: routed experts run in a 3584-wide latent space between two BF16
    # projections and a norm that every token passes through.
    rule(r"\.block_sparse_moe\.routed_expert_(?P<proj>down|up)_proj\.", Role.LATENT_PROJ),
    rule(r"\.block_sparse_moe\.routed_expert_norm\.", Role.LATENT_PROJ),
    # attention residuals: self_attention_res_{proj,norm}, mlp_res_*, output_attn_res_*
    rule(r"_res_(?:proj|norm)\.weight$", Role.RESIDUAL),
)


class KimiK3Profile(Profile):
    """Kimi K3: ``language_model.`` prefix, LatentMoE, KDA/MLA hybrid, MXFP4 experts."""

    id: ClassVar[str] = "kimi_k3"
    display_name: ClassVar[str] = "Kimi K3 (LatentMoE, MXFP4 experts)"
    model_name: ClassVar[str | None] = "Kimi K3"
    rules: ClassVar[tuple[Rule, ...]] = _K3_RULES
    default_quant: ClassVar[str | None] = ids.MXFP4_PACK

    @classmethod
    def geometry_from(cls, config: Mapping[str, Any]) -> ModelGeometry | None:
        return _unless_missing(kimi_geometry, config)


class KimiLinearProfile(Profile):
    """Kimi-Linear: K3's KDA/MLA hybrid without the wrapper, latent or residuals."""

    id: ClassVar[str] = "kimi_linear"
    display_name: ClassVar[str] = "Kimi-Linear (KDA/MLA hybrid MoE)"
    model_name: ClassVar[str | None] = "Kimi-Linear"
    rules: ClassVar[tuple[Rule, ...]] = _K3_RULES  # harmless when absent; K3 text models reuse the type
    default_quant: ClassVar[str | None] = None

    @classmethod
    def geometry_from(cls, config: Mapping[str, Any]) -> ModelGeometry | None:
        return _unless_missing(kimi_geometry, config)


class DeepseekV3Profile(Profile):
    """DeepSeek-V3 and Kimi K2: per-expert ``mlp.experts.E.*_proj.weight`` in block FP8."""

    id: ClassVar[str] = "deepseek_v3"
    display_name: ClassVar[str] = "DeepSeek-V3 / Kimi K2 (block FP8)"
    model_name: ClassVar[str | None] = "DeepSeek-V3 / Kimi K2"
    default_quant: ClassVar[str | None] = ids.FP8_BLOCK

    @classmethod
    def geometry_from(cls, config: Mapping[str, Any]) -> ModelGeometry | None:
        return _unless_missing(deepseek_geometry, config)


class KimiK2ThinkingProfile(DeepseekV3Profile):
    """Kimi K2-Thinking / K2.5: DeepSeek-V3 naming, experts in compressed-tensors INT4."""

    id: ClassVar[str] = "kimi_k2_thinking"
    display_name: ClassVar[str] = "Kimi K2-Thinking (INT4 pack-quantized experts)"
    model_name: ClassVar[str | None] = "Kimi K2-Thinking"
    default_quant: ClassVar[str | None] = ids.INT4_PACK


class GptOssProfile(Profile):
    """gpt-oss: fused ``mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}``, router ``mlp.router``."""

    id: ClassVar[str] = "gpt_oss"
    display_name: ClassVar[str] = "gpt-oss (fused MXFP4 experts)"
    model_name: ClassVar[str | None] = "gpt-oss"
    default_quant: ClassVar[str | None] = ids.GPT_OSS_MXFP4
    # geometry: the base class's generic reader (common Hugging Face keys, tolerant)
