"""The ``deepseek2`` GGUF layout of a DeepSeek-V3 / Kimi K2 checkpoint (block FP8, BF16, or
K2-Thinking's pack-quantized INT4 experts).

llama.cpp's converter (``conversion/deepseek.py``, ``DeepseekV2Model``, llama-cpp-python
0.3.36) is the spec, read and rewritten here:

- block-FP8 weights (``weight`` F8_E4M3 + ``weight_scale_inv`` per 128 x 128) are
  decoded tensor by tensor to float32, never to a BF16 copy on disk, and written as
  BF16 (``--outtype`` changes that) or, for routed experts, as ``--expert-type``;
- pack-quantized INT4 weights (``weight_packed`` / ``weight_scale`` / ``weight_shape``) likewise,
  ``(nibble - 8) * scale`` exactly in float32 as the converter's ``dequant_packed``;
- ``kv_b_proj`` split into ``attn_k_b`` (transposed) and ``attn_v_b``; routed experts
  stacked into ``ffn_{gate,up,down}_exps``; MTP layers (index >= num_hidden_layers)
  skipped; ``lm_head`` skipped when the embeddings are tied;
- the ``deepseek2.*`` keys of ``DeepseekV2Model.set_gguf_parameters``.
"""

from __future__ import annotations

import re

from ..errors import UnsupportedError
from . import container as C
from .tensors import ArchKeys, Planned, Recipe, kv_b_halves, layer_order, out_type

ARCH = "deepseek2"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_PROJ = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                 "model.norm.weight": "output_norm.weight"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
SCALE = "_scale_inv"          # block FP8's per-tile scale: <weight>_scale_inv
_PACKED = ".weight_packed"    # pack-quantized INT4: <base>.weight_packed, _scale, _shape


def _weights(tensors: dict[str, tuple[str, tuple[int, ...]]]):
    """(name, dtype, shape, sources): a block-FP8 weight and its scale are one logical weight, and so
    are a pack-quantized INT4 weight's ``weight_packed`` / ``weight_scale`` / ``weight_shape``
    (K2-Thinking's experts; named ``<base>.weight`` and typed ``INT4_PACK``)."""
    for name, (dtype, shape) in tensors.items():
        if name.endswith(SCALE):
            if name[: -len(SCALE)] not in tensors:
                raise UnsupportedError(f"{name}: a block-FP8 scale without its weight")
            continue
        if name.endswith(_PACKED):
            base = name[: -len(_PACKED)]
            if base + ".weight_scale" not in tensors:
                raise UnsupportedError(f"{name}: pack-quantized INT4 without {base}.weight_scale")
            rows, words = shape
            yield base + ".weight", "INT4_PACK", (int(rows), int(words) * 8), (name, base + ".weight_scale")
        elif name.endswith((".weight_scale", ".weight_shape")):
            if name.rsplit(".", 1)[0] + _PACKED not in tensors:
                raise UnsupportedError(f"{name}: an INT4 {name.rsplit('_', 1)[1]} without its weight_packed")
        elif dtype == "F8_E4M3":
            if name + SCALE not in tensors:
                raise UnsupportedError(f"{name}: F8_E4M3 without {name + SCALE} (only block FP8 is mapped)")
            yield name, "F8_BLOCK", tuple(shape), (name, name + SCALE)
        else:
            yield name, dtype, tuple(shape), (name,)


def _check_quantization(config: dict) -> None:
    """Block FP8 (K2, DeepSeek-V3), BF16, or compressed-tensors pack-quantized INT4 with symmetric
    groups (K2-Thinking: 4 bits, group 32), the one INT4 layout ``formats.int4_pack`` decodes."""
    q = config.get("quantization_config") or {}
    method = q.get("quant_method")
    if method in (None, "fp8"):
        return
    if method == "compressed-tensors" and q.get("format") == "pack-quantized":
        from ..formats.int4_pack import GROUP

        for g in (q.get("config_groups") or {}).values():
            w = g.get("weights") or {}
            if (w.get("num_bits"), w.get("group_size"), w.get("symmetric", True)) != (4, GROUP, True):
                raise UnsupportedError(f"deepseek2 GGUF maps symmetric 4-bit INT4 in groups of {GROUP}; this "
                                       f"checkpoint has {w.get('num_bits')} bits, group {w.get('group_size')}, "
                                       f"symmetric={w.get('symmetric')}")
        return
    raise UnsupportedError(f"deepseek2 GGUF from {method!r} ({q.get('format')}) weights is not mapped yet "
                           "(block FP8, BF16 and pack-quantized INT4 are)")


def plan_tensors(tensors: dict[str, tuple[str, tuple[int, ...]]], config: dict, *, expert_type: int,
                 outtype: int | None = None) -> tuple[list[Planned], list[str]]:
    """The GGUF tensors of a DeepSeek-V3 / Kimi K2 checkpoint in layer order, and the source names
    skipped (MTP layers, a tied ``lm_head``); ``UnsupportedError`` for a tensor it does not know."""
    _check_quantization(config)
    layers = int(config["num_hidden_layers"])
    n_experts = int(config["n_routed_experts"])
    v_dim, nope = int(config["v_head_dim"]), int(config["qk_nope_head_dim"])
    tied = bool(config.get("tie_word_embeddings"))
    by_layer: dict[int | None, list[Planned]] = {}
    skipped: list[str] = []
    experts: dict[tuple[int, str], dict[int, tuple]] = {}

    def add(layer, name, shape, dtype, recipe, ggml_type=None):
        t = ggml_type if ggml_type is not None else out_type(name, shape, dtype, outtype)
        by_layer.setdefault(layer, []).append(Planned(C.TensorInfo(name, t, shape), recipe, dtype, layer))

    for src, dtype, shape, sources in _weights(tensors):
        if src in _GLOBAL_NAMES:
            if src == "lm_head.weight" and tied:
                skipped.append(src)
                continue
            add(None, _GLOBAL_NAMES[src], shape, dtype, Recipe("copy", sources))
            continue
        m = _LAYER.match(src)
        if not m:
            raise UnsupportedError(f"no deepseek2 GGUF name for tensor {src!r}")
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= layers:               # multi-token-prediction layers: llama.cpp does not run them
            skipped.extend(sources)
            continue
        blk = f"blk.{layer}."
        e = _EXPERT.match(rest)
        if e:
            experts.setdefault((layer, e.group(2)), {})[int(e.group(1))] = (dtype, shape, sources)
        elif rest == "self_attn.kv_b_proj.weight":
            for suffix, out_shape, recipe in kv_b_halves(sources, shape, v_dim, nope):
                add(layer, blk + suffix, out_shape, dtype, recipe)
        elif rest in _LAYER_NAMES:
            add(layer, blk + _LAYER_NAMES[rest], shape, dtype, Recipe("copy", sources))
        else:
            raise UnsupportedError(f"no deepseek2 GGUF name for tensor {src!r}")

    for (layer, proj), got in sorted(experts.items()):
        missing = [i for i in range(n_experts) if i not in got]
        if missing:
            raise UnsupportedError(f"layer {layer} {proj}: {len(missing)} of {n_experts} routed experts missing, "
                                   f"first is {missing[0]}")
        dtype, (rows, k), _ = got[0]
        srcs = tuple(s for i in range(n_experts) for s in got[i][2])
        add(layer, f"blk.{layer}.{EXPERT_PROJ[proj]}.weight", (n_experts, rows, k), dtype,
            Recipe("experts", srcs, n_experts), ggml_type=expert_type)
    return layer_order(by_layer), skipped


def metadata(config: dict, *, file_type: int) -> list[C.KV]:
    """The ``deepseek2.*`` keys as ``DeepseekV2Model.set_gguf_parameters`` writes them."""
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedError(f"deepseek2 with scoring_func {config.get('scoring_func')!r} is not mapped "
                               "(DeepSeek-V3 and Kimi K2 use sigmoid)")
    k = ArchKeys(ARCH)
    k.u32("block_count", config["num_hidden_layers"])
    k.u32("context_length", config["max_position_embeddings"])
    k.u32("embedding_length", config["hidden_size"])
    k.u32("feed_forward_length", config["intermediate_size"])
    k.u32("attention.head_count", config["num_attention_heads"])
    k.u32("attention.head_count_kv", 1)                  # MLA served as MQA
    _rope(k, config)
    k.f32("attention.layer_norm_rms_epsilon", config.get("rms_norm_eps", 1e-6))
    k.routing(experts=config["n_routed_experts"], used=config["num_experts_per_tok"], groups=config.get("n_group"),
              groups_used=config.get("topk_group"), file_type=file_type)
    k.u32("leading_dense_block_count", config.get("first_k_dense_replace", 0))
    k.u32("vocab_size", config["vocab_size"])
    k.mla(q_lora=config.get("q_lora_rank"), kv_lora=int(config.get("kv_lora_rank", 512)),
          rope=int(config["qk_rope_head_dim"]), nope=int(config["qk_nope_head_dim"]), v_dim=int(config["v_head_dim"]))
    k.u32("expert_feed_forward_length", config["moe_intermediate_size"])
    k.u32("expert_shared_count", config.get("n_shared_experts", 0))
    k.f32("expert_weights_scale", config.get("routed_scaling_factor"))
    if config.get("norm_topk_prob"):
        k.flag("expert_weights_norm", True)
    return k.done()


def _rope(k: ArchKeys, config: dict) -> None:
    """RoPE scaling keys as base.py's ``set_gguf_parameters`` writes them (``rope_scaling`` or
    ``rope_parameters``; YaRN as Kimi K2 and DeepSeek-V3 use it), plus deepseek2's YaRN log
    multiplier, ``0.1 * mscale_all_dim`` (llama.cpp's legacy convention for this arch)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type"))
    theta = params.get("rope_theta", config.get("rope_theta"))
    factor = params.get("factor")
    if kind == "linear" and factor is not None:
        k.add(C.KV(f"{ARCH}.rope.scaling.type", C.STRING, "linear"))
        k.f32("rope.scaling.factor", factor)
    elif kind == "yarn" and factor is not None:
        orig = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
        if orig is None:
            raise UnsupportedError("YaRN rope_scaling without original_max_position_embeddings")
        k.add(C.KV(f"{ARCH}.rope.scaling.type", C.STRING, "yarn"))
        k.f32("rope.scaling.factor", factor)
        k.u32("rope.scaling.original_context_length", orig)
        for src, key in (("extrapolation_factor", "yarn_ext_factor"), ("beta_fast", "yarn_beta_fast"),
                         ("beta_slow", "yarn_beta_slow")):
            k.f32(f"rope.scaling.{key}", params.get(src))
        k.f32("rope.scaling.yarn_attn_factor", params.get("attention_factor", params.get("attn_factor")))
    elif kind not in (None, "default"):
        raise UnsupportedError(f"rope type {kind!r} is not mapped for deepseek2 (yarn and linear are)")
    k.f32("rope.freq_base", theta)
    if params.get("mscale_all_dim") is not None:
        k.f32("rope.scaling.yarn_log_multiplier", 0.1 * params["mscale_all_dim"])
