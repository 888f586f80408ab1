"""The ``gpt-oss`` GGUF layout of an openai/gpt-oss checkpoint (MXFP4 experts).

llama.cpp's converter (``conversion/gpt_oss.py``, ``GptOssModel``, with ``base.py``'s
``TextModel`` and gguf-py's tensor map, llama-cpp-python 0.3.36) is the spec, read and
rewritten here:

- every expert of a projection is one fused ``[E, rows, K/32, 16]`` ``_blocks`` and
  ``[E, rows, K/32]`` ``_scales`` tensor; ``gate_up_proj`` interleaves gate (even rows)
  and up (odd rows), which the converter splits into ``ffn_gate_exps`` and
  ``ffn_up_exps`` (``formats.gptoss.split_gate_up``), ``down_proj`` is ``ffn_down_exps``;
  with ``--expert-type mxfp4`` the codes are repacked losslessly (the converter's
  ``repack_mxfp4``), one expert at a time;
- ``gate_up_proj_bias`` ``[E, 2I]`` is split the same way into ``ffn_{gate,up}_exps.bias``;
  attention and router biases, ``sinks`` (``attn_sinks.weight``) and norms are F32, the
  router weight (``ffn_gate_inp``) too; the other 2-D tensors keep their BF16 bytes;
- the ``gpt-oss.*`` keys of ``TextModel.set_gguf_parameters`` plus ``sliding_window`` and
  ``expert_feed_forward_length``. The converter reads config.json through transformers'
  ``GptOssConfig``, which fills what a config leaves out; ``DEFAULTS`` are those values.

llama.cpp fixes what it does not read from the file (``openai-moe.cpp``): sliding-window
attention on even layers, full on odd ones, and SwiGLU's alpha 1.702 and limit 7.0; a config
that says otherwise is refused rather than converted into a model that runs differently.
"""

from __future__ import annotations

import re

from ..errors import UnsupportedError
from . import container as C
from .tensors import ArchKeys, Planned, Recipe, layer_order, out_type

ARCH = "gpt-oss"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERTS = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_bias|)$")
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                 "model.norm.weight": "output_norm.weight"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    **{f"self_attn.{p}_proj.{w}": f"attn_{g}.{w}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
       for w in ("weight", "bias")},
}
# what transformers' GptOssConfig gives a config.json that leaves these out
DEFAULTS = {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "sliding_window": 128}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}      # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants


def plan_tensors(tensors: dict[str, tuple[str, tuple[int, ...]]], config: dict, *, expert_type: int,
                 outtype: int | None = None) -> tuple[list[Planned], list[str]]:
    """The GGUF tensors of a gpt-oss checkpoint in layer order, and the source names skipped
    (none: every tensor has a place); ``UnsupportedError`` for a tensor it does not know."""
    n_experts = int(config["num_local_experts"])
    by_layer: dict[int | None, list[Planned]] = {}
    fused: dict[tuple[int, str], dict[str, str]] = {}

    def add(layer, name, shape, dtype, recipe, ggml_type=None):
        t = ggml_type if ggml_type is not None else out_type(name, shape, dtype, outtype)
        by_layer.setdefault(layer, []).append(Planned(C.TensorInfo(name, t, shape), recipe, dtype, layer))

    for src, (dtype, shape) in tensors.items():
        shape = tuple(int(d) for d in shape)
        if src in _GLOBAL_NAMES:
            add(None, _GLOBAL_NAMES[src], shape, dtype, Recipe("copy", (src,)))
            continue
        m = _LAYER.match(src)
        if not m:
            raise UnsupportedError(f"no gpt-oss GGUF name for tensor {src!r}")
        layer, rest = int(m.group(1)), m.group(2)
        if rest in _LAYER_NAMES:
            add(layer, f"blk.{layer}.{_LAYER_NAMES[rest]}", shape, dtype, Recipe("copy", (src,)))
        elif e := _EXPERTS.match(rest):
            fused.setdefault((layer, e.group(1)), {})[e.group(2) or "plain"] = src
        else:
            raise UnsupportedError(f"no gpt-oss GGUF name for tensor {src!r}")

    for (layer, proj), parts in sorted(fused.items()):
        for suffix, recipe_rows, shape, bias_shape in _expert_tensors(tensors, proj, parts, n_experts):
            blk = f"blk.{layer}.{suffix}"
            add(layer, blk + ".weight", shape, "MXFP4",
                Recipe("experts", (parts["_blocks"], parts["_scales"]), n_experts, rows=recipe_rows),
                ggml_type=expert_type)
            bias = parts["_bias"]
            if recipe_rows == "all":
                add(layer, blk + ".bias", bias_shape, tensors[bias][0], Recipe("copy", (bias,)))
            else:
                add(layer, blk + ".bias", bias_shape, tensors[bias][0],
                    Recipe("deinterleave", (bias,), 0 if recipe_rows == "even" else 1))
    return layer_order(by_layer), []


def _expert_tensors(tensors, proj: str, parts: dict[str, str], n_experts: int):
    """(GGUF name suffix, rows taken, numpy shape, bias shape) of one fused projection."""
    any_src = next(iter(parts.values()))
    if "plain" in parts or not {"_blocks", "_scales", "_bias"} <= set(parts):
        raise UnsupportedError(f"{any_src}: gpt-oss experts are mapped from MXFP4 _blocks, _scales and _bias "
                               f"(found {', '.join(sorted(parts))}); BF16 gpt-oss experts are not mapped yet")
    (bdt, bshape), (sdt, sshape) = tensors[parts["_blocks"]], tensors[parts["_scales"]]
    bshape, sshape = tuple(bshape), tuple(sshape)
    if bdt != "U8" or sdt != "U8" or len(bshape) != 4 or bshape[3] != 16 or sshape != bshape[:3]:
        raise UnsupportedError(f"{parts['_blocks']}: expected U8 [E, rows, K/32, 16] blocks with [E, rows, K/32] "
                               f"scales, found {bdt} {list(bshape)} and {sdt} {list(sshape)}")
    e, rows, k = bshape[0], bshape[1], bshape[2] * 32
    if e != n_experts:
        raise UnsupportedError(f"{parts['_blocks']}: {e} experts, config.json says {n_experts}")
    if tuple(tensors[parts["_bias"]][1]) != (e, rows):
        raise UnsupportedError(f"{parts['_bias']}: expected [{e}, {rows}], found {list(tensors[parts['_bias']][1])}")
    if proj == "down_proj":
        yield "ffn_down_exps", "all", (e, rows, k), (e, rows)
        return
    if rows % 2:
        raise UnsupportedError(f"{parts['_blocks']}: gate_up_proj interleaves gate and up, but has {rows} rows")
    yield "ffn_gate_exps", "even", (e, rows // 2, k), (e, rows // 2)
    yield "ffn_up_exps", "odd", (e, rows // 2, k), (e, rows // 2)


def _rope_params(config: dict) -> dict:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or DEFAULT_ROPE)
    params.setdefault("rope_theta", config.get("rope_theta", DEFAULTS["rope_theta"]))
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    return params


def metadata(config: dict, *, file_type: int) -> list[C.KV]:
    """The ``gpt-oss.*`` keys as ``GptOssModel.set_gguf_parameters`` writes them."""
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    for key, want in SWIGLU.items():
        if key in config and float(config[key]) != want:
            raise UnsupportedError(f"llama.cpp runs gpt-oss with {key} {want} (fixed in its code); config.json has "
                                   f"{config[key]}")
    types = config.get("layer_types")
    swa = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if types is not None and list(types) != swa:
        raise UnsupportedError("llama.cpp runs gpt-oss with sliding-window attention on even layers and full "
                               f"attention on odd ones (fixed in its code); config.json's layer_types are {types}")
    k = ArchKeys(ARCH)
    k.u32("block_count", layers)
    k.u32("context_length", config.get("max_position_embeddings", DEFAULTS["max_position_embeddings"]))
    k.u32("embedding_length", config["hidden_size"])
    k.u32("feed_forward_length", config["intermediate_size"])
    k.u32("attention.head_count", heads)
    k.u32("attention.head_count_kv", config.get("num_key_value_heads") or heads)
    _rope(k, _rope_params(config))
    k.f32("attention.layer_norm_rms_epsilon", config.get("rms_norm_eps", DEFAULTS["rms_norm_eps"]))
    k.u32("expert_count", config["num_local_experts"])
    k.u32("expert_used_count", config.get("num_experts_per_tok", config.get("num_experts_per_token")))
    head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
    k.u32("attention.key_length", head_dim)
    k.u32("attention.value_length", head_dim)
    k.add(C.KV("general.file_type", C.UINT32, int(file_type)))
    window = config.get("sliding_window", DEFAULTS["sliding_window"])
    if window is None:
        raise UnsupportedError("gpt-oss in llama.cpp needs a sliding_window; config.json sets none")
    k.u32("attention.sliding_window", window)
    k.u32("expert_feed_forward_length", config["intermediate_size"])
    return k.done()


def _rope(k: ArchKeys, params: dict) -> None:
    """base.py's RoPE keys: the ``full_attention`` parameters where a config gives them per layer
    type, yarn / linear scaling, the base frequency, and the sliding layers' own base if set."""
    full = params.get("full_attention", params)
    kind, factor = full.get("rope_type"), full.get("factor")
    if kind == "linear" and factor is not None:
        k.add(C.KV(f"{ARCH}.rope.scaling.type", C.STRING, "linear"))
        k.f32("rope.scaling.factor", factor)
    elif kind == "yarn" and factor is not None:
        if full.get("original_max_position_embeddings") is None:
            raise UnsupportedError("YaRN rope scaling without original_max_position_embeddings")
        k.add(C.KV(f"{ARCH}.rope.scaling.type", C.STRING, "yarn"))
        k.f32("rope.scaling.factor", factor)
        k.u32("rope.scaling.original_context_length", full["original_max_position_embeddings"])
        k.f32("rope.scaling.yarn_ext_factor", full.get("extrapolation_factor"))
        k.f32("rope.scaling.yarn_attn_factor", full.get("attention_factor", full.get("attn_factor")))
        k.f32("rope.scaling.yarn_beta_fast", full.get("beta_fast"))
        k.f32("rope.scaling.yarn_beta_slow", full.get("beta_slow"))
    elif kind not in (None, "default"):
        raise UnsupportedError(f"rope type {kind!r} is not mapped for gpt-oss (yarn and linear are)")
    k.f32("rope.freq_base", full.get("rope_theta"))
    k.f32("rope.freq_base_swa", params.get("sliding_attention", {}).get("rope_theta"))
