"""Model profiles: which family a checkpoint is, and what each tensor is for.

>>> from k3ckpt.profiles import detect
>>> prof = detect(config, header_names)
>>> prof.classify("language_model.model.layers.1.block_sparse_moe.experts.5.w1.weight_packed", "U8")
TensorRole(role=<Role.ROUTED_EXPERT: 'routed_expert'>, layer=1, expert=5, projection='gate', ...)

See docs/profiles.md for the roles and the classification rules.
"""

from __future__ import annotations

from . import families as _families  # noqa: F401  (registers the profiles)
from .base import GenericProfile, Profile, get_profile
from .detect import detect, detect_id
from .experts import ExpertStats, expert_groups, expert_stats, logical_params
from .families import DeepseekV3Profile, GptOssProfile, KimiK2ThinkingProfile, KimiK3Profile, KimiLinearProfile
from .geometry import ModelGeometry, quant_hint, text_config
from .roles import QUANTIZED_STORAGE, STORAGE_IDS, Role, TensorRole

PROFILES: dict[str, type[Profile]] = Profile.registry

__all__ = [
    "PROFILES", "QUANTIZED_STORAGE", "STORAGE_IDS",
    "DeepseekV3Profile", "ExpertStats", "GenericProfile", "GptOssProfile", "KimiK2ThinkingProfile",
    "KimiK3Profile", "KimiLinearProfile", "ModelGeometry", "Profile", "Role", "TensorRole",
    "detect", "detect_id", "expert_groups", "expert_stats", "get_profile", "logical_params",
    "quant_hint", "text_config",
]
