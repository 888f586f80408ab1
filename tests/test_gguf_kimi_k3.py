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
from k3ckpt.gguf.tensors import MXFP4
from k3ckpt.io.reader import open_checkpoint

GOLDEN = json.loads((Path(__file__).parent / "golden" / "gguf" / "k3-tiny.converter.json").read_text())


def _source(ckpt):
    return {n: (e.dtype, tuple(e.shape)) for n, e in ckpt.tensors.items()}


@pytest.fixture(scope="module")
def k3_plan(k3_tiny):
    ckpt = open_checkpoint(k3_tiny)
    text = ckpt.config["text_config"]
    planned, skipped = kimi_k3.plan_tensors(_source(ckpt), text, expert_type=MXFP4)
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
                             text, expert_type=MXFP4)
    gone = {n: v for n, v in src.items() if ".experts.5.w2." not in n}
    with pytest.raises(UnsupportedError, match="1 of 8 routed experts missing, first is 5"):
        kimi_k3.plan_tensors(gone, text, expert_type=MXFP4)
    with pytest.raises(UnsupportedError, match="situ"):
        kimi_k3.metadata({**text, "hidden_act": "silu"}, file_type=38)


# ------------------------------------------------------------ whole files
def _read(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


def _raw(t) -> bytes:
    import numpy as np

    return bytes(np.asarray(t.data).reshape(-1).view(np.uint8))


@pytest.fixture(scope="module")
def mxfp4_file(k3_tiny, tmp_path_factory):
    from k3ckpt.gguf.convert import write_gguf

    ckpt = open_checkpoint(k3_tiny)
    out = tmp_path_factory.mktemp("gguf") / "k3-tiny-MXFP4.gguf"
    return ckpt, write_gguf(ckpt, out, expert_type="mxfp4")


def test_file_has_the_converters_tensors_and_metadata(mxfp4_file):
    _, res = mxfp4_file
    r, ts = _read(res.paths[0])
    got = sorted([n, gguf.GGMLQuantizationType(t.tensor_type).name, [int(d) for d in t.shape][::-1]]
                 for n, t in ts.items())
    assert got == sorted(GOLDEN["tensors"])
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    for key, w in GOLDEN["kv"].items():
        assert [int(x) for x in r.fields[key].types] == w["types"], key
        if isinstance(w["value"], dict):
            assert len(fields[key]) == w["value"]["len"], key
        elif isinstance(w["value"], float):
            assert fields[key] == pytest.approx(w["value"], rel=1e-7), key
        else:
            assert fields[key] == w["value"], key


def test_bf16_tensors_keep_their_bytes_and_experts_decode_to_the_source(mxfp4_file):
    import numpy as np

    from k3ckpt.formats.mxfp4 import decode_pair_ref

    ckpt, res = mxfp4_file
    _, ts = _read(res.paths[0])
    src = "language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight"
    assert _raw(ts["blk.1.ffn_down_shexp.weight"]) == ckpt.read_bytes(src)
    # gguf-py's own MXFP4 dequantizer (independent of ours) gives our reference decode of the source
    exps = gguf.quants.dequantize(np.asarray(ts["blk.2.ffn_down_exps.weight"].data), gguf.GGMLQuantizationType.MXFP4)
    for e in (0, 7):
        base = f"language_model.model.layers.2.block_sparse_moe.experts.{e}.w2."
        want = decode_pair_ref(ckpt.read_raw(base + "weight_packed"), ckpt.read_raw(base + "weight_scale"))
        np.testing.assert_array_equal(exps[e], want)
    # res fusion and -exp(A_log), against a plain recomputation
    norm = ckpt.read_raw("language_model.model.layers.0.mlp_res_norm.weight").astype(np.uint32) << 16
    proj = ckpt.read_raw("language_model.model.layers.0.mlp_res_proj.weight").astype(np.uint32) << 16
    fused = np.asarray(ts["blk.0.ffn_res_score.weight"].data)
    np.testing.assert_array_equal(fused, norm.view(np.float32) * proj.view(np.float32).reshape(-1))
    a_log = ckpt.read_raw("language_model.model.layers.0.self_attn.A_log")
    np.testing.assert_array_equal(np.asarray(ts["blk.0.ssm_a"].data),
                                  (-np.exp(a_log[:2].astype(np.float64))).astype(np.float32))


def test_kv_b_split_matches_a_per_head_reshape(mxfp4_file):
    import numpy as np

    ckpt, res = mxfp4_file
    _, ts = _read(res.paths[0])
    kv_b = ckpt.read_raw("language_model.model.layers.3.self_attn.kv_b_proj.weight").reshape(2, 64, 32)
    k_b = np.asarray(ts["blk.3.attn_k_b.weight"].data).view(np.uint16).reshape(2, 32, 32)
    v_b = np.asarray(ts["blk.3.attn_v_b.weight"].data).view(np.uint16).reshape(2, 32, 32)
    np.testing.assert_array_equal(k_b, kv_b[:, :32, :].transpose(0, 2, 1))
    np.testing.assert_array_equal(v_b, kv_b[:, 32:, :])


def test_iq2_xs_experts_split_files(k3_tiny, tmp_path):
    import numpy as np

    from k3ckpt.formats import get_format
    from k3ckpt.gguf.convert import write_gguf

    ckpt = open_checkpoint(k3_tiny)
    res = write_gguf(ckpt, tmp_path / "k3.gguf", expert_type="IQ2_XS", split_max_bytes=1_000_000)
    assert len(res.paths) > 1 and res.paths[0].name == f"k3-00001-of-{len(res.paths):05d}.gguf"
    seen = {}
    for p in res.paths:
        seen.update(_read(p)[1])
    t = seen["blk.1.ffn_up_exps.weight"]
    assert gguf.GGMLQuantizationType(t.tensor_type).name == "IQ2_XS"
    base = "language_model.model.layers.1.block_sparse_moe.experts.3.w3."
    ours = get_format("gguf-iq2_xs").from_mxfp4(ckpt.read_raw(base + "weight_packed"),
                                                 ckpt.read_raw(base + "weight_scale"))["packed"]
    per = ours.nbytes
    assert _raw(t)[3 * per:4 * per] == ours.tobytes()
    assert res.bytes_by_type["IQ2_XS"] == 9 * 8 * per
    assert sorted(seen) == sorted(n for n, _, _ in GOLDEN["tensors"])


def test_tensors_copied_in_row_chunks_give_the_same_file(k3_tiny, tmp_path, monkeypatch, mxfp4_file):
    from k3ckpt.gguf import produce
    from k3ckpt.gguf.convert import write_gguf

    monkeypatch.setattr(produce, "CHUNK_BYTES", 1000)       # many chunks per tensor, rows cut unevenly
    res = write_gguf(open_checkpoint(k3_tiny), tmp_path / "chunked.gguf", expert_type="mxfp4")
    assert res.paths[0].read_bytes() == mxfp4_file[1].paths[0].read_bytes()
