"""Interop (issue 6, sec. 3): a BF16 gpt-oss saved by ``transformers``, converted by k3ckpt to MXFP4
in the gpt-oss layout, loads back in ``transformers`` and gives the same logits as the BF16 model
carrying our dequantized expert weights (CPU).

transformers runs MXFP4 natively only with triton kernels on a GPU; on CPU it is loaded with
``Mxfp4Config(dequantize=True)``, which decodes our ``_blocks`` / ``_scales`` with its own code
(``convert_moe_packed_tensors``) -- that decode, the gate/up interleave and the [out, in] ->
[in, out] transpose are what this test checks against ours.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="interop extra not installed: pip install 'k3ckpt[interop]' "
                                            "(torch==2.13.0, transformers, compressed-tensors)")
transformers = pytest.importorskip("transformers", reason="interop extra not installed: pip install "
                                                          "'k3ckpt[interop]' (transformers)")


def _tiny_gpt_oss(path):
    from transformers import GptOssConfig, GptOssForCausalLM

    # hidden 64 and intermediate 96 differ, so a transposed or mis-interleaved expert cannot pass
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64,
                       layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():   # biases are zero-initialised; make them count
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.02)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.02)
    model.save_pretrained(path)
    return model


def test_gpt_oss_bf16_to_mxfp4_loads_in_transformers(tmp_path):
    from transformers import GptOssForCausalLM, Mxfp4Config

    from k3ckpt import api
    from k3ckpt.formats import get_format
    from k3ckpt.io.reader import open_checkpoint

    src, dst = tmp_path / "bf16", tmp_path / "mxfp4"
    _tiny_gpt_oss(src)
    result = api.requant(src, dst, format="mxfp4", layout="gpt-oss", workers=1, progress=False)
    assert len(result.results) == 2 * 2 * 4 and all(r.stats.snr_db > 15 for r in result.results)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4"

    loaded = GptOssForCausalLM.from_pretrained(dst, quantization_config=Mxfp4Config(dequantize=True),
                                               dtype=torch.bfloat16).eval()
    # the reference: the original BF16 model with k3ckpt's own decode of the expert weights
    ref = GptOssForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    fmt = get_format("gpt-oss-mxfp4")
    with open_checkpoint(dst) as out, torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            for p in ("gate_up_proj", "down_proj"):
                stem = f"model.layers.{i}.mlp.experts.{p}"
                w = fmt.decode({"blocks": out.read_raw(stem + "_blocks"), "scales": out.read_raw(stem + "_scales")})
                ours = torch.from_numpy(np.ascontiguousarray(w.transpose(0, 2, 1))).to(torch.bfloat16)
                assert torch.equal(ours.float(), torch.from_numpy(np.ascontiguousarray(w.transpose(0, 2, 1))))
                before = getattr(layer.mlp.experts, p).detach().clone()
                getattr(layer.mlp.experts, p).copy_(ours)
                assert not torch.equal(before, ours)   # the requantization did change something
                # transformers decoded our bytes to the same values
                assert torch.equal(getattr(loaded.model.layers[i].mlp.experts, p), ours), (i, p)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = loaded(input_ids=ids).logits
        b = ref(input_ids=ids).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)
