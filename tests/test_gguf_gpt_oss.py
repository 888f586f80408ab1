"""The gpt-oss GGUF layout of the tiny gpt-oss against what llama.cpp's own converter wrote for it.

tests/golden/gguf/gpt-oss-tiny.converter.json was made by running the converter of the
llama-cpp-python 0.3.36 sdist (`convert_hf_to_gguf.py --outtype bf16`, unmodified except that
its pre-tokenizer check returns "gpt-4o": it names the pre-tokenizer by hashing the token ids
of a probe text, which only the real o200k vocabulary gives) on `k3ckpt fixture gpt-oss-tiny`,
and reading the file back with gguf-py: the tensors (name, ggml type, numpy shape) and the
metadata (`general.name`, `size_label`, `type`, `sampling.*` aside), long arrays as their length
and the sha256 of their JSON. tests/test_gguf_llama_cpp.py reruns the converter and llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from k3ckpt.errors import ShapeError, UnsupportedError
from k3ckpt.gguf import container as C
from k3ckpt.gguf import gpt_oss
from k3ckpt.gguf.convert import write_gguf
from k3ckpt.gguf.tensors import MXFP4, row_fits
from k3ckpt.gguf.vocab import tokenizer_metadata
from k3ckpt.io.reader import open_checkpoint

GOLDEN = json.loads((Path(__file__).parent / "golden" / "gguf" / "gpt-oss-tiny.converter.json").read_text())
Q8_0, IQ2_XS = int(gguf.GGMLQuantizationType.Q8_0), int(gguf.GGMLQuantizationType.IQ2_XS)


def _source(ckpt):
    return {n: (e.dtype, tuple(e.shape)) for n, e in ckpt.tensors.items()}


@pytest.fixture(scope="module")
def ckpt(gpt_oss_tiny):
    with open_checkpoint(gpt_oss_tiny) as ck:
        yield ck


def _kv_types(kv: C.KV):
    return [kv.kind] if kv.kind != C.ARRAY else [kv.kind, kv.item_kind]


def _kv_value(kv: C.KV):
    if kv.kind == C.ARRAY and (kv.item_kind == C.STRING or len(kv.value) > 64):
        blob = json.dumps(list(kv.value), ensure_ascii=False).encode()
        return {"len": len(kv.value), "sha256": hashlib.sha256(blob).hexdigest()}
    return kv.value


def _assert_kvs(kvs: list[C.KV], want: dict):
    ours = {kv.key: kv for kv in kvs}
    assert sorted(ours) == sorted(want)
    for key, w in want.items():
        kv = ours[key]
        assert _kv_types(kv) == w["types"], key
        if kv.kind == C.FLOAT32:
            assert kv.value == pytest.approx(w["value"], rel=1e-7), key
        else:
            assert _kv_value(kv) == w["value"], key


def test_tensors_match_the_converter(ckpt):
    planned, skipped = gpt_oss.plan_tensors(_source(ckpt), ckpt.config, expert_type=MXFP4)
    ours = sorted([p.info.name, gguf.GGMLQuantizationType(p.info.ggml_type).name, list(p.info.shape)]
                  for p in planned)
    assert ours == sorted(GOLDEN["tensors"]) and skipped == []
    names = [p.info.name for p in planned]
    assert names[0] == "token_embd.weight" and set(names[-2:]) == {"output.weight", "output_norm.weight"}


def test_metadata_matches_the_converter(ckpt):
    _assert_kvs(gpt_oss.metadata(ckpt.config, file_type=38),      # 38: MOSTLY_MXFP4_MOE
                {k: v for k, v in GOLDEN["kv"].items() if not k.startswith("tokenizer.")})


def test_vocabulary_matches_the_converter(gpt_oss_tiny, ckpt):
    kvs = tokenizer_metadata(gpt_oss_tiny, ckpt.config["vocab_size"])
    _assert_kvs(kvs, {k: v for k, v in GOLDEN["kv"].items() if k.startswith("tokenizer.")})
    kv = {k.key: k.value for k in kvs}
    types = kv["tokenizer.ggml.token_type"]
    # bytes and merges NORMAL, 16 specials CONTROL, <think> USER_DEFINED, the unnamed ids UNUSED
    assert [types.count(t) for t in (1, 3, 4, 5)] == [480, 16, 1, 15]
    assert kv["tokenizer.ggml.tokens"][496] == "<think>" and kv["tokenizer.ggml.tokens"][511] == "[PAD511]"


def test_real_gpt_oss_config_keys_give_the_same_metadata(ckpt):
    """openai/gpt-oss's config.json spells out what the fixture leaves to GptOssConfig's defaults."""
    real = {**ckpt.config, "max_position_embeddings": 131072, "initial_context_length": 4096, "swiglu_limit": 7.0,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
            "rope_theta": 150000, "hidden_act": "silu", "attention_bias": True}
    assert gpt_oss.metadata(real, file_type=38) == gpt_oss.metadata(ckpt.config, file_type=38)
    plain = gpt_oss.metadata({**real, "rope_scaling": {"rope_type": "default"}}, file_type=38)
    assert not any(".rope.scaling." in kv.key for kv in plain)


@pytest.fixture(scope="module")
def mxfp4_file(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "gpt-oss-tiny-MXFP4.gguf"
    return write_gguf(ckpt, out, expert_type="mxfp4").paths[0]


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_file_holds_the_converters_tensors(mxfp4_file):
    got = sorted([n, gguf.GGMLQuantizationType(t.tensor_type).name, [int(d) for d in t.shape][::-1]]
                 for n, t in _tensors(mxfp4_file).items())
    assert got == sorted(GOLDEN["tensors"])
    general = gguf.GGUFReader(mxfp4_file).fields
    assert general["general.architecture"].contents() == "gpt-oss"
    assert general["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_MXFP4_MOE


def test_experts_and_biases_are_the_sources_gate_and_up_halves(ckpt, mxfp4_file):
    """gguf-py's own MXFP4 dequantizer (independent of ours) on our file gives the source's even rows
    (gate) and odd rows (up) of gate_up_proj, and all of down_proj; biases split the same way."""
    from k3ckpt.formats.gptoss import blocks_to_packed
    from k3ckpt.formats.mxfp4 import decode_pair_ref

    ts = _tensors(mxfp4_file)
    x = "model.layers.1.mlp.experts."
    for proj, gguf_name, rows in (("gate_up_proj", "ffn_gate_exps", slice(0, None, 2)),
                                  ("gate_up_proj", "ffn_up_exps", slice(1, None, 2)),
                                  ("down_proj", "ffn_down_exps", slice(None))):
        blocks, scales = ckpt.read_raw(x + proj + "_blocks"), ckpt.read_raw(x + proj + "_scales")
        want = decode_pair_ref(blocks_to_packed(blocks[:, rows]), scales[:, rows])
        got = gguf.quants.dequantize(np.asarray(ts[f"blk.1.{gguf_name}.weight"].data), gguf.GGMLQuantizationType.MXFP4)
        assert got.shape == want.shape == (4, 160, 160)
        np.testing.assert_array_equal(got, want)
        bias = (ckpt.read_raw(x + proj + "_bias").astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(np.asarray(ts[f"blk.1.{gguf_name}.bias"].data), bias[:, rows])
    assert ts["blk.1.attn_q.weight"].data.tobytes() == ckpt.read_bytes("model.layers.1.self_attn.q_proj.weight")
    sinks = (ckpt.read_raw("model.layers.0.self_attn.sinks").astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(np.asarray(ts["blk.0.attn_sinks.weight"].data), sinks)


def test_q8_0_experts_are_the_gguf_quantizer_on_the_decoded_codes(ckpt, tmp_path):
    from k3ckpt.formats.gptoss import blocks_to_packed
    from k3ckpt.formats.mxfp4 import decode_pair_ref

    assert row_fits(Q8_0, 160) and row_fits(MXFP4, 160) and not row_fits(IQ2_XS, 160)
    ts = _tensors(write_gguf(ckpt, tmp_path / "q8.gguf", expert_type="q8_0").paths[0])
    t = ts["blk.0.ffn_up_exps.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    x = "model.layers.0.mlp.experts.gate_up_proj"
    up = decode_pair_ref(blocks_to_packed(ckpt.read_raw(x + "_blocks")[:, 1::2]), ckpt.read_raw(x + "_scales")[:, 1::2])
    assert t.data.tobytes() == gguf.quants.quantize(up, gguf.GGMLQuantizationType.Q8_0).tobytes()


def test_iq2_xs_is_refused_before_anything_is_written(ckpt, tmp_path):
    """gpt-oss's rows (2880 in the real model, 160 here) hold 32-blocks, not IQ2_XS's 256."""
    with pytest.raises(ShapeError) as err:
        write_gguf(ckpt, tmp_path / "x.gguf", expert_type="iq2_xs")
    line = str(err.value)
    assert "\n" not in line and "ffn_" in line and "_exps.weight" in line
    assert "rows of 160 values" in line and "mxfp4" in line and "q8_0" in line
    assert list(tmp_path.iterdir()) == []


def test_what_llama_cpp_would_run_differently_is_refused(ckpt):
    src, cfg = _source(ckpt), ckpt.config
    with pytest.raises(UnsupportedError, match="no gpt-oss GGUF name"):
        gpt_oss.plan_tensors({**src, "model.layers.0.mlp.mystery.weight": ("BF16", (4, 4))}, cfg, expert_type=MXFP4)
    bf16 = {n: v for n, v in src.items() if not n.startswith("model.layers.1.mlp.experts.down_proj_")}
    bf16["model.layers.1.mlp.experts.down_proj"] = ("BF16", (4, 160, 160))
    bf16["model.layers.1.mlp.experts.down_proj_bias"] = src["model.layers.1.mlp.experts.down_proj_bias"]
    with pytest.raises(UnsupportedError, match="BF16 gpt-oss experts are not mapped"):
        gpt_oss.plan_tensors(bf16, cfg, expert_type=MXFP4)
    with pytest.raises(UnsupportedError, match="4 experts, config.json says 8"):
        gpt_oss.plan_tensors(src, {**cfg, "num_local_experts": 8}, expert_type=MXFP4)
    with pytest.raises(UnsupportedError, match="swiglu_limit 7.0"):
        gpt_oss.metadata({**cfg, "swiglu_limit": 10.0}, file_type=38)
    with pytest.raises(UnsupportedError, match="sliding-window attention on even layers"):
        gpt_oss.metadata({**cfg, "layer_types": ["full_attention", "sliding_attention"]}, file_type=38)


def test_vocabulary_needs_a_tokenizer_file(gpt_oss_tiny, tmp_path):
    import shutil

    d = tmp_path / "bare"
    d.mkdir()
    with pytest.raises(UnsupportedError, match="no tiktoken.model or tokenizer.json"):
        tokenizer_metadata(d, 512)
    shutil.copy(Path(gpt_oss_tiny) / "tokenizer.json", d / "tokenizer.json")
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(UnsupportedError, match="pre-tokenizer is not one k3ckpt names for llama.cpp"):
        tokenizer_metadata(d, 512)


def test_fixture_tokenizer_is_one_the_tokenizers_library_reads(gpt_oss_tiny, ckpt):
    tokenizers = pytest.importorskip("tokenizers")
    from k3ckpt.fixtures.tokenizer import special_ids

    tok = tokenizers.Tokenizer.from_file(str(Path(gpt_oss_tiny) / "tokenizer.json"))
    text = "The experts of the model are stored in blocks.<|start|>user<|message|>Hi 2025!<|end|><think>"
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert len(enc.ids) < len(text.encode()) / 2          # the merges do merge
    ids = special_ids(ckpt.config["vocab_size"])
    assert tok.token_to_id("<|return|>") == ids["eos"] == ckpt.config["eos_token_id"]
    assert tok.token_to_id("<|endoftext|>") == ids["pad"] == ckpt.config["pad_token_id"]


def test_worker_processes_give_the_same_file(ckpt, mxfp4_file, tmp_path):
    """Each expert is cut out of the fused tensors for a worker (``pool.one_expert``), reading that
    expert's rows only; the file is the one a single process writes."""
    from k3ckpt.gguf.pool import one_expert

    two = write_gguf(ckpt, tmp_path / "w2.gguf", expert_type="mxfp4", workers=2).paths[0]
    assert two.read_bytes() == mxfp4_file.read_bytes()
    planned, _ = gpt_oss.plan_tensors(_source(ckpt), ckpt.config, expert_type=MXFP4)
    up = next(p for p in planned if p.info.name == "blk.1.ffn_up_exps.weight")
    r = one_expert(up, 3).recipe
    assert (r.arg, r.first, r.rows) == (1, 3, "odd")
