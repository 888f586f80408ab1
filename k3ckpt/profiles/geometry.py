"""Model geometry read from config.json: layer kinds, expert counts, widths.

Each family spells the same facts with different keys (``num_experts`` /
``n_routed_experts`` / ``num_local_experts``) and some keys collide by name:
Kimi K3's ``top_k: 50`` is a *generation* setting; routing top-k is
``num_experts_per_token``.  ``text_config`` (multimodal wrappers) is used when
present.  Bad values raise ``InvalidFileError`` naming config.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import InvalidFileError
from ..formats import ids, recognise

CONFIG = "config.json"


@dataclass(frozen=True)
class ModelGeometry:
    model_type: str
    num_layers: int
    hidden_size: int
    dense_layers: tuple[int, ...]     # 0-indexed layers with a dense MLP
    moe_layers: tuple[int, ...]       # 0-indexed layers with routed experts
    experts: int                      # routed experts per MoE layer (0 for dense models)
    top_k: int                        # experts routed per token
    shared_experts: int
    moe_intermediate: int             # routed expert intermediate width (rows of gate/up)
    expert_hidden: int                # width routed experts read: K3 routed_expert_hidden_size, else hidden
    attention: dict[int, str] = field(hash=False)  # 0-indexed layer -> 'mla' | 'kda' | 'mha'
    vocab_size: int = 0
    tied_embeddings: bool = False

    @property
    def num_routed_experts(self) -> int:
        """Experts over all MoE layers (K3: 92 x 896 = 82,432)."""
        return len(self.moe_layers) * self.experts

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(sorted(layer for layer, k in self.attention.items() if k == kind))


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language-model part of a config (``text_config`` when nested)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def _int(cfg: Mapping[str, Any], keys: tuple[str, ...], default: int | None = None) -> int:
    v = _first(cfg, keys, default)
    if v is None:
        raise InvalidFileError(f"missing integer field (one of {', '.join(keys)})", file=CONFIG)
    if type(v) is not int or v < 0:
        raise InvalidFileError(f"{keys[0]} must be a non-negative integer, found {v!r}", file=CONFIG)
    return v


def _layer_split(cfg: Mapping[str, Any], n: int, has_experts: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dense, moe) layers.  DeepSeek/Kimi rule: MoE when ``layer >= first_k_dense_replace``
    and ``layer % moe_layer_freq == 0``; a model without experts is all dense."""
    if not has_experts:
        return tuple(range(n)), ()
    first_k = _int(cfg, ("first_k_dense_replace",), 0)
    freq = _int(cfg, ("moe_layer_freq",), 1) or 1
    moe = tuple(i for i in range(n) if i >= first_k and i % freq == 0)
    dense = tuple(i for i in range(n) if i not in set(moe))
    return dense, moe


def _one_indexed(value: Any, n: int, key: str) -> set[int]:
    if not isinstance(value, list) or not all(type(x) is int for x in value):
        raise InvalidFileError(f"linear_attn_config.{key} must be a list of ints, found {value!r}", file=CONFIG)
    bad = [x for x in value if not 1 <= x <= n]
    if bad:
        raise InvalidFileError(
            f"linear_attn_config.{key} is 1-indexed over {n} layers; out of range: {bad[:5]}", file=CONFIG)
    return {x - 1 for x in value}


def _kimi_attention(cfg: Mapping[str, Any], n: int) -> dict[int, str]:
    """Kimi-Linear/K3: a layer is KDA when its 1-indexed number is in ``kda_layers``,
    otherwise MLA (the modeling code's rule); ``full_attn_layers`` must agree."""
    lac = cfg.get("linear_attn_config")
    if not isinstance(lac, Mapping):
        return {i: "mla" for i in range(n)}
    kda = _one_indexed(lac.get("kda_layers", []), n, "kda_layers")
    if "full_attn_layers" in lac:
        full = _one_indexed(lac["full_attn_layers"], n, "full_attn_layers")
        both = sorted(kda & full)
        if both:
            raise InvalidFileError(f"layers {[x + 1 for x in both[:5]]} are in both kda_layers and "
                                   "full_attn_layers (1-indexed)", file=CONFIG)
        missing = sorted(set(range(n)) - kda - full)
        if missing:
            raise InvalidFileError(f"layers {[x + 1 for x in missing[:5]]} are in neither kda_layers nor "
                                   "full_attn_layers (1-indexed)", file=CONFIG)
    return {i: ("kda" if i in kda else "mla") for i in range(n)}


def _tied(config: Mapping[str, Any], cfg: Mapping[str, Any]) -> bool:
    v = cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return bool(v)


def kimi_geometry(config: Mapping[str, Any]) -> ModelGeometry:
    """Kimi K3 (``text_config``) and Kimi-Linear (top level)."""
    cfg = text_config(config)
    n = _int(cfg, ("num_hidden_layers",))
    hidden = _int(cfg, ("hidden_size",))
    experts = _int(cfg, ("num_experts",), 0)
    dense, moe = _layer_split(cfg, n, experts > 0)
    return ModelGeometry(
        model_type=str(config.get("model_type", cfg.get("model_type", ""))),
        num_layers=n,
        hidden_size=hidden,
        dense_layers=dense,
        moe_layers=moe,
        experts=experts,
        top_k=_int(cfg, ("num_experts_per_token", "num_experts_per_tok"), 0),  # never 'top_k' (generation)
        shared_experts=_int(cfg, ("num_shared_experts",), 0),
        moe_intermediate=_int(cfg, ("moe_intermediate_size",), 0),
        expert_hidden=_int(cfg, ("routed_expert_hidden_size",), hidden),
        attention=_kimi_attention(cfg, n),
        vocab_size=_int(cfg, ("vocab_size",), 0),
        tied_embeddings=_tied(config, cfg),
    )


def deepseek_geometry(config: Mapping[str, Any]) -> ModelGeometry:
    """DeepSeek-V3 / Kimi K2 / K2-Thinking (MLA when ``kv_lora_rank`` is set)."""
    cfg = text_config(config)
    n = _int(cfg, ("num_hidden_layers",))
    hidden = _int(cfg, ("hidden_size",))
    experts = _int(cfg, ("n_routed_experts", "num_experts"), 0)
    dense, moe = _layer_split(cfg, n, experts > 0)
    kind = "mla" if cfg.get("kv_lora_rank") else "mha"
    return ModelGeometry(
        model_type=str(cfg.get("model_type", config.get("model_type", ""))),
        num_layers=n,
        hidden_size=hidden,
        dense_layers=dense,
        moe_layers=moe,
        experts=experts,
        top_k=_int(cfg, ("num_experts_per_tok", "num_experts_per_token"), 0),
        shared_experts=_int(cfg, ("n_shared_experts", "num_shared_experts"), 0),
        moe_intermediate=_int(cfg, ("moe_intermediate_size",), 0),
        expert_hidden=hidden,
        attention={i: kind for i in range(n)},
        vocab_size=_int(cfg, ("vocab_size",), 0),
        tied_embeddings=_tied(config, cfg),
    )


def generic_geometry(config: Mapping[str, Any]) -> ModelGeometry:
    """gpt-oss, Mixtral, Qwen-MoE and unknown models: common Hugging Face keys.
    Every layer is MoE when the config names an expert count, else dense."""
    cfg = text_config(config)
    n = _int(cfg, ("num_hidden_layers", "n_layer", "num_layers"))
    hidden = _int(cfg, ("hidden_size", "n_embd", "d_model"))
    experts = _int(cfg, ("num_local_experts", "num_experts", "n_routed_experts"), 0)
    dense, moe = _layer_split(cfg, n, experts > 0)
    kind = "mla" if cfg.get("kv_lora_rank") else "mha"
    return ModelGeometry(
        model_type=str(cfg.get("model_type", config.get("model_type", ""))),
        num_layers=n,
        hidden_size=hidden,
        dense_layers=dense,
        moe_layers=moe,
        experts=experts,
        top_k=_int(cfg, ("num_experts_per_tok", "experts_per_token", "num_experts_per_token"), 0),
        shared_experts=_int(cfg, ("n_shared_experts", "num_shared_experts"), 0),
        moe_intermediate=_int(cfg, ("moe_intermediate_size", "intermediate_size"), 0),
        expert_hidden=hidden,
        attention={i: kind for i in range(n)},
        vocab_size=_int(cfg, ("vocab_size",), 0),
        tied_embeddings=_tied(config, cfg),
    )


def quant_hint(config: Mapping[str, Any] | None) -> str | None:
    """The storage id a config's ``quantization_config`` declares, or None.

    Only a hint: the storage of each tensor is still decided by its suffix and
    dtype (``roles.storage_of``)."""
    if not config:
        return None
    qc = config.get("quantization_config") or text_config(config).get("quantization_config")
    if not isinstance(qc, Mapping):
        return None
    return recognise(qc)   # the registry maps declarations to formats


# Part suffixes that only one quantized layout uses: enough to name the storage
# when config.json says nothing (ModelOpt may keep its settings in
# hf_quant_config.json instead).
_NAME_HINTS = ((".weight_scale_2", ids.NVFP4_MODELOPT), (".weight_global_scale", ids.NVFP4))


def names_quant_hint(names) -> str | None:
    """The storage id that tensor names alone reveal (see ``_NAME_HINTS``), or None."""
    suffixes = tuple(s for s, _ in _NAME_HINTS)
    for n in names:
        if n.endswith(suffixes):
            return next(h for s, h in _NAME_HINTS if n.endswith(s))
    return None
