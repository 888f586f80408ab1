"""Source-format fixtures: real names/dtypes/configs, detection, decodable quantized weights."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import k3ckpt.formats.fp8_block  # noqa: F401  (register the source formats)
import k3ckpt.formats.int4_pack  # noqa: F401
import k3ckpt.formats.nvfp4  # noqa: F401
from k3ckpt.errors import NotFoundError, OutputExistsError, UsageError
from k3ckpt.fixtures.sources import (
    SOURCE_FIXTURES,
    make_source_fixture,
    original_values,
    source_fixture,
)
from k3ckpt.formats.base import get_format
from k3ckpt.io import open_checkpoint
from k3ckpt.io.dtypes import lookup
from k3ckpt.profiles import detect, quant_hint

STORAGE = {"kimi-k2-thinking-tiny": "int4-pack-quantized", "deepseek-v3-tiny": "fp8-block", "nvfp4-tiny": "nvfp4",
           "nvfp4-modelopt-tiny": "nvfp4-modelopt"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {name: make_source_fixture(name, root / name) for name in SOURCE_FIXTURES}


@pytest.mark.parametrize("name", sorted(SOURCE_FIXTURES))
def test_layout_matches_spec_and_detects(built, name):
    spec = SOURCE_FIXTURES[name]
    with open_checkpoint(built[name]) as ck:
        assert {n: (e.dtype, tuple(e.shape)) for n, e in ck.tensors.items()} == {
            n: (dt, tuple(s)) for n, dt, s in spec.entries()}
        assert ck.total_size == spec.total_bytes
        assert len(ck.shards) >= 2
        cfg = ck.config
        assert quant_hint(cfg) == STORAGE[name]
        prof = detect(cfg, ck.tensors.keys())
        assert prof.id == spec.profile
        storages = {}
        for n, e in ck.tensors.items():
            r = prof.classify(n, e.dtype)
            storages.setdefault(r.role.value, set()).add(r.storage)
        # ModelOpt's W4A4 export adds each module's activation input_scale (F32 [])
        assert storages["routed_expert"] == {STORAGE[name]} | ({"f32"} if name == "nvfp4-modelopt-tiny" else set())
        quantized_elsewhere = {s for role, ss in storages.items() if role != "routed_expert" for s in ss
                               if s in ("fp8-block", "int4-pack-quantized", "nvfp4", "nvfp4-modelopt")}
        # DeepSeek-V3 stores every linear layer in FP8; the others only their routed experts
        assert quantized_elsewhere == ({"fp8-block"} if name == "deepseek-v3-tiny" else set())


def test_real_release_details(built):
    spec = SOURCE_FIXTURES["kimi-k2-thinking-tiny"]
    with open_checkpoint(built["kimi-k2-thinking-tiny"]) as ck:
        qc = ck.config["quantization_config"]
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
        w = qc["config_groups"]["group_0"]["weights"]
        got = (w["num_bits"], w["group_size"], w["symmetric"], w["type"], w["strategy"])
        assert got == (4, 32, True, "int", "group")
        assert ck.config["model_type"] == "kimi_k2"
        name = "model.layers.1.mlp.experts.3.down_proj"
        assert ck.entry(f"{name}.weight_packed").dtype == "I32"
        assert tuple(ck.entry(f"{name}.weight_packed").shape) == (spec.dims.hidden, spec.dims.moe_intermediate // 8)
        assert list(ck.read_raw(f"{name}.weight_shape")) == [spec.dims.hidden, spec.dims.moe_intermediate]
        assert ck.entry("model.layers.1.self_attn.q_a_proj.weight").dtype == "BF16"
        assert not any(n.endswith("weight_scale_inv") for n in ck.tensors)
    with open_checkpoint(built["deepseek-v3-tiny"]) as ck:
        assert ck.config["model_type"] == "deepseek_v3"
        assert ck.config["quantization_config"]["weight_block_size"] == [128, 128]
        # MoE intermediate 192: partial edge tiles
        assert tuple(ck.entry("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv").shape) == (2, 2)
    with open_checkpoint(built["nvfp4-tiny"]) as ck:
        assert ck.config["quantization_config"]["format"] == "nvfp4-pack-quantized"
        e = ck.entry("model.layers.2.mlp.experts.7.gate_proj.weight_scale")
        assert e.dtype == "F8_E4M3" and tuple(e.shape) == (192, 256 // 16)
        assert tuple(ck.entry("model.layers.2.mlp.experts.7.gate_proj.weight_global_scale").shape) == (1,)


def _parts(ck, fmt, base: str) -> dict[str, np.ndarray]:
    out = {}
    for role, tensor in fmt.tensor_names(base).items():
        e = ck.entry(tensor)
        raw = ck.read_raw(tensor)
        out[role] = np.asarray(raw).view(np.dtype(lookup(e.dtype).storage)).reshape(e.shape)
    return out


@pytest.mark.parametrize("name", sorted(SOURCE_FIXTURES))
def test_quantized_weights_decode_close_to_their_source_values(built, name):
    spec = SOURCE_FIXTURES[name]
    fmt = get_format(STORAGE[name])
    keys = [k for k, storage, _ in spec.groups() if storage == STORAGE[name] and ".experts." in k][:4]
    assert keys
    with open_checkpoint(built[name]) as ck:
        for key in keys:
            base = key[: -len(".weight")]
            parts = _parts(ck, fmt, base)
            y = fmt.decode(parts, name=key)
            assert np.array_equal(y, fmt.reference_decode(parts, name=key))
            x = original_values(spec, key)
            assert y.shape == x.shape
            err = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
            # FP8 keeps 3 mantissa bits; 4-bit formats about 10% relative RMS on heavy-tailed values
            assert err < (0.05 if name == "deepseek-v3-tiny" else 0.2), (key, err)


def _digest(path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.glob("*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()


def test_same_seed_same_bytes(tmp_path):
    a = make_source_fixture("nvfp4-tiny", tmp_path / "a", layers=2, experts=2)
    b = make_source_fixture("nvfp4-tiny", tmp_path / "b", layers=2, experts=2)
    c = make_source_fixture("nvfp4-tiny", tmp_path / "c", layers=2, experts=2, seed=1)
    assert _digest(a) == _digest(b) != _digest(c)
    with pytest.raises(OutputExistsError):
        make_source_fixture("nvfp4-tiny", tmp_path / "a", layers=2, experts=2)
    make_source_fixture("nvfp4-tiny", tmp_path / "a", layers=2, experts=2, overwrite=True)
    assert _digest(a) == _digest(b)


def test_spec_options_and_errors():
    s = source_fixture("kimi-k2-thinking-tiny", layers=4, experts=3)
    assert (s.layers, s.experts, s.dims.top_k) == (4, 3, 2)
    assert sum(1 for _, st, _ in s.groups() if st == "int4-pack-quantized") == 3 * 3 * 3
    with pytest.raises(NotFoundError, match="deepseek-v3-tiny"):
        source_fixture("nope")
    with pytest.raises(UsageError, match="no dimension"):
        source_fixture("nvfp4-tiny", widht=3)
    with pytest.raises(UsageError, match="multiple of 32"):
        source_fixture("kimi-k2-thinking-tiny", moe_intermediate=200)
    assert source_fixture("deepseek-v3-tiny", moe_intermediate=200).dims.moe_intermediate == 200
    with pytest.raises(NotFoundError):
        original_values(SOURCE_FIXTURES["nvfp4-tiny"], "model.norm.weight")
