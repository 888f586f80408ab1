"""The ``kimi-k3`` GGUF layout of a Kimi K3 checkpoint: tensor names, shapes, types, metadata.

llama.cpp's converter (``conversion/kimi_k3.py`` with ``base.py`` and gguf-py's
tensor map, llama-cpp-python 0.3.36) is the spec; this module writes the same
plan from our own reading of it (docs/gguf.md):

- the text model only: ``language_model.`` dropped, ``vision_tower.*`` and
  ``mm_projector.*`` skipped (and listed as skipped);
- ``<x>_res_norm * <x>_res_proj`` fused into ``attn_res_score`` / ``ffn_res_score``
  / ``output_res_score`` (float32);
- ``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and ``attn_v_b``;
  ``A_log`` -> ``-exp(A_log)[:n_head]``; conv1d reshaped to ``(1, d_inner, 1, d_conv)``;
  ``dt_bias`` -> ``ssm_dt.bias``; ``g_proj`` is ``ssm_g`` on KDA layers and
  ``attn_gate`` on MLA layers (1-based ``full_attn_layers``);
- routed experts stacked into 3-D ``ffn_{gate,up,down}_exps`` (``[E, rows, K]``);
- the converter's float32 rule: 1-D tensors, ``*_norm.weight``, the router
  (``ffn_gate_inp``), the KDA convs and anything not ending in ``.weight`` are F32;
  every other tensor keeps its source type (BF16 stays BF16, byte for byte) or
  takes ``outtype``.

Tensors are ordered layer by layer (the converter writes the experts first; order
is free in GGUF), so a split can end on a layer boundary.
"""

from __future__ import annotations

import re

from ..errors import UnsupportedError
from . import container as C
from .tensors import ArchKeys, Planned, Recipe, kv_b_halves, layer_order, out_type

ARCH = "kimi-k3"
PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
EXPERT_PROJ = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}

# per-layer source suffix -> GGUF name (under blk.N.)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.b_proj.weight": "ssm_beta.weight",
    "self_attn.f_a_proj.weight": "ssm_f_a.weight",
    "self_attn.f_b_proj.weight": "ssm_f_b.weight",
    "self_attn.q_conv1d.weight": "ssm_conv1d_q.weight",
    "self_attn.k_conv1d.weight": "ssm_conv1d_k.weight",
    "self_attn.v_conv1d.weight": "ssm_conv1d_v.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_norm.weight": "ssm_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.A_log": "ssm_a",
    "self_attn.dt_bias": "ssm_dt.bias",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    "block_sparse_moe.routed_expert_down_proj.weight": "ffn_routed_down.weight",
    "block_sparse_moe.routed_expert_up_proj.weight": "ffn_routed_up.weight",
    "block_sparse_moe.routed_expert_norm.weight": "ffn_routed_norm.weight",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
}
# <prefix>_res_norm.weight x <prefix>_res_proj.weight -> one score vector
_RES = {"self_attention_res": "attn_res_score.weight", "mlp_res": "ffn_res_score.weight"}
_OUTPUT_RES = "model.output_attn_res"


def _is_kda(text: dict, layer: int) -> bool:
    return (layer + 1) not in text["linear_attn_config"]["full_attn_layers"]


def plan_tensors(tensors: dict[str, tuple[str, tuple[int, ...]]], text: dict, *, expert_type: int,
                 outtype: int | None = None) -> tuple[list[Planned], list[str]]:
    """The GGUF tensors of a K3 checkpoint, in layer order, and the source names skipped.

    ``tensors``: source name -> (safetensors dtype, shape); ``text``: the text config
    (``text_config`` of K3's config.json). Raises ``UnsupportedError`` for a tensor the
    layout does not know, before anything is written.
    """
    n_head = int(text["num_attention_heads"])
    v_dim, nope = int(text["v_head_dim"]), int(text["qk_nope_head_dim"])
    n_experts = int(text["num_experts"])
    by_layer: dict[int | None, list[Planned]] = {}
    skipped: list[str] = []
    experts: dict[tuple[int, str], dict[int, dict[str, str]]] = {}
    res: dict[str, dict[str, str]] = {}

    def add(layer, name, shape, src_dtype, recipe, ggml_type=None):
        t = ggml_type if ggml_type is not None else out_type(name, shape, src_dtype, outtype)
        by_layer.setdefault(layer, []).append(Planned(C.TensorInfo(name, t, shape), recipe, src_dtype, layer))

    for src, (dtype, shape) in tensors.items():
        if src.startswith(SKIPPED_PREFIXES):
            skipped.append(src)
            continue
        if not src.startswith(PREFIX):
            raise UnsupportedError(f"tensor {src!r} is outside {PREFIX!r}: not a Kimi K3 text tensor")
        name = src[len(PREFIX):]
        if name in _GLOBAL_NAMES:
            add(None, _GLOBAL_NAMES[name], tuple(shape), dtype, Recipe("copy", (src,)))
            continue
        if name.startswith(_OUTPUT_RES + "_"):
            res.setdefault("output_res_score.weight", {})[name.rsplit("_", 1)[1].split(".")[0]] = src
            continue
        m = _LAYER.match(name)
        if not m:
            raise UnsupportedError(f"no kimi-k3 GGUF name for tensor {src!r}")
        layer, rest = int(m.group(1)), m.group(2)
        blk = f"blk.{layer}."
        e = _EXPERT.match(rest)
        if e:
            experts.setdefault((layer, e.group(2)), {}).setdefault(int(e.group(1)), {})[e.group(3)] = src
            continue
        fused = next((p for p in _RES if rest.startswith(p + "_")), None)
        if fused:
            res.setdefault(blk + _RES[fused], {})[rest[len(fused) + 1:].split(".")[0]] = src
            continue
        if rest == "self_attn.g_proj.weight":
            gname = "ssm_g.weight" if _is_kda(text, layer) else "attn_gate.weight"
            add(layer, blk + gname, tuple(shape), dtype, Recipe("copy", (src,)))
        elif rest == "self_attn.kv_b_proj.weight":
            for suffix, out_shape, recipe in kv_b_halves((src,), shape, v_dim, nope):
                add(layer, blk + suffix, out_shape, dtype, recipe)
        elif rest in _LAYER_NAMES:
            gname = blk + _LAYER_NAMES[rest]
            if rest == "self_attn.A_log":
                add(layer, gname, (n_head,), dtype, Recipe("neg_exp", (src,), n_head))
            elif rest.endswith("_conv1d.weight"):
                d_inner, d_conv = shape[0], shape[-1]
                add(layer, gname, (1, d_inner, 1, d_conv), dtype, Recipe("copy", (src,)))
            else:
                add(layer, gname, tuple(shape), dtype, Recipe("copy", (src,)))
        else:
            raise UnsupportedError(f"no kimi-k3 GGUF name for tensor {src!r}")

    for gname, parts in res.items():
        if set(parts) != {"norm", "proj"}:
            raise UnsupportedError(f"{gname}: needs both _res_norm and _res_proj, found {sorted(parts)}")
        n_shape = tensors[parts["norm"]][1]
        layer = int(gname.split(".")[1]) if gname.startswith("blk.") else None
        add(layer, gname, (int(n_shape[-1]),), "F32", Recipe("fuse", (parts["norm"], parts["proj"])))

    for (layer, wid), got in sorted(experts.items()):
        missing = [i for i in range(n_experts) if i not in got]
        if missing:
            raise UnsupportedError(f"layer {layer} {wid}: {len(missing)} of {n_experts} routed experts missing, "
                                   f"first is {missing[0]}")
        first = got[0]
        if "weight_packed" in first:
            packed = tensors[first["weight_packed"]][1]
            rows, k = int(packed[0]), int(packed[1]) * 2
            srcs = tuple(s for i in range(n_experts) for s in (got[i]["weight_packed"], got[i]["weight_scale"]))
            src_dtype = "MXFP4"
        else:
            rows, k = (int(d) for d in tensors[first["weight"]][1])
            srcs = tuple(got[i]["weight"] for i in range(n_experts))
            src_dtype = tensors[first["weight"]][0]
        add(layer, f"blk.{layer}.{EXPERT_PROJ[wid]}.weight", (n_experts, rows, k), src_dtype,
            Recipe("experts", srcs, n_experts), ggml_type=expert_type)

    planned = layer_order(by_layer)
    return planned, skipped


def metadata(text: dict, *, file_type: int) -> list[C.KV]:
    """The ``kimi-k3.*`` keys (and ``general.architecture`` / ``file_type`` / quantization
    version) as the converter writes them from K3's ``text_config``; tokenizer keys come from
    ``vocab.tokenizer_metadata``. PyPI ``gguf`` has no KIMI_K3 constants yet, so the key
    names are spelled here."""
    la = text["linear_attn_config"]
    layers = int(text["num_hidden_layers"])
    if text.get("hidden_act") != "situ" or text.get("moe_router_activation_func") != "sigmoid":
        raise UnsupportedError(f"kimi-k3 in llama.cpp needs the situ activation and a sigmoid router, config has "
                               f"{text.get('hidden_act')!r} / {text.get('moe_router_activation_func')!r}")
    if not text.get("mla_use_nope"):
        raise UnsupportedError("kimi-k3 in llama.cpp is nope-only MLA (mla_use_nope), this config is not")
    k = ArchKeys(ARCH)
    k.u32("block_count", layers)
    k.u32("context_length", text["max_position_embeddings"])
    k.u32("embedding_length", text["hidden_size"])
    k.u32("feed_forward_length", text["intermediate_size"])
    k.u32("attention.head_count", text["num_attention_heads"])
    # MLA served as MQA: one KV head on MLA layers, 0 marks a KDA (recurrent) layer
    k.add(C.KV(f"{ARCH}.attention.head_count_kv", C.ARRAY,
               [1 if (i + 1) in la["full_attn_layers"] else 0 for i in range(layers)], C.INT32))
    k.f32("attention.layer_norm_rms_epsilon", text.get("rms_norm_eps"))
    k.f32("rope.freq_base", text.get("rope_theta"))
    k.routing(experts=text["num_experts"], used=text["num_experts_per_token"], groups=text.get("n_group"),
              groups_used=text.get("topk_group"), file_type=file_type)
    k.u32("vocab_size", text["vocab_size"])
    k.u32("ssm.conv_kernel", la["short_conv_kernel_size"])
    k.u32("kda.head_dim", la["head_dim"])
    k.f32("kda.gate_lower_bound", la.get("gate_lower_bound"))
    k.mla(q_lora=text.get("q_lora_rank"), kv_lora=int(text["kv_lora_rank"]), rope=int(text["qk_rope_head_dim"]),
          nope=int(text["qk_nope_head_dim"]), v_dim=int(text["v_head_dim"]))
    k.u32("expert_feed_forward_length", text["moe_intermediate_size"])
    k.u32("expert_shared_count", text["num_shared_experts"])
    k.u32("leading_dense_block_count", text["first_k_dense_replace"])
    k.f32("expert_weights_scale", text["routed_scaling_factor"])
    k.flag("expert_weights_norm", text["moe_renormalize"])
    k.u32("expert_latent_length", text.get("routed_expert_hidden_size"))
    k.f32("activation.situ_beta", text["activation_situ_beta"])
    k.f32("activation.situ_linear_beta", text["activation_situ_linear_beta"])
    k.u32("attn_res.block_size", text["attn_res_block_size"])
    return k.done()
