"""Which GGUF layout a checkpoint gets, from its config's ``architectures``."""

from __future__ import annotations

from ..errors import UnsupportedError
from . import deepseek2, gpt_oss, kimi_k3

# HF architecture -> (layout module, where its text config lives)
ARCHITECTURES = {
    "KimiK3ForConditionalGeneration": (kimi_k3, "text_config"),
    "DeepseekV3ForCausalLM": (deepseek2, None),
    "GptOssForCausalLM": (gpt_oss, None),
}


def text_config(config: dict) -> tuple[object, dict]:
    """(layout module, text config) for ``config``; ``UnsupportedError`` names what is mapped."""
    for name in config.get("architectures") or []:
        if name in ARCHITECTURES:
            module, key = ARCHITECTURES[name]
            return module, (config[key] if key else config)
    raise UnsupportedError(f"k3ckpt gguf maps {', '.join(sorted(ARCHITECTURES))}; this checkpoint declares "
                           f"{config.get('architectures')}")


def plan(ckpt, *, expert_type: int, outtype: int | None, file_type: int):
    """(metadata without the tokenizer, planned tensors, skipped names, text config) of ``ckpt``."""
    module, text = text_config(ckpt.config or {})
    planned, skipped = module.plan_tensors({n: (e.dtype, tuple(e.shape)) for n, e in ckpt.tensors.items()},
                                           text, expert_type=expert_type, outtype=outtype)
    return module.metadata(text, file_type=file_type), planned, skipped, text
