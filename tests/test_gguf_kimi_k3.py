"""The kimi-k3 GGUF plan of the tiny K3 against what llama.cpp's own converter wrote for it.

tests/golden/gguf/k3-tiny.converter.json was made by running the converter of the
llama-cpp-python 0.3.36 sdist (`convert_hf_to_gguf.py --outtype bf16`) on
`k3ckpt fixture k3-tiny`, with its vocabulary set from `tiktoken.model`, and
reading the file back with gguf-py. It records the tensors (name, ggml type,
numpy shape) and the metadata (`general.name`, `size_label`, `sampling.*` aside).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from k3ckpt.errors import UnsupportedError
from k3ckpt.gguf import container as C
from k3ckpt.gguf import kimi_k3
from k3ckpt.io.reader import open_checkpoint

GOLDEN = json.loads((Path(__file__).parent / "golden" / "gguf" / "k3-tiny.converter.json").read_text())


def _source(ckpt):
    return {n: (e.dtype, tuple(e.shape)) for n, e in ckpt.tensors.items()}


@pytest.fixture(scope="module")
def k3_plan(k3_tiny):
    ckpt = open_checkpoint(k3_tiny)
    text = ckpt.config["text_config"]
    planned, skipped = kimi_k3.plan_tensors(_source(ckpt), text, expert_type=kimi_k3.MXFP4)
    return ckpt, text, planned, skipped


def test_tensors_match_the_converter(k3_plan):
    _, _, planned, skipped = k3_plan
    ours = sorted([p.info.name, gguf.GGMLQuantizationType(p.info.ggml_type).name, list(p.info.shape)]
                  for p in planned)
    assert ours == sorted(GOLDEN["tensors"])
    assert skipped and all(s.startswith(("vision_tower.", "mm_projector.")) for s in skipped)


def test_layer_order(k3_plan):
    _, _, planned, _ = k3_plan
    names = [p.info.name for p in planned]
    assert names[0] == "token_embd.weight"
    layers = [p.layer for p in planned if p.layer is not None]
    assert layers == sorted(layers)
    assert set(names[-3:]) == {"output.weight", "output_norm.weight", "output_res_score.weight"}


def _kv_value(kv: C.KV):
    return [kv.kind] if kv.kind != C.ARRAY else [kv.kind, kv.item_kind]


def test_metadata_matches_the_converter(k3_plan):
    _, text, _, _ = k3_plan
    ours = {kv.key: kv for kv in kimi_k3.metadata(text, file_type=38)}   # 38: MOSTLY_MXFP4_MOE
    want = {k: v for k, v in GOLDEN["kv"].items() if not k.startswith("tokenizer.")}
    assert sorted(ours) == sorted(want)
    for key, w in want.items():
        kv = ours[key]
        assert _kv_value(kv) == w["types"], key
        if kv.kind == C.FLOAT32:
            assert kv.value == pytest.approx(w["value"], rel=1e-7), key
        else:
            assert kv.value == w["value"], key


def test_unknown_tensor_and_missing_experts_are_refused(k3_plan):
    ckpt, text, _, _ = k3_plan
    src = _source(ckpt)
    with pytest.raises(UnsupportedError, match="no kimi-k3 GGUF name"):
        kimi_k3.plan_tensors({**src, "language_model.model.layers.1.self_attn.mystery.weight": ("BF16", (4, 4))},
                             text, expert_type=kimi_k3.MXFP4)
    gone = {n: v for n, v in src.items() if ".experts.5.w2." not in n}
    with pytest.raises(UnsupportedError, match="1 of 8 routed experts missing, first is 5"):
        kimi_k3.plan_tensors(gone, text, expert_type=kimi_k3.MXFP4)
    with pytest.raises(UnsupportedError, match="situ"):
        kimi_k3.metadata({**text, "hidden_act": "silu"}, file_type=38)
