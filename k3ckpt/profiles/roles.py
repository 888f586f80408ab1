"""What a tensor is for (its role) and how it is stored (its part and storage id).

A checkpoint tensor is one *part* of a logical *weight*: ``experts.5.w1.weight_packed``
and ``experts.5.w1.weight_scale`` are the packed codes and the block scales of the
logical weight ``experts.5.w1.weight``.  Parts and storage ids are decided from the
name's suffix and the header dtype, never from the config alone: Kimi K3's
``quantization_config`` claims every Linear, yet its router, latent and res
projections ship as BF16 (see docs/profiles.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..formats import ids


class Role(str, Enum):
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    ROUTER = "router"
    LATENT_PROJ = "latent_proj"      # K3 LatentMoE: routed_expert_{down,up}_proj, routed_expert_norm
    ATTN_MLA = "attn_mla"
    ATTN_KDA = "attn_kda"
    ATTN_OTHER = "attn_other"        # MHA/GQA or attention we cannot place
    DENSE_MLP = "dense_mlp"
    NORM = "norm"
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    VISION = "vision"                # vision tower and multimodal projector
    RESIDUAL = "residual"            # K3 attention-residual *_res_proj / *_res_norm
    OTHER = "other"                  # anything not recognised: reported, never dropped

    def __str__(self) -> str:  # "routed_expert", not "Role.ROUTED_EXPERT", in reports
        return self.value


@dataclass(frozen=True, slots=True)
class TensorRole:
    role: Role
    layer: int | None        # 0-indexed decoder layer, None outside the layer stack
    expert: int | None       # routed expert index; None for fused (all-experts) tensors
    projection: str | None   # 'gate' | 'up' | 'down' | 'gate_up' for FFN projections
    weight: str              # logical weight this tensor is a part of
    part: str                # 'weight', 'packed', 'scale', 'scale_inv', 'bias', 'blocks', ...
    storage: str             # storage format id, see STORAGE_IDS

    @property
    def quantized(self) -> bool:
        return self.storage in QUANTIZED_STORAGE


# Storage ids.  Quantized ones are the on-disk format strings users see; plain
# float tensors are named by their dtype; anything else is 'raw'.
QUANTIZED_STORAGE = frozenset({
    ids.MXFP4_PACK,     # compressed-tensors MXFP4 (Kimi K3): weight_packed U8 + weight_scale U8
    ids.GPT_OSS_MXFP4,  # gpt-oss fused *_blocks U8 [E, N, K/32, 16] + *_scales U8
    ids.FP8_BLOCK,      # DeepSeek-V3 / Kimi K2: F8_E4M3 weight + F32 weight_scale_inv per 128x128
    ids.INT4_PACK,      # compressed-tensors pack-quantized (K2-Thinking): I32 packed + BF16 scale + shape
    ids.NVFP4,          # NVFP4, compressed-tensors: U8 weight_packed + F8_E4M3 scale per 16 + global scale
    ids.NVFP4_MODELOPT,  # NVFP4, ModelOpt: U8 weight + F8_E4M3 weight_scale + F32 weight_scale_2
})
PLAIN_STORAGE: dict[str, str] = {"BF16": ids.BF16, "F16": ids.F16, "F32": ids.F32, "F8_E4M3": ids.FP8_E4M3}
STORAGE_IDS = QUANTIZED_STORAGE | frozenset(PLAIN_STORAGE.values()) | {"raw"}

# Suffix of the last dotted name component -> (part, characters to cut from the
# name to get the logical weight).  ``weight_packed`` -> ``weight`` by cutting '_packed'.
_COMPONENT_PARTS: dict[str, tuple[str, int]] = {
    "weight": ("weight", 0),
    "bias": ("bias", 0),
    "weight_packed": ("packed", len("_packed")),
    "weight_scale": ("scale", len("_scale")),
    "weight_scale_inv": ("scale_inv", len("_scale_inv")),
    "weight_shape": ("shape", len("_shape")),
    "weight_global_scale": ("global_scale", len("_global_scale")),
    "weight_scale_2": ("scale_2", len("_scale_2")),          # ModelOpt NVFP4 second-level scale
    # activation scales of W4A4 / static-FP8 checkpoints: they belong to the
    # module, not to a weight; the name is kept whole (cut 0)
    "input_scale": ("input_scale", 0),
    "input_global_scale": ("input_scale", 0),
    "weight_zero_point": ("zero_point", len("_zero_point")),
    # k3ckpt-mx2's per-weight level set and exponent base (docs/formats/mx2.md)
    "weight_levels": ("levels", len("_levels")),
    "weight_exp_base": ("exp_base", len("_exp_base")),
}
# gpt-oss style fused tensors end in _blocks/_scales/_bias instead of a dotted suffix.
_UNDERSCORE_PARTS: tuple[tuple[str, str], ...] = (("_blocks", "blocks"), ("_scales", "scales"))


def split_part(last: str) -> tuple[str, int]:
    """(part, cut) for a name's last dotted component.  A bare parameter such
    as ``A_log`` is part 'weight'; ``dt_bias`` or ``gate_up_proj_bias`` is 'bias'."""
    hit = _COMPONENT_PARTS.get(last)
    if hit is not None:
        return hit
    for suffix, part in _UNDERSCORE_PARTS:
        if last.endswith(suffix) and len(last) > len(suffix):
            return part, len(suffix)
    if last.endswith("_bias"):
        return "bias", 0
    return "weight", 0


def storage_of(part: str, dtype: str, hint: str | None) -> str:
    """The storage id of one tensor from its part, its header dtype and the
    profile's quantization hint (from config, tensor names, or the family default).

    The hint only settles what suffix and dtype leave open (U8 packed codes are
    MXFP4 or NVFP4; a float ``weight_scale`` belongs to INT4 or FP8 groups; an
    F8_E4M3 ``weight_scale`` to compressed-tensors or ModelOpt NVFP4); it never
    makes a plain BF16 tensor quantized.  Quantized storage ids are format
    registry ids.
    """
    plain = PLAIN_STORAGE.get(dtype, "raw")
    if part == "packed":
        if dtype == "U8":
            return ids.NVFP4 if hint == ids.NVFP4 else ids.MXFP4_PACK
        if dtype == "I32":
            return ids.INT4_PACK
        return "raw"
    if part == "scale":
        if dtype == "U8":  # E8M0 bytes stored as U8 (compressed-tensors scale_dtype torch.uint8)
            return ids.MXFP4_PACK
        if dtype == "F8_E4M3":
            return ids.NVFP4_MODELOPT if hint == ids.NVFP4_MODELOPT else ids.NVFP4
        if dtype in ("BF16", "F16", "F32") and hint in (ids.INT4_PACK, ids.FP8_E4M3):
            return hint
        return "raw"
    if part == "shape":
        return ids.INT4_PACK
    if part == "global_scale":
        return ids.NVFP4
    if part == "scale_2":
        return ids.NVFP4_MODELOPT
    if part == "scale_inv":
        return ids.FP8_BLOCK if dtype == "F32" else "raw"
    if part in ("blocks", "scales"):
        return ids.GPT_OSS_MXFP4 if dtype == "U8" else "raw"
    if part == "zero_point":
        return hint if hint in QUANTIZED_STORAGE else "raw"
    if part == "weight":
        if dtype == "F8_E4M3" and hint == ids.FP8_BLOCK:
            return ids.FP8_BLOCK
        if dtype == "U8" and hint in (ids.NVFP4, ids.NVFP4_MODELOPT):  # ModelOpt stores NVFP4 codes as a plain 'weight'
            return ids.NVFP4_MODELOPT
    return plain
