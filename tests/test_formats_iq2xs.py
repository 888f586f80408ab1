"""gguf-iq2_xs: decode kernel == numpy reference == gguf-py, tables, shapes, golden vectors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from k3ckpt.errors import ShapeError
from k3ckpt.formats import iq2xs
from k3ckpt.formats.base import get_format

GOLDEN = json.loads((Path(__file__).parent / "golden" / "iq2xs_ex1.json").read_text())


def gguf_decode(packed: np.ndarray) -> np.ndarray:
    """gguf-py's IQ2_XS dequantize of our row bytes, reshaped to [..., K]."""
    flat = np.ascontiguousarray(packed).reshape(-1, iq2xs.BLOCK_BYTES)
    vals = dequantize(flat, GGMLQuantizationType.IQ2_XS)
    return vals.reshape(packed.shape[:-1] + (packed.shape[-1] // iq2xs.BLOCK_BYTES * iq2xs.QK,))


def random_blocks(rng, rows: int, nblocks: int, *, d_bits=None) -> np.ndarray:
    """Random bytes with a finite fp16 d per block (every qs / scale byte pattern is valid)."""
    b = rng.integers(0, 256, (rows, nblocks, iq2xs.BLOCK_BYTES), dtype=np.uint8)
    if d_bits is None:
        d = (rng.standard_normal((rows, nblocks)) * 10.0 ** rng.uniform(-6, 3, (rows, nblocks))).astype(np.float16)
        d_bits = d.view(np.uint16)
    b[..., 0] = np.asarray(d_bits, np.uint16) & 255
    b[..., 1] = np.asarray(d_bits, np.uint16) >> 8
    return b.reshape(rows, nblocks * iq2xs.BLOCK_BYTES)


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x.view(np.uint32), y.view(np.uint32))


# ---------------------------------------------------------------- tables
def test_tables_come_from_gguf_and_have_the_documented_shape():
    grid = iq2xs.grid_table()
    assert grid.shape == (512, 8) and grid.dtype == np.uint8
    assert set(np.unique(grid)) == {8, 25, 43}
    assert len({tuple(r) for r in grid}) == 512
    signs = iq2xs.sign_table()
    popcount = np.array([bin(int(v)).count("1") for v in signs])
    assert signs.shape == (128,) and np.all(popcount % 2 == 0)
    assert np.array_equal(signs & 127, np.arange(128))


def test_format_row():
    fmt = get_format("gguf-iq2_xs")
    info = fmt.info
    assert info.block == 256 and info.bytes_per_block == 74 and info.bits_per_weight == 2.3125
    assert info.fields_text == "2 + 64 + 8"
    specs = fmt.part_specs((3, 7168, 3584))
    assert list(specs) == ["packed"]
    assert specs["packed"].shape == (3, 7168, 3584 // 256 * 74) and specs["packed"].dtype == "U8"
    assert fmt.tensor_names("layers.0.w1") == {"packed": "layers.0.w1.weight_packed"}


# ---------------------------------------------------------------- decode
def test_decode_kernel_reference_and_gguf_agree_on_random_blocks():
    rng = np.random.default_rng(1)
    packed = random_blocks(rng, 5, 3)
    got = iq2xs.decode_iq2xs(packed)
    assert got.shape == (5, 768) and got.dtype == np.float32
    assert same_bits(got, iq2xs.decode_iq2xs_ref(packed))
    assert same_bits(got, gguf_decode(packed))


def test_decode_special_d_values():
    # zero, -0, the smallest subnormal, the largest finite, +inf and NaN as fp16 d
    d_bits = np.array([[0x0000, 0x8000, 0x0001, 0x7BFF, 0x7C00, 0x7E00]], np.uint16)
    packed = random_blocks(np.random.default_rng(2), 1, 6, d_bits=d_bits)
    got = iq2xs.decode_iq2xs(packed)
    ref = iq2xs.decode_iq2xs_ref(packed)
    want = gguf_decode(packed)
    finite = np.isfinite(want)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isnan(ref), np.isnan(want))
    assert same_bits(np.where(finite, got, 0), np.where(finite, want, 0))
    assert same_bits(np.where(finite, ref, 0), np.where(finite, want, 0))
    assert np.isinf(got[0, 4 * 256:5 * 256]).all()
    # -0 * (+-1) keeps IEEE signs exactly as gguf-py: both zero signs occur
    zeros = got[0, :512]
    assert np.all(zeros == 0) and np.signbit(zeros).any() and not np.signbit(zeros).all()


def test_decode_formula_by_hand():
    # one block: d = 0.5, sub-block scale nibbles 0..15, qs[g] = grid index g | sign index (g % 128) << 9
    d_bits = np.array([[np.float16(0.5).view(np.uint16)]], np.uint16)
    packed = random_blocks(np.random.default_rng(3), 1, 1, d_bits=d_bits)
    qs = (np.arange(32) * 13 % 512) | ((np.arange(32) * 5 % 128) << 9)
    packed[0, 2:66] = qs.astype("<u2").view(np.uint8)
    packed[0, 66:74] = np.array([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], np.uint8)
    got = iq2xs.decode_iq2xs(packed).reshape(32, 8)
    grid, signs = iq2xs.grid_table(), iq2xs.sign_table()
    for g in range(32):
        s = g // 2                                    # the nibbles above put scale m on sub-block m
        sign = np.where((signs[qs[g] >> 9] >> np.arange(8)) & 1, -1.0, 1.0)
        want = 0.5 * (0.5 + s) / 4 * grid[qs[g] & 511] * sign
        assert np.array_equal(got[g], want.astype(np.float32)), g


def test_format_decode_matches_functions_and_bf16_rounds():
    rng = np.random.default_rng(4)
    fmt = get_format("gguf-iq2_xs")
    packed = random_blocks(rng, 6, 2).reshape(2, 3, 148)
    got = fmt.decode({"packed": packed})
    assert got.shape == (2, 3, 512)
    assert same_bits(got, iq2xs.decode_iq2xs(packed))
    assert same_bits(fmt.reference_decode({"packed": packed}), got)
    bf = fmt.decode({"packed": packed}, out="bfloat16")
    assert np.array_equal(bf.astype(np.float32), got.astype(bf.dtype).astype(np.float32))


def test_decode_of_encoder_output_matches_gguf():
    rng = np.random.default_rng(5)
    fmt = get_format("gguf-iq2_xs")
    x = rng.standard_normal((4, 512)).astype(np.float32)
    packed = fmt.encode(x)["packed"]
    assert packed.shape == (4, 148) and packed.dtype == np.uint8
    assert same_bits(fmt.decode({"packed": packed}), gguf_decode(packed))


# ---------------------------------------------------------------- shapes
def test_k_not_a_multiple_of_256_is_not_applicable():
    fmt = get_format("gguf-iq2_xs")
    with pytest.raises(ShapeError, match="not applicable.*2880"):
        fmt.part_specs((2880, 2880))
    with pytest.raises(ShapeError, match="not applicable"):
        fmt.encode(np.zeros((2, 2880), np.float32), name="gpt-oss.w1")
    with pytest.raises(ShapeError, match="not applicable"):
        fmt.from_mxfp4(np.zeros((2, 1440), np.uint8), np.zeros((2, 90), np.uint8))


def test_bad_packed_shapes_and_dtypes():
    with pytest.raises(ShapeError, match="uint8"):
        iq2xs.decode_iq2xs(np.zeros((2, 75), np.uint8))
    with pytest.raises(ShapeError, match="uint8"):
        iq2xs.decode_iq2xs(np.zeros((2, 74), np.int8))
    fmt = get_format("gguf-iq2_xs")
    with pytest.raises(ShapeError):
        fmt.decode({"packed": np.zeros((2, 70), np.uint8)})


# ---------------------------------------------------------------- golden
@pytest.mark.parametrize("vec", GOLDEN["vectors"], ids=lambda v: v["name"])
def test_golden_vectors(vec):
    x = np.array(vec["input"], dtype=np.float32).reshape(vec["shape"])
    packed = np.frombuffer(bytes.fromhex(vec["bytes"]), np.uint8).reshape(vec["shape"][:-1] + [-1])
    want = np.array(vec["decoded"], dtype=np.float32).reshape(vec["shape"])
    fmt = get_format("gguf-iq2_xs")
    assert same_bits(iq2xs.decode_iq2xs(packed), want)
    assert same_bits(iq2xs.decode_iq2xs_ref(packed), want)
    assert same_bits(gguf_decode(packed), want)
    assert np.array_equal(fmt.encode(x)["packed"], packed)
