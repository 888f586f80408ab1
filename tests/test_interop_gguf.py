"""Interop with the ``gguf`` package (llama.cpp's gguf-py): our MXFP4 in GGUF block order.

tests/test_formats_gguf.py checks the block converter and decoder on random and
golden bytes.  Here whole checkpoints go through a real GGUF file: the experts
our encoder wrote (K3 tiny: compressed-tensors pairs; gpt-oss tiny: fused
blocks), repacked to ``block_mxfp4`` by ``formats.gguf_mxfp4``, written with
``gguf.GGUFWriter``, read back with ``gguf.GGUFReader`` and decoded by
``gguf.quants.dequantize`` equal the values ``k3ckpt dequant`` writes.  ggml
decodes code 8 (-0) as +0, so values are compared (-0 == +0); the bytes read
back decode through our ``gguf-mxfp4`` format bit for bit, sign of zero included.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize

from k3ckpt import api
from k3ckpt.formats import get_format
from k3ckpt.formats.gguf_mxfp4 import pair_to_gguf
from k3ckpt.io import open_checkpoint

MXFP4 = GGMLQuantizationType.MXFP4


def _write_gguf(path, tensors: dict[str, np.ndarray]) -> None:
    w = GGUFWriter(path, arch="k3ckpt-test")
    for name, blocks in tensors.items():
        w.add_tensor(name, blocks, raw_dtype=MXFP4)   # byte shape [rows, K/32 * 17]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _read_gguf(path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """name -> (the stored block bytes, gguf's decoded float32 values)."""
    out = {}
    for t in GGUFReader(path).tensors:
        assert t.tensor_type == MXFP4
        blocks = np.array(t.data, np.uint8)
        out[t.name] = (blocks, gguf_dequantize(blocks, MXFP4))
    return out


def _values_and_bits_agree(ours: np.ndarray, blocks: np.ndarray, theirs: np.ndarray) -> None:
    assert theirs.shape == ours.shape
    np.testing.assert_array_equal(ours, theirs)   # value equality: ggml's +0 for code 8 equals our -0
    again = get_format("gguf-mxfp4").decode({"blocks": blocks})
    np.testing.assert_array_equal(again.view(np.uint32), ours.view(np.uint32))


def test_k3_experts_through_a_gguf_file(k3_tiny, tmp_path):
    result = api.dequant(k3_tiny, tmp_path / "dq", dtype="f32")
    assert result.nan_blocks == {}   # ggml gives numbers where a 0xFF scale is NaN
    blocks = {}
    with open_checkpoint(k3_tiny) as src:
        for packed in (n for n in src.tensors if n.endswith(".weight_packed")):
            base = packed[: -len("_packed")]
            blocks[base] = pair_to_gguf(src.read_raw(packed), src.read_raw(base + "_scale"), name=base)
    assert len(blocks) == len(result.decoded) > 0
    _write_gguf(tmp_path / "k3.gguf", blocks)
    back = _read_gguf(tmp_path / "k3.gguf")
    assert set(back) == set(blocks)
    with open_checkpoint(tmp_path / "dq") as dst:
        negzero = 0
        for name, (stored, theirs) in back.items():
            np.testing.assert_array_equal(stored, blocks[name])
            ours = dst.read_raw(name)
            negzero += int(np.count_nonzero((ours == 0) & np.signbit(ours)))
            _values_and_bits_agree(ours, stored, theirs)
    assert negzero > 0   # the comparison did meet the -0 codes


def test_gpt_oss_experts_through_a_gguf_file(gpt_oss_tiny, tmp_path):
    api.dequant(gpt_oss_tiny, tmp_path / "dq", dtype="f32")
    blocks = {}
    with open_checkpoint(gpt_oss_tiny) as src:
        for name in (n for n in src.tensors if n.endswith("_proj_blocks")):
            stem = name[: -len("_blocks")]
            b = src.read_raw(name)                       # [E, N, K/32, 16], pair order within each 16 bytes
            e, n, g, _ = b.shape
            blocks[stem] = pair_to_gguf(b.reshape(e, n, g * 16), src.read_raw(stem + "_scales")).reshape(e * n, -1)
    assert blocks
    _write_gguf(tmp_path / "gpt-oss.gguf", blocks)
    back = _read_gguf(tmp_path / "gpt-oss.gguf")
    with open_checkpoint(tmp_path / "dq") as dst:
        for stem, (stored, theirs) in back.items():
            layer_experts, proj = stem.rsplit(".", 1)
            experts = {int(k.split(".")[-3]) for k in dst.tensors if k.startswith(layer_experts + ".")}
            fused = theirs.reshape(len(experts), -1, theirs.shape[-1])
            names = ("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)
            for ex in sorted(experts):
                for j, p in enumerate(names):   # gate/up interleaved: even rows gate, odd rows up
                    ours = dst.read_raw(f"{layer_experts}.{ex}.{p}.weight")
                    np.testing.assert_array_equal(ours, fused[ex, j::len(names)])
            ours_all = np.stack([dst.read_raw(f"{layer_experts}.{ex}.{p}.weight")
                                 for ex in sorted(experts) for p in names], 0)
            # re-interleave ours into the fused row order and check the bits of the GGUF bytes
            ours_fused = ours_all.reshape(len(experts), len(names), -1, theirs.shape[-1]).transpose(0, 2, 1, 3)
            _values_and_bits_agree(np.ascontiguousarray(ours_fused).reshape(theirs.shape), stored, theirs)


def test_bf16_output_holds_the_same_values(k3_tiny, tmp_path):
    # MXFP4 is exact in bf16: the bf16 dequant equals gguf's float32 values too
    import ml_dtypes

    api.dequant(k3_tiny, tmp_path / "dq", dtype="bf16")
    with open_checkpoint(k3_tiny) as src, open_checkpoint(tmp_path / "dq") as dst:
        packed = next(n for n in src.tensors if n.endswith("w2.weight_packed"))
        base = packed[: -len("_packed")]
        theirs = gguf_dequantize(pair_to_gguf(src.read_raw(packed), src.read_raw(base + "_scale")), MXFP4)
        ours = dst.read_raw(base).view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(ours, theirs)
