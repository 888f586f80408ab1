"""The deepseek2 GGUF plan of the tiny Kimi K2 (block FP8) against llama.cpp's converter output.

tests/golden/gguf/kimi-k2-tiny.converter.json was made as the K3 one was (tests/test_gguf_kimi_k3.py):
the llama-cpp-python 0.3.36 converter, `--outtype bf16`, on `k3ckpt fixture kimi-k2-tiny`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from k3ckpt.errors import UnsupportedError
from k3ckpt.gguf import deepseek2
from k3ckpt.gguf.convert import write_gguf
from k3ckpt.gguf.tensors import BF16, IQ2_XS
from k3ckpt.io.reader import open_checkpoint

GOLDEN = json.loads((Path(__file__).parent / "golden" / "gguf" / "kimi-k2-tiny.converter.json").read_text())


def _source(ckpt):
    return {n: (e.dtype, tuple(e.shape)) for n, e in ckpt.tensors.items()}


def test_tensors_and_metadata_match_the_converter(kimi_k2_tiny):
    with open_checkpoint(kimi_k2_tiny) as ckpt:
        planned, skipped = deepseek2.plan_tensors(_source(ckpt), ckpt.config, expert_type=BF16)
        kvs = {kv.key: kv for kv in deepseek2.metadata(ckpt.config, file_type=32)}   # MOSTLY_BF16
    ours = sorted([p.info.name, gguf.GGMLQuantizationType(p.info.ggml_type).name, list(p.info.shape)]
                  for p in planned)
    assert ours == sorted(GOLDEN["tensors"]) and skipped == []
    want = {k: v for k, v in GOLDEN["kv"].items() if not k.startswith("tokenizer.")}
    assert sorted(kvs) == sorted(want)
    for key, w in want.items():
        kv = kvs[key]
        assert [kv.kind] == w["types"], key
        assert kv.value == (pytest.approx(w["value"], rel=1e-7) if kv.kind == 6 else w["value"]), key


def test_fp8_weights_decode_once_to_bf16(kimi_k2_tiny, tmp_path):
    """An FP8 weight's BF16 bytes are our FP8 decoder's float32 product, rounded to nearest even."""
    from k3ckpt.formats.fp8_block import decode_fp8_block_ref

    with open_checkpoint(kimi_k2_tiny) as ckpt:
        res = write_gguf(ckpt, tmp_path / "k2.gguf", expert_type="bf16")
        ts = {t.name: t for t in gguf.GGUFReader(res.paths[0]).tensors}
        name = "model.layers.1.mlp.shared_experts.down_proj.weight"
        x = decode_fp8_block_ref(ckpt.read_raw(name), ckpt.read_raw(name + "_scale_inv"))
        want = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
        assert bytes(np.asarray(ts["blk.1.ffn_down_shexp.weight"].data).view(np.uint8).reshape(-1)) == want.tobytes()
        e = "model.layers.2.mlp.experts.5.up_proj.weight"
        x = decode_fp8_block_ref(ckpt.read_raw(e), ckpt.read_raw(e + "_scale_inv"))
        exps = np.asarray(ts["blk.2.ffn_up_exps.weight"].data).view(np.uint16)
        assert exps[5].tobytes() == gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16).tobytes()


def test_iq2_xs_experts_from_fp8(kimi_k2_tiny, tmp_path):
    """FP8 experts are decoded and encoded by our IQ2_XS encoder; the tiny K2's down projection
    (rows of 192) cannot hold 256-blocks, which is refused before anything is written."""
    from k3ckpt.errors import ShapeError
    from k3ckpt.formats import get_format
    from k3ckpt.formats.fp8_block import decode_fp8_block
    from k3ckpt.gguf import container as C
    from k3ckpt.gguf.produce import tensor_pieces
    from k3ckpt.gguf.tensors import IQ2_XS, Planned, Recipe

    with open_checkpoint(kimi_k2_tiny) as ckpt:
        with pytest.raises(ShapeError, match="ffn_down_exps.weight: rows of 192 values do not split into iq2_xs "
                           "blocks of 256; types that fit: bf16, f16, f32, mxfp4, q8_0"):
            write_gguf(ckpt, tmp_path / "k2.gguf", expert_type="iq2_xs")
        assert list(tmp_path.iterdir()) == []
        names = [f"model.layers.1.mlp.experts.{i}.gate_proj.weight" for i in range(8)]
        srcs = tuple(s for n in names for s in (n, n + "_scale_inv"))
        p = Planned(C.TensorInfo("blk.1.ffn_gate_exps.weight", IQ2_XS, (8, 192, 256)),
                    Recipe("experts", srcs, 8), "F8_BLOCK", 1)
        pieces = list(tensor_pieces(ckpt, p))
        x = decode_fp8_block(ckpt.read_raw(names[3]), ckpt.read_raw(names[3] + "_scale_inv"))
        assert pieces[3] == get_format("gguf-iq2_xs").encode(x)["packed"].tobytes()
        assert sum(map(len, pieces)) == p.info.nbytes


def test_int4_experts_decode_exactly_and_encode(kimi_k2_thinking_tiny, tmp_path):
    """K2-Thinking's pack-quantized INT4 experts: BF16 experts are the exact float32 products rounded
    (what the converter's dequant_packed gives), the routed experts are the only INT4 tensors, and
    IQ2_XS experts are our encoder's bytes of those values, with the error measured against them."""
    from k3ckpt.formats import get_format
    from k3ckpt.formats.int4_pack import decode_int4_ref
    from k3ckpt.gguf.produce import expert_piece

    with open_checkpoint(kimi_k2_thinking_tiny) as ckpt:
        planned, _ = deepseek2.plan_tensors(_source(ckpt), ckpt.config, expert_type=BF16)
        int4 = sorted({p.info.name.split(".", 2)[2] for p in planned if p.source_dtype == "INT4_PACK"})
        assert int4 == ["ffn_down_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight"]
        res = write_gguf(ckpt, tmp_path / "k2t.gguf", expert_type="bf16")
        ts = {t.name: t for t in gguf.GGUFReader(res.paths[0]).tensors}
        base = "model.layers.2.mlp.experts.6.up_proj.weight"
        x = decode_int4_ref(ckpt.read_raw(base + "_packed"), ckpt.read_raw(base + "_scale"))
        exps = np.asarray(ts["blk.2.ffn_up_exps.weight"].data).view(np.uint16)
        assert exps[6].tobytes() == gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16).tobytes()

        gate = next(p for p in planned if p.info.name == "blk.1.ffn_gate_exps.weight")
        gate = dataclasses.replace(gate, info=dataclasses.replace(gate.info, ggml_type=IQ2_XS))
        piece = expert_piece(ckpt, gate, 3, measure=True)
        base = "model.layers.1.mlp.experts.3.gate_proj.weight"
        x = decode_int4_ref(ckpt.read_raw(base + "_packed"), ckpt.read_raw(base + "_scale"))
        packed = get_format("gguf-iq2_xs").encode(x)["packed"]
        assert piece.data == packed.tobytes()
        from k3ckpt.formats.iq2xs import decode_iq2xs_ref
        from k3ckpt.requant.metrics import error_stats_reference

        assert piece.result.stats.snr_db == pytest.approx(error_stats_reference(x, decode_iq2xs_ref(packed)).snr_db,
                                                   rel=1e-12)
        assert 3.0 < piece.result.stats.snr_db < 20.0
        r = piece.result
        assert (r.name, r.layer, r.expert, r.projection, r.format, r.bytes, r.params) == \
            (base, 1, 3, "gate", "gguf-iq2_xs", len(piece.data), x.size)


def test_int4_layouts_it_cannot_decode_are_refused(kimi_k2_thinking_tiny):
    with open_checkpoint(kimi_k2_thinking_tiny) as ckpt:
        src, cfg = _source(ckpt), json.loads(json.dumps(ckpt.config))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    with pytest.raises(UnsupportedError, match="symmetric 4-bit INT4 in groups of 32.*group 128"):
        deepseek2.plan_tensors(src, cfg, expert_type=BF16)
    cfg["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(UnsupportedError, match="from 'awq'"):
        deepseek2.plan_tensors(src, cfg, expert_type=BF16)
    lone = {n: v for n, v in src.items() if n != "model.layers.1.mlp.experts.0.up_proj.weight_scale"}
    with pytest.raises(UnsupportedError, match="INT4 without model.layers.1.mlp.experts.0.up_proj.weight_scale"):
        deepseek2.plan_tensors(lone, ckpt.config, expert_type=BF16)


def test_mtp_layers_and_unknown_tensors(kimi_k2_tiny):
    with open_checkpoint(kimi_k2_tiny) as ckpt:
        src, cfg = _source(ckpt), ckpt.config
    mtp = {n.replace("layers.2.", "layers.3."): v for n, v in src.items() if ".layers.2." in n}
    planned, skipped = deepseek2.plan_tensors({**src, **mtp}, cfg, expert_type=BF16)
    assert len(planned) == len(GOLDEN["tensors"]) and len(skipped) == len(mtp)
    with pytest.raises(UnsupportedError, match="no deepseek2 GGUF name"):
        deepseek2.plan_tensors({**src, "model.layers.1.mlp.mystery.weight": ("BF16", (4, 4))}, cfg,
                               expert_type=BF16)
    lone = {n: v for n, v in src.items() if n != "model.layers.1.self_attn.o_proj.weight_scale_inv"}
    with pytest.raises(UnsupportedError, match="F8_E4M3 without"):
        deepseek2.plan_tensors(lone, cfg, expert_type=BF16)
