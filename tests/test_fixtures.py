"""Fixtures: each builds, opens with the reader, detects as its family, is
deterministic, and holds realistic, correctly laid out data."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from k3ckpt.errors import NotFoundError, OutputExistsError, UsageError
from k3ckpt.fixtures import FIXTURES, K3Dims, fixture_spec, k3_layout, make_fixture
from k3ckpt.io import open_checkpoint, read_header
from k3ckpt.profiles import Role, detect, expert_stats

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _decode_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Independent MXFP4 decode (pair layout: low nibble = even column; E8M0 2^(s-127))."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))
    vals = E2M1[codes]
    s = np.exp2(scale.astype(np.float64) - 127).astype(np.float32)
    return vals * np.repeat(s, 32, axis=-1)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.suffix in (".safetensors", ".json", ".model")}


def test_catalog_lists_each_fixture():
    assert set(FIXTURES) == {"k3-tiny", "k3", "kimi-k2-tiny", "gpt-oss-tiny"}
    for name, spec in FIXTURES.items():
        assert spec.name == name and spec.description and spec.profile


# -- k3-tiny --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(k3_tiny):
    with open_checkpoint(k3_tiny) as ck:
        yield ck


def test_k3_tiny_shape_of_the_checkpoint(k3_tiny, tiny):
    spec = FIXTURES["k3-tiny"]
    d = spec.dims
    assert (d.layers, d.experts, d.top_k, d.hidden, d.expert_hidden, d.moe_intermediate) == (4, 8, 2, 256, 256, 256)
    # layers + embeddings shard + mm_projector + vision, K3's 6-digit total
    assert tiny.shards == [f"model-{i:05d}-of-000007.safetensors" for i in range(1, 8)]
    assert tiny.total_size == spec.total_bytes == tiny.index_metadata["total_size"]
    assert tiny.total_size < 10_000_000
    for side in ("config.json", "generation_config.json", "tokenizer_config.json", "tiktoken.model"):
        assert (k3_tiny / side).is_file()


def test_k3_tiny_config_is_consistent(tiny):
    cfg = tiny.config
    t = cfg["text_config"]
    assert cfg["model_type"] == "kimi_k3" and "quantization_config" not in cfg
    assert t["quantization_config"]["format"] == "mxfp4-pack-quantized"
    lac = t["linear_attn_config"]
    assert sorted(lac["kda_layers"] + lac["full_attn_layers"]) == list(range(1, t["num_hidden_layers"] + 1))
    assert lac["full_attn_layers"] == [4]
    assert t["top_k"] == 50 and t["num_experts_per_token"] == 2  # generation key untouched
    assert t["pad_token_id"] == t["vocab_size"] - 1
    prof = detect(cfg, tiny.tensors)
    g = prof.geometry
    assert prof.id == "kimi_k3"
    assert (g.dense_layers, g.moe_layers, g.experts, g.top_k) == ((0,), (1, 2, 3), 8, 2)
    assert g.attention == {0: "kda", 1: "kda", 2: "kda", 3: "mla"}


def test_k3_tiny_names_follow_the_release(tiny):
    prof = detect(tiny.config, tiny.tensors)
    roles = Counter(prof.classify(n, e.dtype).role for n, e in tiny.tensors.items())
    assert roles[Role.OTHER] == 0
    assert roles[Role.ROUTED_EXPERT] == 3 * 8 * 6
    assert roles[Role.ATTN_MLA] == 8 and roles[Role.ATTN_KDA] == 3 * 14
    assert roles[Role.VISION] > 0 and roles[Role.LATENT_PROJ] == 9 and roles[Role.RESIDUAL] == 4 * 4 + 2
    e = tiny.entry("language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_packed")
    assert (e.dtype, e.shape, e.shard) == ("U8", (256, 128), "model-00003-of-000007.safetensors")
    assert tiny.entry("language_model.model.layers.2.block_sparse_moe.experts.5.w1.weight_scale").shape == (256, 8)
    assert tiny.entry("language_model.model.layers.1.self_attn.A_log").dtype == "F32"
    st = expert_stats(tiny.tensors, prof)
    assert st.bytes_per_expert == FIXTURES["k3-tiny"].dims.expert_bytes == 3 * (256 * 128 + 256 * 8)


def test_k3_shard_order(tiny):
    """Non-expert tensors first (F32, then BF16), then experts in lexicographic
    name order, each expert's six tensors contiguous."""
    hdr = tiny.headers["model-00002-of-000007.safetensors"]
    names = list(hdr.tensors)  # in offset order
    dts = [hdr.tensors[n].dtype for n in names]
    first_u8 = dts.index("U8")
    assert dts[:first_u8] == sorted(dts[:first_u8], key=lambda d: {"F32": 0, "BF16": 1}[d])
    assert set(dts[first_u8:]) == {"U8"}
    experts = names[first_u8:]
    order = [n.split(".experts.")[1].split(".")[0] for n in experts[::6]]
    assert order == sorted(str(i) for i in range(8))
    suffixes = [n.split(".experts.")[1].split(".", 1)[1] for n in experts[:6]]
    assert suffixes == ["w1.weight_packed", "w1.weight_scale", "w2.weight_packed", "w2.weight_scale",
                        "w3.weight_packed", "w3.weight_scale"]


def test_k3_tiny_weights_look_like_k3(tiny):
    scales = Counter()
    values = []
    for n in tiny.tensors:
        if n.endswith(".weight_scale"):
            s = tiny.read_raw(n)
            scales.update(s.ravel().tolist())
            if ".layers.1." in n:
                values.append(_decode_mxfp4(tiny.read_raw(n.replace("_scale", "_packed")), s).ravel())
    total = sum(scales.values())
    mode, count = scales.most_common(1)[0]
    # K3_FACTS: a sample of real scales used 11 codes 0x70-0x7a, 82% 0x79
    assert mode == 0x79 and 0.7 < count / total < 0.92
    assert sum(v for k, v in scales.items() if 0x70 <= k <= 0x7A) / total > 0.999
    assert 5 <= len(scales) <= 14
    x = np.concatenate(values).astype(np.float64)
    kurtosis = ((x - x.mean()) ** 4).mean() / x.var() ** 2
    assert kurtosis > 3.3  # heavier than a Gaussian (3)
    norm = tiny.read_raw("language_model.model.layers.1.input_layernorm.weight").astype(np.uint32) << 16
    assert abs(norm.view(np.float32).mean() - 1.0) < 0.05


def test_k3_tiny_is_deterministic(k3_tiny, tmp_path):
    again = make_fixture("k3-tiny", tmp_path / "again")
    assert _digest(again) == _digest(k3_tiny)
    other = make_fixture("k3-tiny", tmp_path / "seed1", seed=1)
    a, b = _digest(other), _digest(k3_tiny)
    assert a.keys() == b.keys()
    assert all(a[k] != b[k] for k in a if k.endswith(".safetensors"))


# -- k3 with real expert shapes --------------------------------------------------------------------


def test_k3_real_expert_shapes(tmp_path):
    path = make_fixture("k3", tmp_path / "k3", layers=2, experts=2)
    with open_checkpoint(path) as ck:
        prof = detect(ck.config, ck.tensors)
        st = expert_stats(ck.tensors, prof)
        assert st.bytes_per_expert == 17_547_264 and st.count == 2  # the real expert size
        p = "language_model.model.layers.1.block_sparse_moe.experts.1"
        assert ck.entry(f"{p}.w1.weight_packed").shape == (3072, 1792)
        assert ck.entry(f"{p}.w3.weight_scale").shape == (3072, 112)
        assert ck.entry(f"{p}.w2.weight_packed").shape == (3584, 1536)
        assert ck.entry(f"{p}.w2.weight_scale").shape == (3584, 96)
        assert ck.entry("language_model.model.layers.1.block_sparse_moe.routed_expert_up_proj.weight").shape == (256, 3584)
        g = prof.geometry
        assert (g.moe_intermediate, g.expert_hidden, g.hidden_size, g.moe_layers) == (3072, 3584, 256, (1,))
        assert ck.shards[-1] == "model-00005-of-000005.safetensors"


def test_k3_size_grows_with_experts():
    small = fixture_spec("k3", layers=2, experts=2).total_bytes
    more = fixture_spec("k3", layers=2, experts=5).total_bytes
    assert more - small == 3 * 17_547_264 + 3 * 256 * 2 + 3 * 4  # experts + router rows (BF16) + biases (F32)
    default = FIXTURES["k3"]
    assert (default.layers, default.experts) == (3, 16)
    assert 0.5e9 < default.total_bytes < 0.65e9


def test_greedy_shards_keep_k3_naming(tmp_path):
    path = make_fixture("k3-tiny", tmp_path / "greedy", shard_bytes=3_000_000)
    with open_checkpoint(path) as ck:
        n = len(ck.shards)
        assert n >= 3
        assert ck.shards == [f"model-{i:05d}-of-{n:06d}.safetensors" for i in range(1, n + 1)]
        assert ck.total_size == FIXTURES["k3-tiny"].total_bytes
        assert max(ck.headers[s].data_size for s in ck.shards) <= 3_000_000


# -- neighbours ----------------------------------------------------------------------------------


def test_kimi_k2_tiny_block_fp8(kimi_k2_tiny):
    with open_checkpoint(kimi_k2_tiny) as ck:
        prof = detect(ck.config, ck.tensors)
        assert prof.id == "deepseek_v3" and prof.geometry.experts == 8
        name = "model.layers.1.mlp.experts.3.gate_proj"
        w, s = ck.entry(f"{name}.weight"), ck.entry(f"{name}.weight_scale_inv")
        assert (w.dtype, w.shape) == ("F8_E4M3", (192, 256))   # 192: not a multiple of 128
        assert (s.dtype, s.shape) == ("F32", (2, 2))             # ceil(192/128) x ceil(256/128)
        q = ck.read_raw(f"{name}.weight").view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        scale = ck.read_raw(f"{name}.weight_scale_inv")
        for i in range(2):
            for j in range(2):
                tile = q[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
                assert np.abs(tile).max() == 448.0  # each tile's amax lands on the E4M3 maximum
        deq = q * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:192, :256]  # multiply despite the name
        assert 0.015 < deq.std() < 0.025
        roles = Counter(r.role for r in prof.classify_all(ck.tensors).values())
        assert roles[Role.ROUTED_EXPERT] == 2 * 8 * 3 * 2 and roles[Role.OTHER] == 0
        assert len(ck.shards) >= 2 and all(s.endswith("-of-%05d.safetensors" % len(ck.shards)) for s in ck.shards)


def test_gpt_oss_tiny_fused_experts(gpt_oss_tiny):
    with open_checkpoint(gpt_oss_tiny) as ck:
        prof = detect(ck.config, ck.tensors)
        assert prof.id == "gpt_oss"
        x = "model.layers.1.mlp.experts"
        blocks, scales = ck.entry(f"{x}.gate_up_proj_blocks"), ck.entry(f"{x}.gate_up_proj_scales")
        assert blocks.shape == (4, 320, 5, 16) and scales.shape == (4, 320, 5)  # hidden 160 = 5 blocks of 32
        assert ck.entry(f"{x}.gate_up_proj_bias").shape == (4, 320)
        assert ck.entry(f"{x}.down_proj_blocks").shape == (4, 160, 5, 16)
        s = ck.read_raw(f"{x}.gate_up_proj_scales")
        # even rows gate, odd rows up; the fixture puts up one binade lower so the interleave shows
        assert Counter(s[:, 0::2].ravel().tolist()).most_common(1)[0][0] == 0x79
        assert Counter(s[:, 1::2].ravel().tolist()).most_common(1)[0][0] == 0x78
        b = ck.read_raw(f"{x}.down_proj_blocks")
        vals = _decode_mxfp4(b.reshape(4, 160, 80), ck.read_raw(f"{x}.down_proj_scales"))
        assert np.isfinite(vals).all() and 0.01 < np.abs(vals).mean() < 0.05
        st = expert_stats(ck.tensors, prof)
        assert st.experts_per_layer == {0: 4, 1: 4}
        assert st.bytes_per_expert == FIXTURES["gpt-oss-tiny"].expert_bytes


def test_gpt_oss_hidden_not_multiple_of_256():
    assert FIXTURES["gpt-oss-tiny"].dims.hidden % 32 == 0 and FIXTURES["gpt-oss-tiny"].dims.hidden % 256


def test_neighbours_deterministic(tmp_path, kimi_k2_tiny, gpt_oss_tiny):
    assert _digest(make_fixture("kimi-k2-tiny", tmp_path / "k2")) == _digest(kimi_k2_tiny)
    assert _digest(make_fixture("gpt-oss-tiny", tmp_path / "go")) == _digest(gpt_oss_tiny)


# -- options and errors ----------------------------------------------------------------------------


def test_options(tmp_path):
    spec = fixture_spec("k3-tiny", layers=3, experts=4, seed=7, hidden=128)
    assert (spec.layers, spec.experts, spec.top_k, spec.seed, spec.dims.hidden) == (3, 4, 2, 7, 128)
    assert fixture_spec("k3-tiny", experts=1).top_k == 1
    path = make_fixture("k3-tiny", tmp_path / "small", layers=2, experts=3, progress=True)
    with open_checkpoint(path) as ck:
        assert json.loads((path / "config.json").read_text())["k3ckpt_fixture"] == {"name": "k3-tiny", "seed": 0}
        assert expert_stats(ck.tensors).count == 3


def test_errors(tmp_path, k3_tiny):
    with pytest.raises(NotFoundError, match="k3-tiny"):
        fixture_spec("k4")
    with pytest.raises(UsageError, match="no dimension 'hiddne'"):
        fixture_spec("k3-tiny", hiddne=64)
    with pytest.raises(UsageError, match="multiple of 32"):
        fixture_spec("k3-tiny", hidden=100)
    with pytest.raises(UsageError, match="MoE layer"):
        fixture_spec("k3-tiny", layers=1)
    with pytest.raises(UsageError, match="top_k"):
        fixture_spec("k3-tiny", experts=4, top_k=5)
    with pytest.raises(OutputExistsError):
        make_fixture("k3-tiny", k3_tiny)


def test_overwrite_removes_stale_shards(tmp_path):
    path = make_fixture("k3-tiny", tmp_path / "x", layers=3, experts=2)
    assert len(list(path.glob("*.safetensors"))) == 6
    (path / "notes.txt").write_text("mine")
    make_fixture("k3-tiny", path, layers=2, experts=2, overwrite=True)
    assert sorted(p.name for p in path.glob("*.safetensors")) == [f"model-{i:05d}-of-000005.safetensors"
                                                                   for i in range(1, 6)]
    assert (path / "notes.txt").read_text() == "mine"
    with open_checkpoint(path) as ck:
        assert len(ck.shards) == 5
    for s in path.glob("*.safetensors"):
        assert read_header(s).file_size == s.stat().st_size


def test_k3dims_real_is_the_release():
    d = K3Dims()
    assert d.full_attn_layers == list(range(4, 93, 4)) + [93]
    assert len(d.kda_layers) == 69 and d.expert_bytes == 17_547_264 and d.shard_count == 96
    assert d.shard_name(1) == "model-00001-of-000096.safetensors"


def test_k3_layout_experts_in_writer_order():
    from k3ckpt.fixtures.k3_layout import layer_entries, shard_order

    d = fixture_spec("k3-tiny", experts=12).dims
    layout = k3_layout(d)
    for layer in range(d.layers):
        assert layout[d.shard_name(layer + 1)] == shard_order(layer_entries(d, layer))


def test_generators():
    from k3ckpt.fixtures import generate as g

    t = g.t_quantiles()
    p = (np.arange(t.size) + 0.5) / t.size
    # Student-t(5) quantiles from statistical tables
    assert np.interp(0.975, p, t) == pytest.approx(2.5706, abs=2e-3)
    assert np.interp(0.995, p, t) == pytest.approx(4.0321, abs=3e-3)
    assert np.all(np.diff(t) >= 0) and t[0] == -t[-1]
    a = g.rng_for(0, "x").integers(0, 1 << 30, 4)
    assert np.array_equal(a, g.rng_for(0, "x").integers(0, 1 << 30, 4))
    assert not np.array_equal(a, g.rng_for(1, "x").integers(0, 1 << 30, 4))
    x = np.zeros((130, 260), np.float32)
    x[0, 0] = 2.0
    q, s = g.fp8_block_quantize(x)
    assert s.shape == (2, 3) and s[0, 0] == np.float32(2.0 / 448) and (s.ravel()[1:] == 1).all()
    assert q.view(np.uint8)[0, 0] == 0x7E  # +448 in E4M3
