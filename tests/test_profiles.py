"""Profiles: detection, geometry, and classification of each family's tensor names."""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest

from k3ckpt.errors import InvalidFileError, NotFoundError
from k3ckpt.profiles import (
    PROFILES,
    Role,
    TensorRole,
    detect,
    detect_id,
    expert_groups,
    expert_stats,
    get_profile,
    logical_params,
)


@pytest.fixture(scope="module")
def k3_config():
    return json.loads(resources.files("k3ckpt.data").joinpath("k3_config.json").read_text())


def test_registry_has_every_family():
    assert {"kimi_k3", "kimi_linear", "deepseek_v3", "kimi_k2_thinking", "gpt_oss", "generic"} <= set(PROFILES)
    for pid, cls in PROFILES.items():
        assert cls.id == pid and cls.display_name


def test_unknown_profile_id():
    with pytest.raises(NotFoundError, match="kimi_k3"):
        get_profile("llama9")


# -- Kimi K3 ------------------------------------------------------------------------------------


def test_k3_geometry_from_real_config(k3_config):
    prof = detect(k3_config, [])
    assert prof.id == "kimi_k3"
    g = prof.geometry
    assert (g.num_layers, g.hidden_size, g.vocab_size) == (93, 7168, 163840)
    assert g.dense_layers == (0,)
    assert g.moe_layers == tuple(range(1, 93)) and len(g.moe_layers) == 92
    assert (g.experts, g.top_k, g.shared_experts) == (896, 16, 2)  # top_k: 50 is the generation key
    assert (g.moe_intermediate, g.expert_hidden) == (3072, 3584)
    assert g.layers_of("mla") == tuple(range(3, 92, 4)) + (92,)
    assert len(g.layers_of("kda")) == 69
    assert g.num_routed_experts == 82_432
    assert g.tied_embeddings is False
    assert prof.quant == "mxfp4-pack-quantized"  # found inside text_config


def test_k3_detected_from_names_alone():
    names = ["language_model.model.layers.1.block_sparse_moe.routed_expert_up_proj.weight",
             "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    assert detect_id(None, names) == "kimi_k3"
    prof = detect(None, names)
    assert prof.geometry is None and prof.quant == "mxfp4-pack-quantized"


@pytest.mark.parametrize("name,dtype,role,layer,expert,proj,weight,part,storage", [
    ("language_model.model.layers.7.block_sparse_moe.experts.123.w1.weight_packed", "U8",
     Role.ROUTED_EXPERT, 7, 123, "gate", "language_model.model.layers.7.block_sparse_moe.experts.123.w1.weight",
     "packed", "mxfp4-pack-quantized"),
    ("language_model.model.layers.7.block_sparse_moe.experts.123.w2.weight_scale", "U8",
     Role.ROUTED_EXPERT, 7, 123, "down", "language_model.model.layers.7.block_sparse_moe.experts.123.w2.weight",
     "scale", "mxfp4-pack-quantized"),
    ("language_model.model.layers.7.block_sparse_moe.experts.0.w3.weight_scale", "U8",
     Role.ROUTED_EXPERT, 7, 0, "up", "language_model.model.layers.7.block_sparse_moe.experts.0.w3.weight",
     "scale", "mxfp4-pack-quantized"),
    # covered by quantization_config targets, yet BF16 on disk: classified by dtype
    ("language_model.model.layers.7.block_sparse_moe.gate.weight", "BF16",
     Role.ROUTER, 7, None, None, "language_model.model.layers.7.block_sparse_moe.gate.weight", "weight", "bf16"),
    ("language_model.model.layers.7.block_sparse_moe.gate.e_score_correction_bias", "F32",
     Role.ROUTER, 7, None, None, "language_model.model.layers.7.block_sparse_moe.gate.e_score_correction_bias",
     "bias", "f32"),
    ("language_model.model.layers.7.block_sparse_moe.routed_expert_down_proj.weight", "BF16",
     Role.LATENT_PROJ, 7, None, "down", None, "weight", "bf16"),
    ("language_model.model.layers.7.block_sparse_moe.routed_expert_norm.weight", "BF16",
     Role.LATENT_PROJ, 7, None, None, None, "weight", "bf16"),
    ("language_model.model.layers.7.block_sparse_moe.shared_experts.down_proj.weight", "BF16",
     Role.SHARED_EXPERT, 7, None, "down", None, "weight", "bf16"),
    ("language_model.model.layers.0.mlp.up_proj.weight", "BF16", Role.DENSE_MLP, 0, None, "up", None, "weight", "bf16"),
    ("language_model.model.layers.7.self_attn.o_proj.weight", "BF16", Role.ATTN_MLA, 7, None, None, None, "weight", "bf16"),
    ("language_model.model.layers.5.self_attn.o_proj.weight", "BF16", Role.ATTN_KDA, 5, None, None, None, "weight", "bf16"),
    ("language_model.model.layers.5.self_attn.A_log", "F32", Role.ATTN_KDA, 5, None, None, None, "weight", "f32"),
    ("language_model.model.layers.5.self_attn.dt_bias", "F32", Role.ATTN_KDA, 5, None, None, None, "bias", "f32"),
    ("language_model.model.layers.5.mlp_res_proj.weight", "BF16", Role.RESIDUAL, 5, None, None, None, "weight", "bf16"),
    ("language_model.model.output_attn_res_norm.weight", "BF16", Role.RESIDUAL, None, None, None, None, "weight", "bf16"),
    ("language_model.model.layers.5.input_layernorm.weight", "BF16", Role.NORM, 5, None, None, None, "weight", "bf16"),
    ("language_model.model.norm.weight", "BF16", Role.NORM, None, None, None, None, "weight", "bf16"),
    ("language_model.model.embed_tokens.weight", "BF16", Role.EMBEDDING, None, None, None, None, "weight", "bf16"),
    ("language_model.lm_head.weight", "BF16", Role.LM_HEAD, None, None, None, None, "weight", "bf16"),
    ("vision_tower.encoder.blocks.3.mlp.fc0.weight", "BF16", Role.VISION, None, None, None, None, "weight", "bf16"),
    ("mm_projector.proj.2.weight", "BF16", Role.VISION, None, None, None, None, "weight", "bf16"),
])
def test_k3_names(k3_config, name, dtype, role, layer, expert, proj, weight, part, storage):
    r = detect(k3_config, []).classify(name, dtype)
    assert r == TensorRole(role, layer, expert, proj, weight or name, part, storage)


def test_k3_attention_without_config_uses_names():
    prof = get_profile("kimi_k3")  # no geometry
    lm = "language_model.model.layers.9"
    assert prof.classify(f"{lm}.self_attn.kv_b_proj.weight", "BF16").role is Role.ATTN_MLA
    assert prof.classify(f"{lm}.self_attn.f_a_proj.weight", "BF16").role is Role.ATTN_KDA
    assert prof.classify(f"{lm}.self_attn.q_conv1d.weight", "F32").role is Role.ATTN_KDA
    assert prof.classify(f"{lm}.self_attn.o_proj.weight", "BF16").role is Role.ATTN_OTHER


def test_k3_attention_lists_are_one_indexed(k3_config):
    cfg = copy.deepcopy(k3_config)
    lac = cfg["text_config"]["linear_attn_config"]
    lac["kda_layers"] = lac["kda_layers"] + [94]
    with pytest.raises(InvalidFileError, match="1-indexed"):
        detect(cfg, [])
    cfg = copy.deepcopy(k3_config)
    cfg["text_config"]["linear_attn_config"]["full_attn_layers"].append(1)  # layer 1 is KDA
    with pytest.raises(InvalidFileError, match="both"):
        detect(cfg, [])
    cfg = copy.deepcopy(k3_config)
    cfg["text_config"]["linear_attn_config"]["full_attn_layers"].remove(93)
    with pytest.raises(InvalidFileError, match="neither"):
        detect(cfg, [])


def test_bad_config_value_names_the_key(k3_config):
    cfg = copy.deepcopy(k3_config)
    cfg["text_config"]["num_experts"] = "896"
    with pytest.raises(InvalidFileError, match="num_experts"):
        detect(cfg, [])


# -- Kimi-Linear --------------------------------------------------------------------------------


def test_kimi_linear(k3_config):
    cfg = copy.deepcopy(k3_config["text_config"])
    cfg.pop("quantization_config")
    cfg.update(num_hidden_layers=4, routed_expert_hidden_size=None, num_experts=64, num_experts_per_token=6)
    cfg["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4])
    prof = detect(cfg, [])
    assert prof.id == "kimi_linear"
    g = prof.geometry
    assert g.expert_hidden == g.hidden_size and (g.experts, g.top_k) == (64, 6)
    assert g.attention == {0: "kda", 1: "kda", 2: "kda", 3: "mla"}
    r = prof.classify("model.layers.2.block_sparse_moe.experts.63.w2.weight", "BF16")
    assert (r.role, r.layer, r.expert, r.projection, r.part, r.storage) == (
        Role.ROUTED_EXPERT, 2, 63, "down", "weight", "bf16")
    assert prof.classify("model.layers.3.self_attn.o_proj.weight", "BF16").role is Role.ATTN_MLA
    assert prof.classify("lm_head.weight", "BF16").role is Role.LM_HEAD
    # names alone: shared experts under block_sparse_moe (Mixtral has none)
    assert detect_id(None, ["model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"]) == "kimi_linear"


# -- DeepSeek-V3 / Kimi K2 / K2-Thinking ----------------------------------------------------------


def _k2_config(**extra):
    cfg = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61,
           "hidden_size": 7168, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 384,
           "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048, "kv_lora_rank": 512,
           "vocab_size": 163840,
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    cfg.update(extra)
    return cfg


def test_kimi_k2_block_fp8():
    prof = detect(_k2_config(), [])
    assert prof.id == "deepseek_v3" and prof.quant == "fp8-block"
    g = prof.geometry
    assert (g.num_layers, len(g.moe_layers), g.experts, g.top_k, g.shared_experts) == (61, 60, 384, 8, 1)
    assert set(g.attention.values()) == {"mla"}
    w = prof.classify("model.layers.5.mlp.experts.17.down_proj.weight", "F8_E4M3")
    s = prof.classify("model.layers.5.mlp.experts.17.down_proj.weight_scale_inv", "F32")
    assert (w.role, w.layer, w.expert, w.projection, w.part, w.storage) == (
        Role.ROUTED_EXPERT, 5, 17, "down", "weight", "fp8-block")
    assert (s.part, s.storage, s.weight) == ("scale_inv", "fp8-block", w.weight)
    assert prof.classify("model.layers.5.mlp.shared_experts.gate_proj.weight", "F8_E4M3").role is Role.SHARED_EXPERT
    assert prof.classify("model.layers.5.mlp.gate.weight", "BF16").role is Role.ROUTER
    assert prof.classify("model.layers.0.mlp.gate_proj.weight", "F8_E4M3").role is Role.DENSE_MLP
    assert prof.classify("model.layers.5.self_attn.q_b_proj.weight", "F8_E4M3").role is Role.ATTN_MLA
    # multi-token-prediction layer 61 is outside num_hidden_layers: still placed, nothing dropped
    assert prof.classify("model.layers.61.self_attn.kv_a_proj_with_mqa.weight", "F8_E4M3").role is Role.ATTN_MLA
    assert prof.classify("model.layers.61.eh_proj.weight", "BF16").role is Role.OTHER
    assert detect_id(None, ["model.layers.3.mlp.experts.0.up_proj.weight_scale_inv"]) == "deepseek_v3"


def test_kimi_k2_thinking_int4():
    cfg = _k2_config(quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized",
                                          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}})
    prof = detect(cfg, [])
    assert prof.id == "kimi_k2_thinking" and prof.quant == "int4-pack-quantized"
    base = "model.layers.3.mlp.experts.200.gate_proj"
    for suffix, dtype, part in (("weight_packed", "I32", "packed"), ("weight_scale", "BF16", "scale"),
                                ("weight_shape", "I32", "shape")):
        r = prof.classify(f"{base}.{suffix}", dtype)
        assert (r.role, r.expert, r.projection, r.part, r.storage, r.weight) == (
            Role.ROUTED_EXPERT, 200, "gate", part, "int4-pack-quantized", f"{base}.weight")
    # attention stays BF16 in K2-Thinking
    assert prof.classify("model.layers.3.self_attn.o_proj.weight", "BF16").storage == "bf16"
    assert detect_id(None, [f"{base}.weight_packed"]) == "kimi_k2_thinking"


def test_k25_nested_text_config():
    cfg = {"model_type": "kimi_k25", "text_config": _k2_config(model_type="deepseek_v3")}
    prof = detect(cfg, [])
    assert prof.id == "deepseek_v3" and prof.geometry.experts == 384
    r = prof.classify("language_model.model.layers.2.mlp.experts.7.up_proj.weight", "F8_E4M3")
    assert (r.role, r.layer, r.expert, r.projection) == (Role.ROUTED_EXPERT, 2, 7, "up")


# -- gpt-oss -------------------------------------------------------------------------------------


def test_gpt_oss():
    cfg = {"model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880,
           "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
           "quantization_config": {"quant_method": "mxfp4"}}
    prof = detect(cfg, [])
    assert prof.id == "gpt_oss"
    g = prof.geometry
    assert (g.experts, g.top_k, g.moe_layers, g.moe_intermediate) == (32, 4, tuple(range(24)), 2880)
    x = "model.layers.4.mlp.experts"
    blocks = prof.classify(f"{x}.gate_up_proj_blocks", "U8")
    scales = prof.classify(f"{x}.gate_up_proj_scales", "U8")
    bias = prof.classify(f"{x}.gate_up_proj_bias", "BF16")
    assert (blocks.role, blocks.layer, blocks.expert, blocks.projection, blocks.part, blocks.storage) == (
        Role.ROUTED_EXPERT, 4, None, "gate_up", "blocks", "gpt-oss-mxfp4")
    assert blocks.weight == scales.weight == f"{x}.gate_up_proj" and scales.part == "scales"
    assert (bias.role, bias.part, bias.storage, bias.projection) == (Role.ROUTED_EXPERT, "bias", "bf16", "gate_up")
    assert prof.classify(f"{x}.down_proj_blocks", "U8").projection == "down"
    assert prof.classify("model.layers.4.mlp.router.weight", "BF16").role is Role.ROUTER
    assert prof.classify("model.layers.4.mlp.router.bias", "BF16").role is Role.ROUTER
    assert prof.classify("model.layers.4.self_attn.sinks", "BF16").role is Role.ATTN_OTHER
    assert detect_id(None, [f"{x}.gate_up_proj_blocks"]) == "gpt_oss"


# -- generic / unknown -----------------------------------------------------------------------------


def test_generic_mixtral_and_unknown_tensors():
    names = ["model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.layers.0.block_sparse_moe.gate.weight"]
    cfg = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_local_experts": 8,
           "num_experts_per_tok": 2, "intermediate_size": 14336}
    prof = detect(cfg, names)
    assert prof.id == "generic"
    assert (prof.geometry.experts, prof.geometry.top_k) == (8, 2)
    r = prof.classify(names[0], "BF16")
    assert (r.role, r.layer, r.expert, r.projection) == (Role.ROUTED_EXPERT, 0, 3, "gate")
    assert prof.classify(names[1], "BF16").role is Role.ROUTER
    odd = prof.classify("model.layers.2.mixer.weird_thing", "I64")
    assert (odd.role, odd.layer, odd.storage, odd.part) == (Role.OTHER, 2, "raw", "weight")
    assert prof.classify("rotary.inv_freq", "F32") == TensorRole(Role.OTHER, None, None, None, "rotary.inv_freq",
                                                                 "weight", "f32")


def test_generic_config_without_usual_keys_still_classifies():
    prof = detect({"model_type": "mystery"}, ["a.b"])
    assert prof.id == "generic" and prof.geometry is None
    assert prof.classify("a.b", "BF16").role is Role.OTHER


def test_nvfp4_parts_from_hint():
    cfg = {"model_type": "mystery", "quantization_config": {"quant_method": "compressed-tensors",
                                                            "format": "nvfp4-pack-quantized"}}
    prof = detect(cfg, [])
    base = "model.layers.1.mlp.experts.2.down_proj"
    got = {s: prof.classify(f"{base}.{s}", dt).storage
           for s, dt in (("weight_packed", "U8"), ("weight_scale", "F8_E4M3"), ("weight_global_scale", "F32"))}
    assert set(got.values()) == {"nvfp4"}
    # the same U8 codes without the hint are MXFP4 (compressed-tensors' other 4-bit float format)
    assert get_profile("generic").classify(f"{base}.weight_packed", "U8").storage == "mxfp4-pack-quantized"


def test_index_integers_only_as_whole_components():
    prof = get_profile("generic")
    r = prof.classify("model.layers.12.block_sparse_moe.experts.5.w3.weight", "BF16")
    assert (r.layer, r.expert, r.projection) == (12, 5, "up")  # w3's digit is not an index
    r = prof.classify("model.layers.3.mlp.experts.0.down_proj.weight", "BF16")
    assert (r.layer, r.expert) == (3, 0)


# -- experts -------------------------------------------------------------------------------------


def test_expert_groups_and_stats_k3_shapes():
    hdr = {}
    for e in (0, 1, 10):
        p = f"language_model.model.layers.1.block_sparse_moe.experts.{e}"
        for w, (n, k) in (("w1", (3072, 3584)), ("w2", (3584, 3072)), ("w3", (3072, 3584))):
            hdr[f"{p}.{w}.weight_packed"] = ("U8", (n, k // 2))
            hdr[f"{p}.{w}.weight_scale"] = ("U8", (n, k // 32))
    hdr["language_model.model.layers.1.block_sparse_moe.gate.weight"] = ("BF16", (896, 7168))
    groups = expert_groups(hdr)
    assert sorted(groups) == [(1, 0), (1, 1), (1, 10)]
    assert all(len(v) == 6 for v in groups.values())
    st = expert_stats(hdr)
    assert st.bytes_per_expert == 17_547_264  # K3_FACTS: one expert
    assert st.params_per_expert == 3 * 3072 * 3584
    assert (st.count, st.layers, st.experts_per_layer) == (3, (1,), {1: 3})


def test_expert_stats_fused_gpt_oss():
    e, i, h = 4, 160, 160
    x = "model.layers.0.mlp.experts"
    hdr = {f"{x}.gate_up_proj_blocks": ("U8", (e, 2 * i, h // 32, 16)),
           f"{x}.gate_up_proj_scales": ("U8", (e, 2 * i, h // 32)),
           f"{x}.gate_up_proj_bias": ("BF16", (e, 2 * i)),
           f"{x}.down_proj_blocks": ("U8", (e, h, i // 32, 16)),
           f"{x}.down_proj_scales": ("U8", (e, h, i // 32)),
           f"{x}.down_proj_bias": ("BF16", (e, h))}
    prof = get_profile("gpt_oss")
    st = expert_stats(hdr, prof)
    assert st.experts_per_layer == {0: e} and st.count == e
    assert st.params_per_expert == 2 * i * h + 2 * i + h * i + h
    assert st.bytes_per_expert == (2 * i * (h // 2 + h // 32) + 2 * 2 * i) + (h * (i // 2 + i // 32) + 2 * h)


def test_logical_params():
    prof = get_profile("kimi_k2_thinking")
    r = prof.classify("model.layers.1.mlp.experts.0.up_proj.weight_packed", "I32")
    assert logical_params(r, "I32", (2048, 7168 // 8)) == 2048 * 7168
    r = prof.classify("model.layers.1.mlp.experts.0.up_proj.weight_scale", "BF16")
    assert logical_params(r, "BF16", (2048, 7168 // 32)) == 0


def test_tensor_role_is_frozen_and_hashable():
    import dataclasses

    r = get_profile("generic").classify("model.layers.1.mlp.experts.2.up_proj.weight", "BF16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.layer = 3
    assert hash(r) == hash(TensorRole(Role.ROUTED_EXPERT, 1, 2, "up", "model.layers.1.mlp.experts.2.up_proj.weight",
                                      "weight", "bf16"))
    assert dataclasses.asdict(r)["role"] is Role.ROUTED_EXPERT and str(r.role) == "routed_expert"


# -- ModelOpt NVFP4 naming, configs lacking geometry ----------------------------------------------

_MODELOPT_QC = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}


def _modelopt_roles(prof, base):
    return {s: prof.classify(f"{base}.{s}", dt) for s, dt in
            (("weight", "U8"), ("weight_scale", "F8_E4M3"), ("weight_scale_2", "F32"), ("input_scale", "F32"))}


def test_modelopt_nvfp4_from_config():
    prof = detect(_k2_config(model_type="deepseek_v3", quantization_config=_MODELOPT_QC), [])
    assert prof.id == "deepseek_v3" and prof.quant == "nvfp4-modelopt"
    base = "model.layers.3.mlp.experts.9.down_proj"
    r = _modelopt_roles(prof, base)
    assert {s: (x.part, x.storage) for s, x in r.items()} == {
        "weight": ("weight", "nvfp4-modelopt"), "weight_scale": ("scale", "nvfp4-modelopt"),
        "weight_scale_2": ("scale_2", "nvfp4-modelopt"), "input_scale": ("input_scale", "f32")}
    assert {x.weight for s, x in r.items() if s != "input_scale"} == {f"{base}.weight"}
    assert all((x.role, x.layer, x.expert, x.projection) == (Role.ROUTED_EXPERT, 3, 9, "down") for x in r.values())
    assert r["weight"].quantized and not r["input_scale"].quantized
    # two codes per byte; scales carry no parameters
    assert logical_params(r["weight"], "U8", (7168, 2048 // 2)) == 7168 * 2048
    assert logical_params(r["weight_scale_2"], "F32", ()) == 0
    # BF16 layers of the same checkpoint stay plain
    assert prof.classify("model.layers.3.self_attn.o_proj.weight", "BF16").storage == "bf16"


def test_modelopt_nvfp4_from_names_when_config_is_silent():
    base = "model.layers.1.mlp.experts.0.up_proj"
    names = [f"{base}.weight", f"{base}.weight_scale", f"{base}.weight_scale_2", f"{base}.input_scale"]
    for cfg in (None, _k2_config(quantization_config=None)):   # hf_quant_config.json only: no quantization_config
        prof = detect(cfg, iter(names))                           # a one-shot iterator works too
        assert prof.quant == "nvfp4-modelopt"
        assert {x.storage for s, x in _modelopt_roles(prof, base).items() if s != "input_scale"} == {"nvfp4-modelopt"}
    # compressed-tensors NVFP4 names give its own id; the config's declaration wins over names
    ct = [f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_global_scale"]
    assert detect(None, ct).quant == "nvfp4"
    assert detect(None, ct).classify(ct[0], "U8").storage == "nvfp4"
    cfg = _k2_config(quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"})
    assert detect(cfg, names).quant == "int4-pack-quantized"
    # without any hint, U8 'weight' is not guessed to be quantized
    assert get_profile("deepseek_v3").classify(f"{base}.weight", "U8").storage == "raw"


@pytest.mark.parametrize("model_type,profile", [("deepseek_v3", "deepseek_v3"), ("kimi_k2", "deepseek_v3"),
                                                ("kimi_linear", "kimi_linear"), ("kimi_k3", "kimi_k3"),
                                                ("gpt_oss", "gpt_oss")])
def test_family_configs_lacking_geometry_keys_are_tolerated(model_type, profile):
    # a partial config.json (e.g. only the model type and quantization) used to raise
    # InvalidFileError for the Kimi/DeepSeek families while the generic profile coped
    cfg = {"model_type": model_type, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    prof = detect(cfg, [])
    assert prof.id == profile and prof.geometry is None
    r = prof.classify("model.layers.4.mlp.experts.1.gate_proj.weight", "BF16")
    assert (r.role, r.layer, r.expert) == (Role.ROUTED_EXPERT, 4, 1)
    if profile == "deepseek_v3":
        assert prof.quant == "fp8-block"
        assert detect({"model_type": model_type, "num_hidden_layers": 4}, []).geometry is None  # width missing


def test_family_config_with_a_bad_geometry_value_still_raises():
    with pytest.raises(InvalidFileError, match="n_routed_experts"):
        detect(_k2_config(n_routed_experts="384"), [])
    with pytest.raises(InvalidFileError, match="num_hidden_layers"):
        detect(_k2_config(num_hidden_layers=-1), [])
