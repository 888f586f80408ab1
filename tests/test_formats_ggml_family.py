"""The llama.cpp block formats' common checks, each run over every format of the family
(tests/ggml_family.py's table: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, Q2_K, IQ3_XXS): the format
row, decode kernel == numpy reference == gguf-py, special d, bad shapes; encoder kernel ==
reference bytes, super-blocks alone, symmetry, special blocks, quality, importance matrices,
from_mxfp4 / from_float, bad input, llama.cpp's own quantizer, golden vectors, requant through
the registry.  What only one format has stays in its own file (tests/test_formats_<x>.py)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ggml_family import BY_KEY, FAMILY, importances, same_bits, small_inputs, snr_db
from ggml_quant import ggml_quantize, ggml_requires_imatrix
from k3ckpt.errors import NaNScaleError, ShapeError, UsageError
from k3ckpt.formats.base import get_format, target_format
from k3ckpt.formats.mxfp4 import decode_pair, encode_pair
from k3ckpt.requant.metrics import error_stats

every_format = pytest.mark.parametrize("f", FAMILY, ids=str)


def gaussian() -> np.ndarray:
    """iid Gaussian [8, 1024], the quality tests' data."""
    return np.random.default_rng(5).standard_normal((8, 1024)).astype(np.float32)


# ---------------------------------------------------------------- format
@every_format
def test_format_row_names_and_registry_entry(f):
    """The registry's row: 256-weight blocks of the table's bytes, fields, ggml type; one U8
    ``packed`` part; the names ``--format`` takes; the decoders and encoder the table names."""
    fmt = get_format(f.format_id)
    info = fmt.info
    assert info.block == 256 and info.bytes_per_block == f.block_bytes and info.bits_per_weight == f.block_bytes / 32
    assert info.fields_text == f.fields_text and info.weighted and info.ggml_type == f.ggml
    specs = fmt.part_specs((3, 7168, 3584))
    assert list(specs) == ["packed"]
    assert specs["packed"].shape == (3, 7168, 14 * f.block_bytes) and specs["packed"].dtype == "U8"
    assert fmt.tensor_names("layers.0.w1") == {"packed": "layers.0.w1.weight_packed"}
    assert all(target_format(name) is fmt for name in f.names)
    assert fmt.decoders == (f.decode, f.decode_ref) and fmt.encoder_module() is f.encoder


# ---------------------------------------------------------------- decode
@every_format
def test_decode_kernel_reference_and_gguf_agree_on_random_blocks(f):
    """Random bytes with finite d: the numba kernel, the numpy reference and gguf-py decode to
    the same float32 bits."""
    packed = f.random_blocks(np.random.default_rng(1), 5, 3)
    got = f.decode(packed)
    assert got.shape == (5, 768) and got.dtype == np.float32
    assert same_bits(got, f.decode_ref(packed))
    assert same_bits(got, f.gguf_decode(packed))


@every_format
def test_decode_special_d_values(f):
    """d (every fp16 scale of the block) = 0, -0, the smallest subnormal, the largest finite, +inf
    and NaN: NaN where gguf-py has NaN, its bits elsewhere; zeros for a zero d, NaN for a NaN d, and
    what the table says of an inf d and of the zeros' signs."""
    d_bits = np.array([[0x0000, 0x8000, 0x0001, 0x7BFF, 0x7C00, 0x7E00]], np.uint16)
    packed = f.random_blocks(np.random.default_rng(2), 1, 6, d_bits=d_bits)
    got, ref, want = f.decode(packed), f.decode_ref(packed), f.gguf_decode(packed)
    finite = np.isfinite(want)
    assert not finite.all() and finite.any()
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isnan(ref), np.isnan(want))
    assert same_bits(np.where(finite, got, 0), np.where(finite, want, 0))
    assert same_bits(np.where(finite, ref, 0), np.where(finite, want, 0))
    blocks = got.reshape(6, 256)
    assert (blocks[:2] == 0).all() and np.isfinite(blocks[2:4]).all() and np.isnan(blocks[5]).all()
    assert np.isinf(blocks[4]).all() == f.inf_d_gives_inf
    signs = np.signbit(blocks[:2])
    assert (signs.any() and not signs.all()) == f.zero_d_gives_both_zero_signs


@every_format
def test_bad_packed_shapes_and_k_not_a_multiple_of_256(f):
    """Bytes not whole blocks or not uint8 are refused by both decoders and the format; a K that
    is not a multiple of 256 (gpt-oss's 2880) is not applicable to part_specs, encode, from_mxfp4."""
    bb = f.block_bytes
    for decode in (f.decode, f.decode_ref):
        with pytest.raises(ShapeError, match="uint8"):
            decode(np.zeros((2, bb + 1), np.uint8))
        with pytest.raises(ShapeError, match="uint8"):
            decode(np.zeros((2, bb), np.int8))
    fmt = get_format(f.format_id)
    with pytest.raises(ShapeError, match=f"must end in \\[n\\*{bb}\\]"):
        fmt.decode({"packed": np.zeros((2, bb - 4), np.uint8)})
    with pytest.raises(ShapeError, match="not applicable.*2880"):
        fmt.part_specs((2880, 2880))
    with pytest.raises(ShapeError, match="not applicable"):
        fmt.encode(np.zeros((2, 2880), np.float32), name="gpt-oss.w1")
    with pytest.raises(ShapeError, match="not applicable"):
        fmt.from_mxfp4(np.zeros((2, 1440), np.uint8), np.zeros((2, 90), np.uint8))


@every_format
def test_format_decode_is_the_decode_functions_and_bf16_rounds_it(f):
    """Format.decode / reference_decode of [2, 3, 2 blocks] are the decode functions' bits; the
    bfloat16 output is the float32 one rounded."""
    fmt = get_format(f.format_id)
    packed = f.random_blocks(np.random.default_rng(4), 6, 2).reshape(2, 3, 2 * f.block_bytes)
    got = fmt.decode({"packed": packed})
    assert got.shape == (2, 3, 512) and same_bits(got, f.decode(packed))
    assert same_bits(fmt.reference_decode({"packed": packed}), got)
    bf = fmt.decode({"packed": packed}, out="bfloat16")
    assert np.array_equal(bf.astype(np.float32), got.astype(bf.dtype).astype(np.float32))


# ---------------------------------------------------------------- encode
@pytest.mark.parametrize("iname", list(importances(256)))
@pytest.mark.parametrize("name", list(small_inputs()))
@every_format
def test_kernel_and_reference_bytes_identical(f, name, iname):
    """The numba encoder and its numpy reference write the same bytes for every awkward input and
    importance matrix (none, ones, spiky, with holes, huge)."""
    x = small_inputs()[name]
    im = importances(x.shape[-1])[iname]
    got = f.encoder.encode(x, imatrix=im)
    assert got.shape == x.shape[:-1] + (x.shape[-1] // 256 * f.block_bytes,) and got.dtype == np.uint8
    assert np.array_equal(got, f.encoder.encode_reference(x, imatrix=im))


@every_format
def test_super_blocks_are_independent_of_each_other(f):
    """The kernel works on several super-blocks at once: 21 of every kind (seven, then again
    reversed and doubled, and again times -0.25: full chunks of 8 or 16 and a partial one) encode
    to the same bytes alone, in reverse order, and by the reference."""
    x = small_inputs()
    kinds = np.stack([x["gauss"][0, :256], x["zeros"][0], x["huge"][0], x["t5"][0, 256:512],
                      x["tiny"][0], x["subnormal"][0], x["mxfp4"][0, :256]])
    blocks = np.concatenate([kinds, kinds[::-1] * np.float32(2.0), kinds * np.float32(-0.25)]).reshape(1, -1)
    got = f.encoder.encode(blocks).reshape(-1, f.block_bytes)
    alone = np.stack([f.encoder.encode(b[None, :])[0] for b in blocks.reshape(-1, 256)])
    assert np.array_equal(got, alone)
    reverse = f.encoder.encode(blocks.reshape(-1, 256)[::-1].reshape(1, -1)).reshape(-1, f.block_bytes)
    assert np.array_equal(got[::-1], reverse)
    assert np.array_equal(got.reshape(1, -1), f.encoder.encode_reference(blocks))


@pytest.mark.parametrize("f", [f for f in FAMILY if f.sign_symmetric], ids=str)
def test_sign_symmetry(f):
    """Formats with sign bits: encode(-x) decodes to exactly -decode(encode(x)), signed zeros
    included, so the mean error over x and -x together is exactly zero."""
    x = small_inputs()
    for name in ("gauss", "t5", "mxfp4", "sparse", "mixed", "huge"):
        assert same_bits(f.decode(f.encoder.encode(-x[name])), -f.decode(f.encoder.encode(x[name]))), name
    rng = np.random.default_rng(13)
    x = decode_pair(*encode_pair(rng.standard_normal((8, 1024)).astype(np.float32)))
    y = f.decode(f.encoder.encode(x))
    y_neg = f.decode(f.encoder.encode(-x))
    assert same_bits(y_neg, -y)
    assert error_stats(np.concatenate([x, -x]), np.concatenate([y, y_neg])).mean_bias == 0.0
    assert abs(error_stats(x, y).bias_rel_rms) < 5e-3      # one side alone: sampling noise only


@every_format
def test_special_blocks(f):
    """All-zero blocks and blocks below fp16's reach encode to zero bytes; huge values decode
    finite, every fp16 scale clamped to 65504."""
    x = small_inputs()
    assert not f.encoder.encode(x["zeros"]).any() and not f.encoder.encode(x["tiny"]).any()
    h = f.encoder.encode(x["huge"])
    assert np.isfinite(f.decode(h)).all()
    assert (f.d_values(h) == np.float16(65504)).all()


@every_format
def test_encoded_bytes_decode_alike_in_gguf_and_reach_the_formats_snr(f):
    """iid Gaussian through the format: the reference writes the same bytes, gguf-py decodes them
    to the same bits, the SNR is above the table's (llama.cpp's own level) and the error unbiased."""
    x = gaussian()
    fmt = get_format(f.format_id)
    packed = fmt.encode(x)["packed"]
    assert packed.shape == (8, 4 * f.block_bytes) and packed.dtype == np.uint8
    assert np.array_equal(fmt.reference_encode(x)["packed"], packed)
    y = fmt.decode({"packed": packed})
    assert same_bits(y, f.gguf_decode(packed))
    assert snr_db(x, y) > f.snr_min
    assert abs(float((y - x).mean())) < f.mean_error_max


@pytest.mark.parametrize("f", [f for f in FAMILY if f.beats], ids=str)
def test_quality_beats_the_cheaper_format(f):
    """A format with more bytes per block is worth them: on iid Gaussian its SNR is above the
    cheaper format's (the table's ``beats``) by the table's margin."""
    other, margin = f.beats
    g = BY_KEY[other]
    x = gaussian()
    ours = snr_db(x, f.decode(f.encoder.encode(x)))
    theirs = snr_db(x, g.decode(g.encoder.encode(x)))
    assert g.block_bytes < f.block_bytes and ours > theirs + margin, (ours, theirs)


@every_format
def test_importance_moves_the_error_to_the_unimportant_columns(f):
    """Columns 100 times as important (every stride-th) get less of the error and the weighted SNR
    rises; the bytes decode as gguf-py's and are from_float's; only relative importance counts and
    an all-zero matrix is all ones."""
    stride, ratio, gain = f.importance
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    im = np.ones(512, np.float32)
    im[::stride] = 100.0
    packed = f.encoder.encode(x, imatrix=im)
    assert np.array_equal(get_format(f.format_id).from_float(x, imatrix=im)["packed"], packed)
    weighted = f.decode(packed)
    assert same_bits(weighted, f.gguf_decode(packed))
    plain = f.decode(f.encoder.encode(x))
    err = lambda y: float(((y - x)[:, ::stride].astype(np.float64) ** 2).sum())  # noqa: E731
    assert err(weighted) < ratio * err(plain)
    assert snr_db(x, weighted, im) > snr_db(x, plain, im) + gain
    assert np.array_equal(f.encoder.encode(x, imatrix=im * 4), packed)
    assert np.array_equal(f.encoder.encode(x, imatrix=im * 8), packed)
    ones = f.encoder.encode(x, imatrix=np.ones(512, np.float32))
    assert np.array_equal(f.encoder.encode(x, imatrix=np.zeros(512)), ones)


def test_a_super_block_of_zero_importance_weighs_as_all_ones():
    """The encoders' shared input step: a row of zeros (one super-block's columns) becomes all ones
    after the matrix's power-of-two scaling; the other rows keep their scaled values."""
    from k3ckpt.requant._ggml_encode import block_inputs, check_imatrix

    holes = importances(512)["holes"]                      # columns 0-255 zero, 300-309 zero
    _, qw, _ = block_inputs(np.zeros((2, 512), np.float32), holes, "test", name=None)
    assert (qw[0] == np.float32(1.0)).all()
    assert np.array_equal(qw[1], check_imatrix(holes, 512)[256:])
    assert (qw[1, 44:54] == 0.0).all()


@pytest.mark.parametrize("f", [f for f in FAMILY if f.ones_is_plain], ids=str)
def test_no_importance_matrix_is_all_ones(f):
    """Where the table says so, encoding without a matrix is encoding with all ones."""
    x = np.random.default_rng(7).standard_normal((16, 512)).astype(np.float32)
    assert np.array_equal(f.encoder.encode(x), f.encoder.encode(x, imatrix=np.ones(512, np.float32)))


@every_format
def test_from_mxfp4_and_from_float_encode_the_decoded_values(f):
    """from_mxfp4 of [2, 3, K] is the encoder's bytes of the decoded MXFP4, with and without an
    importance matrix; reference_from_mxfp4 and from_float (float64 too) give the same bytes."""
    rng = np.random.default_rng(8)
    packed, scale = encode_pair(rng.standard_normal((2, 3, 512)).astype(np.float32))
    fmt = get_format(f.format_id)
    for im in (None, np.exp(rng.normal(0, 1, 512)).astype(np.float32)):
        got = fmt.from_mxfp4(packed, scale, imatrix=im)["packed"]
        values = decode_pair(packed, scale)
        assert got.shape == (2, 3, 2 * f.block_bytes)
        assert np.array_equal(got, f.encoder.encode(values, imatrix=im))
        assert np.array_equal(fmt.reference_from_mxfp4(packed, scale, imatrix=im)["packed"], got)
        assert np.array_equal(fmt.from_float(values, imatrix=im)["packed"], got)
        assert np.array_equal(fmt.from_float(values.astype(np.float64), imatrix=im)["packed"], got)
    x64 = rng.standard_normal((2, 256))
    assert np.array_equal(fmt.from_float(x64)["packed"], f.encoder.encode(x64.astype(np.float32)))


@every_format
def test_bad_input_is_refused_in_one_line(f):
    """NaN / inf / -inf (their first place named), an importance matrix of the wrong length or with
    a negative or NaN value, float64 input, K not a multiple of 256, a NaN MXFP4 scale: each a
    one-line error of its kind."""
    def refused(kind, pattern, fn, *args, **kwargs):
        with pytest.raises(kind, match=pattern) as err:
            fn(*args, **kwargs)
        assert "\n" not in str(err.value)

    enc = f.encoder
    for bad, text in ((np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")):
        for at in ((0, 3), (1, 7), (1, 300)):
            x = np.zeros((2, 512), np.float32)
            x[at] = bad
            refused(NaNScaleError, rf"non-finite value {re.escape(text)} at \[{at[0]}, {at[1]}\]", enc.encode, x,
                    name="w1")
    zeros = np.zeros((2, 256), np.float32)
    for length in (255, 512):
        refused(UsageError, "one number per column", enc.encode, zeros, imatrix=np.ones(length))
    refused(UsageError, "finite and >= 0, column 3", enc.encode, zeros, imatrix=np.r_[np.ones(3), -1.0, np.ones(252)])
    refused(UsageError, "finite and >= 0, column 3", enc.encode, zeros, imatrix=np.r_[np.ones(3), np.nan, np.ones(252)])
    refused(ShapeError, "float32", enc.encode, zeros.astype(np.float64))
    refused(ShapeError, f"{f.ggml} is not applicable", enc.encode, np.zeros((1, 300), np.float32))
    refused(ShapeError, "not applicable", enc.encode, np.ones((2, 2880), np.float32))
    packed, scale = encode_pair(np.ones((2, 512), np.float32))
    scale[0, 3] = 0xFF                                     # a NaN MXFP4 scale
    refused(NaNScaleError, "non-finite", get_format(f.format_id).from_mxfp4, packed, scale)


@pytest.mark.parametrize("imatrix", ["none", "ones", "lognormal"])
@every_format
def test_against_llama_cpp_quantizer(f, imatrix):
    """llama.cpp's own quantizer (ggml_quantize_chunk) on MXFP4-ized Gaussian data with no
    importance matrix (ones where ggml requires one), all ones and a log-normal one: its bytes
    decode alike in k3ckpt and gguf-py, and our weighted SNR is at least its + the table's margin."""
    assert ggml_requires_imatrix(f.qtype) == f.ggml_needs_imatrix
    rng = np.random.default_rng(9)
    x = decode_pair(*encode_pair(rng.standard_normal((8, 1024)).astype(np.float32)))
    ones = np.ones(1024, np.float32)
    im = {"none": None, "ones": ones, "lognormal": np.exp(rng.normal(0, 1, 1024)).astype(np.float32)}[imatrix]
    out = ggml_quantize(f.qtype, x, f.block_bytes, ones if im is None and f.ggml_needs_imatrix else im)
    assert same_bits(f.decode(out), f.gguf_decode(out))            # ggml's bytes, our decoder
    theirs = snr_db(x, f.decode(out), im)
    ours = snr_db(x, f.decode(f.encoder.encode(x, imatrix=im)), im)
    assert ours >= theirs + f.ggml_margins[imatrix], (ours, theirs)


@pytest.mark.parametrize("f, vec", [(f, v) for f in FAMILY for v in f.golden_vectors()],
                         ids=[f"{f}-{v['name']}" for f in FAMILY for v in f.golden_vectors()])
def test_golden_vectors(f, vec):
    """tests/golden/<format>_ex1.json: both decoders and gguf-py give the stored values of the
    stored bytes; the encoder, its reference and the format write those bytes."""
    x = np.array(vec["input"], dtype=np.float32).reshape(vec["shape"])
    im = np.array(vec["imatrix"], np.float32) if "imatrix" in vec else None
    packed = np.frombuffer(bytes.fromhex(vec["bytes"]), np.uint8).reshape(vec["shape"][:-1] + [-1])
    want = np.array(vec["decoded"], dtype=np.float32).reshape(vec["shape"])
    assert same_bits(f.decode(packed), want)
    assert same_bits(f.decode_ref(packed), want)
    assert same_bits(f.gguf_decode(packed), want)
    assert np.array_equal(f.encoder.encode(x, imatrix=im), packed)
    assert np.array_equal(f.encoder.encode_reference(x, imatrix=im), packed)
    fmt = get_format(f.format_id)
    through_format = fmt.encode(x) if im is None else fmt.from_float(x, imatrix=im)
    assert np.array_equal(through_format["packed"], packed)


@every_format
def test_requant_writes_the_encoders_bytes(f, k3_tiny, tmp_path):
    """``requant --format <TYPE>`` through the registry: every routed expert is the encoder's bytes
    of its decoded MXFP4, its SNR in the table's range, and the report lists every tensor."""
    from k3ckpt import api
    from k3ckpt.formats import ids
    from k3ckpt.io.reader import open_checkpoint

    result = api.requant(k3_tiny, tmp_path / "out", format=f.ggml, workers=1)
    fmt, mx = get_format(f.format_id), get_format(ids.MXFP4_PACK)
    low, high = f.requant_snr
    with open_checkpoint(k3_tiny) as src, open_checkpoint(tmp_path / "out") as out:
        for w, r in zip(result.plan.weights, result.results):
            packed, scale = src.read_raw(w.packed).view(np.uint8), src.read_raw(w.scale).view(np.uint8)
            got = out.read_raw(w.outputs[0][1]).view(np.uint8)
            values = mx.decode({"packed": packed, "scale": scale})
            assert np.array_equal(got, f.encoder.encode(values)), w.name
            assert np.array_equal(got, fmt.encode(values)["packed"]), w.name
            assert low < r.stats.snr_db < high, (w.name, r.stats.snr_db)
    assert {r.format for r in result.results} == {f.format_id}
    report = json.loads((tmp_path / "out" / "requant_report.json").read_text())
    assert len(report["tensors"]) == len(result.results)
