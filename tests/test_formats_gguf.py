"""GGUF block_mxfp4: converters and decoder, with the gguf package as the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from k3ckpt.errors import ShapeError
from k3ckpt.formats import get_format, gguf_mxfp4, mxfp4

GOLDEN = json.loads((Path(__file__).parent / "golden" / "mxfp4_vectors.json").read_text())
MXFP4 = GGMLQuantizationType.MXFP4


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def same_as_ggml(ours, theirs):
    """Bit-equal except that ggml decodes code 8 (-0) as +0 (its kvalues table has no -0)."""
    nonzero = ours != 0
    return (
        ours.shape == theirs.shape
        and np.array_equal(ours, theirs)
        and np.array_equal(bits(ours)[nonzero], bits(theirs)[nonzero])
        and not np.signbit(theirs[~nonzero]).any()
    )


def random_pair(rng, lead, k, *, nan_scales=False):
    packed = rng.integers(0, 256, lead + (k // 2,), dtype=np.uint8)
    hi = 256 if nan_scales else 0xFD  # gguf reads 0xFF as 2^127; 0xFD/0xFE overflow alike in both
    scale = rng.integers(0, hi, lead + (k // 32,), dtype=np.uint8)
    return packed, scale


def test_type_constants_match_gguf():
    assert int(MXFP4) == gguf_mxfp4.GGML_TYPE_MXFP4
    assert GGML_QUANT_SIZES[MXFP4] == (32, gguf_mxfp4.BLOCK_BYTES)
    info = get_format("gguf-mxfp4").info
    assert (info.block, info.bytes_per_block) == GGML_QUANT_SIZES[MXFP4]


@pytest.mark.parametrize("conv", [gguf_mxfp4.pair_to_gguf, gguf_mxfp4.pair_to_gguf_ref], ids=["numba", "numpy"])
def test_pair_to_gguf_decodes_like_gguf_package(conv):
    rng = np.random.default_rng(0)
    packed, scale = random_pair(rng, (6, 5), 256)
    blocks = conv(packed, scale)
    assert blocks.shape == (6, 5, 8 * 17)
    ours = mxfp4.decode_pair(packed, scale)
    theirs = gguf_dequantize(blocks, MXFP4)
    assert same_as_ggml(ours, theirs)
    assert np.signbit(ours[ours == 0]).any()  # the -0 codes are there, and only ggml drops the sign


def test_all_scale_bytes_against_gguf():
    # every scale byte with every packed byte; gguf differs from OCP only at 0xFF
    packed = np.tile(np.arange(256, dtype=np.uint8), (256, 2))
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 32, axis=1)
    blocks = gguf_mxfp4.pair_to_gguf(packed, scale)
    with np.errstate(over="ignore"):
        theirs = gguf_dequantize(blocks, MXFP4)
    for dec in (gguf_mxfp4.decode_gguf, gguf_mxfp4.decode_gguf_ref):
        ours = dec(blocks)
        assert same_as_ggml(ours[:255], theirs[:255])
        # ggml continues the powers of two at 0xFF (half-scale 2^127, i.e. 2^128 per
        # E2M1 unit: numbers, Inf for big codes); OCP says NaN
        assert np.isnan(ours[255]).all() and not np.isnan(theirs[255]).any()
        assert theirs[255][34] == np.float32(2.0**127)  # byte 0x11: code 1 = 0.5 * 2^128


def test_converters_kernel_equals_reference_and_invert():
    rng = np.random.default_rng(1)
    packed, scale = random_pair(rng, (3, 4), 320, nan_scales=True)
    a = gguf_mxfp4.pair_to_gguf(packed, scale)
    b = gguf_mxfp4.pair_to_gguf_ref(packed, scale)
    assert np.array_equal(a, b)
    for back in (gguf_mxfp4.gguf_to_pair, gguf_mxfp4.gguf_to_pair_ref):
        p, s = back(a)
        assert np.array_equal(p, packed) and np.array_equal(s, scale)
    # random GGUF bytes are also a valid input: gguf -> pair -> gguf is the identity
    raw = rng.integers(0, 256, (7, 17 * 3), dtype=np.uint8)
    p, s = gguf_mxfp4.gguf_to_pair(raw)
    assert np.array_equal(gguf_mxfp4.pair_to_gguf(p, s), raw)
    assert all(np.array_equal(u, v) for u, v in zip(gguf_mxfp4.gguf_to_pair_ref(raw), (p, s)))


def test_decode_kernel_equals_reference_on_random_bytes():
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (2, 9, 17 * 4), dtype=np.uint8)
    a = gguf_mxfp4.decode_gguf(raw)
    b = gguf_mxfp4.decode_gguf_ref(raw)
    nan = np.isnan(b)
    assert (np.isnan(a) == nan).all()
    assert np.array_equal(bits(a)[~nan], bits(b)[~nan])
    p, s = gguf_mxfp4.gguf_to_pair(raw)
    c = mxfp4.decode_pair(p, s)
    assert np.array_equal(bits(a)[~nan], bits(c)[~nan])
    ab = gguf_mxfp4.decode_gguf(raw, out="bfloat16")
    bb = gguf_mxfp4.decode_gguf_ref(raw, out="bfloat16")
    assert np.array_equal(ab.view(np.uint16)[~nan], bb.view(np.uint16)[~nan])


def test_split_order_by_hand():
    # element j in the low nibble of qs[j], element j+16 in its high nibble
    codes = np.arange(32, dtype=np.uint8) % 16
    packed = (codes[0::2] | (codes[1::2] << 4))[None]
    blocks = gguf_mxfp4.pair_to_gguf(packed, np.array([[0x7F]], np.uint8))[0]
    assert blocks[0] == 0x7F
    for j in range(16):
        assert blocks[1 + j] == codes[j] | (codes[j + 16] << 4)


@pytest.mark.parametrize("vec", GOLDEN["vectors"], ids=lambda v: v["name"])
def test_golden_gguf(vec):
    fmt = get_format("gguf-mxfp4")
    x = np.array(vec["input"] + [0.0] * vec["zeros_after"], np.float32)[None]
    want = bytes.fromhex(vec["layouts"]["gguf-mxfp4"]["blocks"])
    for enc in (fmt.encode, fmt.reference_encode):
        assert enc(x)["blocks"].tobytes() == want
    blocks = np.frombuffer(want, np.uint8)[None]
    assert same_as_ggml(fmt.decode({"blocks": blocks}), gguf_dequantize(blocks, MXFP4))


def test_gguf_encoder_differs_as_documented():
    # V0: the gguf encoder rounds ties toward zero and gives +0 to small negatives
    v0 = next(v for v in GOLDEN["vectors"] if v["name"] == "V0")
    x = np.array(v0["input"] + [0.0] * v0["zeros_after"], np.float32)[None]
    ours = get_format("gguf-mxfp4").encode(x)["blocks"][0]
    theirs = gguf_quantize(x, MXFP4)[0]
    assert ours[0] == theirs[0]  # same scale byte

    def codes(block):
        qs = block[1:]
        return np.concatenate([qs & 0xF, qs >> 4])

    diff = np.nonzero(codes(ours) != codes(theirs))[0].tolist()
    # 0.75, 1.75, 3.5 (ties toward zero); -0.25, -0.1 (+0); -0.75, -1.75, -3.5 (ties)
    assert diff == [2, 4, 6, 10, 11, 12, 13, 14]
    assert codes(theirs)[[2, 4, 6, 10, 11]].tolist() == [1, 3, 5, 0, 0]


def test_gguf_encoder_scales_agree_on_random_data():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((16, 512)) * 0.03).astype(np.float32)
    ours = get_format("gguf-mxfp4").encode(x)["blocks"].reshape(16, -1, 17)
    theirs = gguf_quantize(x, MXFP4).reshape(16, -1, 17)
    assert np.array_equal(ours[..., 0], theirs[..., 0])
    # the values differ only where x sits exactly between two grid points or rounds to zero
    a = gguf_mxfp4.decode_gguf(ours.reshape(16, -1))
    b = gguf_dequantize(theirs.reshape(16, -1), MXFP4)
    assert (a == b).mean() > 0.999


def test_gguf_shape_errors():
    with pytest.raises(ShapeError, match="17"):
        gguf_mxfp4.decode_gguf(np.zeros((2, 16), np.uint8), name="blk.0.ffn_up_exps")
    with pytest.raises(ShapeError):
        gguf_mxfp4.gguf_to_pair(np.zeros((2, 17), np.int8))
    with pytest.raises(ShapeError):
        gguf_mxfp4.pair_to_gguf(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
