"""gpt-oss blocks/scales layout and the gate/up row interleave."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from k3ckpt.errors import ShapeError
from k3ckpt.formats import get_format, gptoss, mxfp4

GOLDEN = json.loads((Path(__file__).parent / "golden" / "mxfp4_vectors.json").read_text())
FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def gpt_oss_style_decode(blocks, scales):
    """Written from the published gpt-oss decode: low nibble -> element 2i, high ->
    2i+1, LUT value times 2^(scale - 127) via ldexp (no 0xFF handling there)."""
    lut = np.array(FP4_VALUES, np.float64)
    lo = lut[blocks & 0x0F]
    hi = lut[blocks >> 4]
    out = np.stack([lo, hi], axis=-1).reshape(blocks.shape[:-1] + (32,))
    out = np.ldexp(out, scales.astype(np.int64)[..., None] - 127)
    return out.reshape(blocks.shape[:-2] + (blocks.shape[-2] * 32,)).astype(np.float32)


def test_decode_matches_gpt_oss_rule():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 6, 90, 16), dtype=np.uint8)  # [E, 2I, H/32, 16], H = 2880
    scales = rng.integers(0x70, 0x80, (2, 6, 90), dtype=np.uint8)
    fmt = get_format("gpt-oss-mxfp4")
    parts = {"blocks": blocks, "scales": scales}
    got = fmt.decode(parts)
    assert got.shape == (2, 6, 2880)
    want = gpt_oss_style_decode(blocks, scales)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(fmt.reference_decode(parts).view(np.uint32), want.view(np.uint32))


def test_same_bytes_as_pair_layout():
    rng = np.random.default_rng(1)
    x = (rng.standard_t(4, (3, 8, 2880)) * 0.02).astype(np.float32)
    g = get_format("gpt-oss-mxfp4").encode(x)
    p = get_format("mxfp4-pack-quantized").encode(x)
    assert g["blocks"].shape == (3, 8, 90, 16) and g["scales"].shape == (3, 8, 90)
    assert np.array_equal(gptoss.blocks_to_packed(g["blocks"]), p["packed"])
    assert np.array_equal(gptoss.packed_to_blocks(p["packed"]), g["blocks"])
    assert np.array_equal(g["scales"], p["scale"])
    gr = get_format("gpt-oss-mxfp4").reference_encode(x)
    assert all(np.array_equal(gr[k], g[k]) for k in g)


@pytest.mark.parametrize("vec", GOLDEN["vectors"], ids=lambda v: v["name"])
def test_golden_gpt_oss(vec):
    fmt = get_format("gpt-oss-mxfp4")
    x = np.array(vec["input"] + [0.0] * vec["zeros_after"], np.float32)[None]
    want = vec["layouts"]["gpt-oss-mxfp4"]
    parts = fmt.encode(x)
    assert parts["blocks"].tobytes() == bytes.fromhex(want["blocks"])
    assert parts["scales"].tobytes() == bytes.fromhex(want["scales"])
    blocks = np.frombuffer(bytes.fromhex(want["blocks"]), np.uint8).reshape(1, 1, 16)
    scales = np.frombuffer(bytes.fromhex(want["scales"]), np.uint8).reshape(1, 1)
    dec = fmt.decode({"blocks": blocks, "scales": scales})
    if int(want["scales"], 16) < 0xFD:
        assert np.array_equal(dec.view(np.uint32), gpt_oss_style_decode(blocks, scales).view(np.uint32))


def test_split_and_interleave_gate_up():
    rng = np.random.default_rng(2)
    decoded = rng.standard_normal((4, 10, 64)).astype(np.float32)  # [E, 2I, H]
    gate, up = gptoss.split_gate_up(decoded)
    assert gate.shape == up.shape == (4, 5, 64)
    assert np.array_equal(gate[:, 1], decoded[:, 2]) and np.array_equal(up[:, 1], decoded[:, 3])
    assert np.array_equal(gptoss.interleave_gate_up(gate, up), decoded)
    # blocks: row axis is -3; bias: -1; splitting stored bytes commutes with decoding
    x = rng.standard_normal((2, 6, 64)).astype(np.float32)
    fmt = get_format("gpt-oss-mxfp4")
    parts = fmt.encode(x)
    gb, ub = gptoss.split_gate_up(parts["blocks"], axis=-3)
    gs, us = gptoss.split_gate_up(parts["scales"], axis=-2)
    gd, ud = gptoss.split_gate_up(fmt.decode(parts))
    assert np.array_equal(fmt.decode({"blocks": gb, "scales": gs}), gd)
    assert np.array_equal(fmt.decode({"blocks": ub, "scales": us}), ud)
    bias = np.arange(12, dtype=np.float32).reshape(2, 6)
    gbias, ubias = gptoss.split_gate_up(bias, axis=-1)
    assert gbias.tolist() == [[0, 2, 4], [6, 8, 10]] and ubias.tolist() == [[1, 3, 5], [7, 9, 11]]
    assert np.array_equal(gptoss.interleave_gate_up(gbias, ubias, axis=-1), bias)


def test_gate_up_errors():
    with pytest.raises(ShapeError):
        gptoss.split_gate_up(np.zeros((3, 5)), axis=0)
    with pytest.raises(ShapeError):
        gptoss.split_gate_up(np.zeros((2, 4)), axis=2)
    with pytest.raises(ShapeError):
        gptoss.interleave_gate_up(np.zeros((2, 4)), np.zeros((2, 5)))
    with pytest.raises(ShapeError):
        gptoss.blocks_to_packed(np.zeros((2, 4, 15), np.uint8))
    with pytest.raises(ShapeError):
        gptoss.packed_to_blocks(np.zeros((2, 8), np.uint8))


def test_layout_shape_errors_name_the_tensor():
    fmt = get_format("gpt-oss-mxfp4")
    blocks = np.zeros((2, 4, 3, 16), np.uint8)
    with pytest.raises(ShapeError, match="down_proj"):
        fmt.decode({"blocks": blocks, "scales": np.zeros((2, 4, 2), np.uint8)}, name="down_proj")
    with pytest.raises(ShapeError):
        fmt.decode({"blocks": np.zeros((2, 4, 3, 8), np.uint8), "scales": np.zeros((2, 4, 3), np.uint8)})
    # works on the pair kernels: same result as via mxfp4 directly
    rng = np.random.default_rng(3)
    b = rng.integers(0, 256, (2, 4, 3, 16), dtype=np.uint8)
    s = rng.integers(0, 255, (2, 4, 3), dtype=np.uint8)
    got = fmt.decode({"blocks": b, "scales": s})
    want = mxfp4.decode_pair_ref(gptoss.blocks_to_packed(b), s)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
