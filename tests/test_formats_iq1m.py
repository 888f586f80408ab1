"""gguf-iq1_m: decode kernel == numpy reference == gguf-py, the byte layout by hand; encoder
kernel == reference bytes, per-group shifts, quality (and llama.cpp's own quantizer when
installed), importance matrices, bad input, golden vectors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from k3ckpt.errors import NaNScaleError, ShapeError, UsageError
from k3ckpt.formats import iq1m, iq1s
from k3ckpt.formats.base import get_format, target_format
from k3ckpt.formats.mxfp4 import decode_pair, encode_pair
from k3ckpt.requant import grid_search
from k3ckpt.requant import iq1m as enc
from ggml_quant import ggml_quantize
from test_formats_iq2xxs import importances, same_bits, small_inputs, snr_db

GOLDEN = json.loads((Path(__file__).parent / "golden" / "iq1_m_ex1.json").read_text())
BB = iq1m.BLOCK_BYTES
QT = GGMLQuantizationType.IQ1_M


def gguf_decode(packed: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(packed).reshape(-1, BB)
    return dequantize(flat, QT).reshape(packed.shape[:-1] + (packed.shape[-1] // BB * iq1m.QK,))


def random_blocks(rng, rows: int, nblocks: int, *, d_bits=None) -> np.ndarray:
    """Random bytes with fp16 d placed in the scales' top nibbles (finite, spread over 9 decades,
    unless ``d_bits`` gives them)."""
    b = rng.integers(0, 256, (rows, nblocks, BB), dtype=np.uint8)
    if d_bits is None:
        d = (rng.standard_normal((rows, nblocks)) * 10.0 ** rng.uniform(-6, 3, (rows, nblocks))).astype(np.float16)
        d_bits = d.view(np.uint16)
    d_bits = np.asarray(d_bits, np.int64)
    for k in range(4):
        hi = 49 + 2 * k                                  # the high byte of u16 k: its top nibble is d's bits 4k..4k+3
        b[..., hi] = (b[..., hi] & 0x0F) | (((d_bits >> (4 * k)) & 15) << 4).astype(np.uint8)
    return b.reshape(rows, nblocks * BB)


# ---------------------------------------------------------------- tables and format
def test_grid_is_iq1_s_grid_and_the_search_tables_hold_both_shifts():
    t = enc.search_tables()
    grid = iq1s.grid_table()
    assert np.array_equal(t.gt[0].T, grid[t.order] + np.float32(0.125))
    assert np.array_equal(t.gt[1].T, grid[t.order] - np.float32(0.125))
    assert enc.GRID.shift_per_group and enc.GRID.shift_slots == 32


def test_format_row_and_names():
    fmt = get_format("gguf-iq1_m")
    info = fmt.info
    assert info.block == 256 and info.bytes_per_block == 56 and info.bits_per_weight == 1.75
    assert info.fields_text == "32 + 16 + 8" and info.weighted and info.ggml_type == "IQ1_M"
    assert fmt.part_specs((3, 7168, 3584))["packed"].shape == (3, 7168, 14 * 56)
    assert target_format("IQ1_M") is fmt


# ---------------------------------------------------------------- decode
def test_decode_kernel_reference_and_gguf_agree_on_random_blocks():
    packed = random_blocks(np.random.default_rng(1), 5, 3)
    got = iq1m.decode_iq1m(packed)
    assert got.shape == (5, 768) and got.dtype == np.float32
    assert same_bits(got, iq1m.decode_iq1m_ref(packed))
    assert same_bits(got, gguf_decode(packed))


def test_decode_special_d_values():
    d_bits = np.array([[0x0000, 0x8000, 0x0001, 0x7BFF, 0x7C00, 0x7E00]], np.uint16)
    packed = random_blocks(np.random.default_rng(2), 1, 6, d_bits=d_bits)
    got, ref, want = iq1m.decode_iq1m(packed), iq1m.decode_iq1m_ref(packed), gguf_decode(packed)
    finite = np.isfinite(want)
    assert not finite.all() and finite.any()
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isnan(ref), np.isnan(want))
    assert same_bits(np.where(finite, got, 0), np.where(finite, want, 0))
    assert same_bits(np.where(finite, ref, 0), np.where(finite, want, 0))


def test_decode_formula_by_hand():
    d_bits = np.array([[np.float16(0.5).view(np.uint16)]], np.uint16)
    packed = random_blocks(np.random.default_rng(3), 1, 1, d_bits=d_bits)
    got = iq1m.decode_iq1m(packed).reshape(32, 8)
    grid, blk = iq1s.grid_table(), packed[0]
    u16 = [int(blk[48 + 2 * k]) | (int(blk[49 + 2 * k]) << 8) for k in range(4)]
    assert sum((u >> 12) << (4 * k) for k, u in enumerate(u16)) == int(d_bits[0, 0])
    for g in range(32):
        nib = (int(blk[32 + g // 2]) >> (4 * (g % 2))) & 15
        idx = int(blk[g]) | ((nib & 7) << 8)
        delta = -0.125 if nib & 8 else 0.125
        s = (u16[g // 8] >> (3 * ((g // 2) % 4))) & 7
        want = np.float32(np.float32(0.5) * np.float32(2 * s + 1)) * (grid[idx] + np.float32(delta)).astype(np.float32)
        assert np.array_equal(got[g], want.astype(np.float32)), g


def test_bad_packed_shapes_and_k():
    with pytest.raises(ShapeError, match="uint8"):
        iq1m.decode_iq1m(np.zeros((2, 57), np.uint8))
    with pytest.raises(ShapeError, match="not applicable.*2880"):
        get_format("gguf-iq1_m").part_specs((2880, 2880))


# ---------------------------------------------------------------- encode
@pytest.mark.parametrize("iname", ["none", "spiky", "holes"])
@pytest.mark.parametrize("name", list(small_inputs()))
def test_kernel_and_reference_bytes_identical(name, iname):
    x = small_inputs()[name]
    im = importances(x.shape[-1])[iname]
    got = enc.encode(x, imatrix=im)
    assert got.shape == x.shape[:-1] + (x.shape[-1] // 256 * BB,) and got.dtype == np.uint8
    assert np.array_equal(got, enc.encode_reference(x, imatrix=im))


def test_super_blocks_are_independent_of_their_search_chunk():
    x = small_inputs()
    blocks = np.concatenate([x["gauss"][0, :256], x["zeros"][0], x["huge"][0], x["t5"][0, 256:],
                             x["tiny"][0], x["subnormal"][0], x["mxfp4"][0, :256]]).reshape(1, 7 * 256)
    got = enc.encode(blocks).reshape(-1, BB)
    alone = np.stack([enc.encode(b[None, :])[0] for b in blocks.reshape(-1, 256)])
    assert np.array_equal(got, alone)


def test_each_group_takes_the_better_shift():
    # IQ1_M's shift is per group of 8: the search pairs each group's points with both shifts, so with
    # d, the scales and the points kept, the other shift errs more on (almost) every group.
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    codes, _ = grid_search.search(x, enc.GRID, enc.search_tables())
    assert codes.delta.shape == (2, 32) and set(np.unique(codes.delta)) == {0, 1}
    y = iq1m.decode_iq1m(enc.pack(codes)).astype(np.float64)
    flipped = enc.pack(grid_search.Codes(codes.d, codes.index, codes.signs, codes.scales, 1 - codes.delta))
    z = iq1m.decode_iq1m(flipped).astype(np.float64)
    x64 = x.astype(np.float64)
    w = np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + x64 ** 2)
    err = lambda v: (w * (v - x64) ** 2).reshape(2, 32, 8).sum(axis=2)  # noqa: E731
    assert (err(y) <= err(z) * (1 + 1e-9)).mean() > 0.9


def test_quality_and_the_reconstruction_grid():
    rng = np.random.default_rng(5)
    fmt = get_format("gguf-iq1_m")
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    packed = fmt.encode(x)["packed"]
    y = fmt.decode({"packed": packed})
    assert same_bits(y, gguf_decode(packed))
    # llama.cpp's own IQ1_M reaches about 7.0 dB on this kind of data (all-ones importance); IQ1_S 6.3
    s = snr_db(x, y)
    assert s > 7.0 and s > snr_db(x, iq1s.decode_iq1s(get_format("gguf-iq1_s").encode(x)["packed"]))


def test_special_blocks():
    x = small_inputs()
    assert not enc.encode(x["zeros"]).any() and not enc.encode(x["tiny"]).any()
    h = enc.encode(x["huge"])
    assert np.isfinite(iq1m.decode_iq1m(h)).all()


def test_importance_moves_the_error_to_the_unimportant_columns():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    im = np.ones(512, np.float32)
    im[::8] = 100.0
    plain = iq1m.decode_iq1m(enc.encode(x))
    weighted = iq1m.decode_iq1m(enc.encode(x, imatrix=im))
    err = lambda y, cols: float(((y - x)[:, cols].astype(np.float64) ** 2).sum())  # noqa: E731
    assert err(weighted, slice(0, None, 8)) < 0.8 * err(plain, slice(0, None, 8))
    assert snr_db(x, weighted, im) > snr_db(x, plain, im)
    assert np.array_equal(enc.encode(x, imatrix=im * 4), enc.encode(x, imatrix=im))


def test_from_mxfp4_encodes_the_decoded_values():
    rng = np.random.default_rng(8)
    packed, scale = encode_pair(rng.standard_normal((2, 512)).astype(np.float32))
    fmt = get_format("gguf-iq1_m")
    got = fmt.from_mxfp4(packed, scale)["packed"]
    assert np.array_equal(got, enc.encode(decode_pair(packed, scale)))
    assert np.array_equal(fmt.reference_from_mxfp4(packed, scale)["packed"], got)


def test_bad_input_is_refused_in_one_line():
    x = np.zeros((2, 256), np.float32)
    x[1, 3] = np.nan
    with pytest.raises(NaNScaleError, match=r"non-finite value nan at \[1, 3\]"):
        enc.encode(x)
    with pytest.raises(UsageError, match="one number per column"):
        enc.encode(np.zeros((1, 256), np.float32), imatrix=np.ones(512))
    with pytest.raises(ShapeError, match="IQ1_M is not applicable"):
        enc.encode(np.zeros((1, 300), np.float32))


def test_against_llama_cpp_quantizer_when_installed():
    # llama.cpp's IQ1_M quantizer (it requires an importance matrix: all ones, and then a real one)
    # on MXFP4-ized Gaussian data; needs the optional llama-cpp-python package.
    rng = np.random.default_rng(9)
    x = decode_pair(*encode_pair(rng.standard_normal((8, 1024)).astype(np.float32)))
    for im in (np.ones(1024, np.float32), np.exp(rng.normal(0, 1, 1024)).astype(np.float32)):
        out = ggml_quantize(QT, x, BB, im)
        assert same_bits(iq1m.decode_iq1m(out), gguf_decode(out))     # ggml's bytes, our decoder
        theirs = snr_db(x, iq1m.decode_iq1m(out), im)
        ours = snr_db(x, iq1m.decode_iq1m(enc.encode(x, imatrix=im)), im)
        assert ours >= theirs, (ours, theirs)


@pytest.mark.parametrize("vec", GOLDEN["vectors"], ids=lambda v: v["name"])
def test_golden_vectors(vec):
    x = np.array(vec["input"], dtype=np.float32).reshape(vec["shape"])
    im = np.array(vec["imatrix"], np.float32) if "imatrix" in vec else None
    packed = np.frombuffer(bytes.fromhex(vec["bytes"]), np.uint8).reshape(vec["shape"][:-1] + [-1])
    want = np.array(vec["decoded"], dtype=np.float32).reshape(vec["shape"])
    assert same_bits(iq1m.decode_iq1m(packed), want)
    assert same_bits(iq1m.decode_iq1m_ref(packed), want)
    assert same_bits(gguf_decode(packed), want)
    assert np.array_equal(enc.encode(x, imatrix=im), packed)


def test_requant_writes_iq1_m_weights_that_decode_to_the_encoders_bytes(k3_tiny, tmp_path):
    # --format IQ1_M through the registry: every routed expert is the encoder's bytes of its decoded
    # MXFP4, and the report gives its SNR
    from k3ckpt import api
    from k3ckpt.formats import ids
    from k3ckpt.io.reader import open_checkpoint

    result = api.requant(k3_tiny, tmp_path / "out", format="IQ1_M", workers=1)
    fmt, mx = get_format(ids.GGUF_IQ1_M), get_format(ids.MXFP4_PACK)
    with open_checkpoint(k3_tiny) as src, open_checkpoint(tmp_path / "out") as out:
        for w, r in list(zip(result.plan.weights, result.results))[:6]:
            packed, scale = src.read_raw(w.packed).view(np.uint8), src.read_raw(w.scale).view(np.uint8)
            got = out.read_raw(w.outputs[0][1]).view(np.uint8)
            assert np.array_equal(got, enc.encode(mx.decode({"packed": packed, "scale": scale}))), w.name
            assert 3.0 < r.stats.snr_db < 20.0
    assert {r.format for r in result.results} == {ids.GGUF_IQ1_M}
    report = json.loads((tmp_path / "out" / "requant_report.json").read_text())
    assert len(report["tensors"]) == len(result.results)
