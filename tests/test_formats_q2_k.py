"""gguf-q2_k: decode kernel == numpy reference == gguf-py; encoder kernel == reference bytes,
its weighting, quality against simple baselines (and llama.cpp's own quantizer when it is
installed), importance matrices, bad input, golden vectors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from k3ckpt.errors import NaNScaleError, ShapeError, UsageError
from k3ckpt.formats import q2_k
from k3ckpt.formats.base import get_format, target_format
from k3ckpt.formats.mxfp4 import decode_pair, encode_pair
from k3ckpt.requant import q2_k as enc
from ggml_quant import ggml_quantize

GOLDEN = json.loads((Path(__file__).parent / "golden" / "q2_k_ex1.json").read_text())
BB = q2_k.BLOCK_BYTES


def gguf_decode(packed: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(packed).reshape(-1, BB)
    vals = dequantize(flat, GGMLQuantizationType.Q2_K)
    return vals.reshape(packed.shape[:-1] + (packed.shape[-1] // BB * q2_k.QK,))


def random_blocks(rng, rows: int, nblocks: int, *, d_bits=None) -> np.ndarray:
    """Random bytes with finite fp16 d and dmin per block (every other byte pattern is valid)."""
    b = rng.integers(0, 256, (rows, nblocks, BB), dtype=np.uint8)
    for off in (80, 82):
        if d_bits is None:
            v = (rng.standard_normal((rows, nblocks)) * 10.0 ** rng.uniform(-6, 3, (rows, nblocks)))
            bits = v.astype(np.float16).view(np.uint16)
        else:
            bits = np.asarray(d_bits, np.uint16)
        b[..., off] = bits & 255
        b[..., off + 1] = bits >> 8
    return b.reshape(rows, nblocks * BB)


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x.view(np.uint32), y.view(np.uint32))


def weighted_error(x, y, imatrix=None) -> float:
    """sum w (y - x)^2 with the encoder's weights w = imatrix * sqrt(sigma^2 + x^2), in float64."""
    k = x.shape[-1]
    q = np.ones(k) if imatrix is None else np.asarray(imatrix, np.float64)
    xb = x.astype(np.float64).reshape(-1, k // 256, 256)
    yb = y.astype(np.float64).reshape(xb.shape)
    w = q.reshape(k // 256, 256) * np.sqrt((xb * xb).mean(axis=2, keepdims=True) + xb * xb)
    return float((w * (yb - xb) ** 2).sum())


def snr_db(x, y, imatrix=None) -> float:
    q = np.ones(x.shape[-1]) if imatrix is None else np.asarray(imatrix, np.float64)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    return 10 * math.log10((q * x64 ** 2).sum() / (q * (x64 - y64) ** 2).sum())


# ---------------------------------------------------------------- format
def test_format_row_and_names():
    fmt = get_format("gguf-q2_k")
    info = fmt.info
    assert info.block == 256 and info.bytes_per_block == 84 and info.bits_per_weight == 2.625
    assert info.fields_text == "16 + 64 + 2 + 2"
    specs = fmt.part_specs((3, 7168, 3584))
    assert list(specs) == ["packed"]
    assert specs["packed"].shape == (3, 7168, 3584 // 256 * 84) and specs["packed"].dtype == "U8"
    assert fmt.tensor_names("layers.0.w1") == {"packed": "layers.0.w1.weight_packed"}
    assert target_format("Q2_K") is fmt and target_format("q2-k") is fmt


def test_code_order_covers_every_bit_once():
    byte, shift = q2_k.code_order()
    slots = byte * 4 + shift // 2
    assert sorted(slots.tolist()) == list(range(256))
    assert (byte[:32] == np.arange(32)).all() and (shift[:32] == 0).all()
    assert (byte[32:64] == np.arange(32)).all() and (shift[32:64] == 2).all()
    assert byte[128] == 32 and shift[128] == 0


# ---------------------------------------------------------------- decode
def test_decode_kernel_reference_and_gguf_agree_on_random_blocks():
    rng = np.random.default_rng(1)
    packed = random_blocks(rng, 5, 3)
    got = q2_k.decode_q2k(packed)
    assert got.shape == (5, 768) and got.dtype == np.float32
    assert same_bits(got, q2_k.decode_q2k_ref(packed))
    assert same_bits(got, gguf_decode(packed))


def test_decode_special_d_values():
    # zero, -0, the smallest subnormal, the largest finite, +inf and NaN as fp16 d and dmin
    d_bits = np.array([[0x0000, 0x8000, 0x0001, 0x7BFF, 0x7C00, 0x7E00]], np.uint16)
    packed = random_blocks(np.random.default_rng(2), 1, 6, d_bits=d_bits)
    got, ref, want = q2_k.decode_q2k(packed), q2_k.decode_q2k_ref(packed), gguf_decode(packed)
    finite = np.isfinite(want)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isnan(ref), np.isnan(want))
    assert same_bits(np.where(finite, got, 0), np.where(finite, want, 0))
    assert same_bits(np.where(finite, ref, 0), np.where(finite, want, 0))
    assert (got[0, :512] == 0).all() and np.isnan(got[0, 5 * 256:]).all()


def test_decode_formula_by_hand():
    d_bits = np.array([[np.float16(0.5).view(np.uint16)]], np.uint16)
    packed = random_blocks(np.random.default_rng(3), 1, 1, d_bits=d_bits)   # d = dmin = 0.5
    packed[0, :16] = (np.arange(16) | ((15 - np.arange(16)) << 4)).astype(np.uint8)
    got = q2_k.decode_q2k(packed)[0]
    qs = packed[0, 16:80]
    for i in range(256):
        h, g, j = i // 128, (i % 128) // 32, i % 32
        q = (int(qs[32 * h + j]) >> (2 * g)) & 3
        s = i // 16
        assert got[i] == np.float32(0.5 * s * q - 0.5 * (15 - s)), i


def test_format_decode_matches_functions_and_bf16_rounds():
    rng = np.random.default_rng(4)
    fmt = get_format("gguf-q2_k")
    packed = random_blocks(rng, 6, 2).reshape(2, 3, 2 * BB)
    got = fmt.decode({"packed": packed})
    assert got.shape == (2, 3, 512) and same_bits(got, q2_k.decode_q2k(packed))
    assert same_bits(fmt.reference_decode({"packed": packed}), got)
    bf = fmt.decode({"packed": packed}, out="bfloat16")
    assert np.array_equal(bf.astype(np.float32), got.astype(bf.dtype).astype(np.float32))


def test_bad_packed_shapes_and_k():
    with pytest.raises(ShapeError, match="uint8"):
        q2_k.decode_q2k(np.zeros((2, 85), np.uint8))
    fmt = get_format("gguf-q2_k")
    with pytest.raises(ShapeError, match="not applicable.*2880"):
        fmt.part_specs((2880, 2880))
    with pytest.raises(ShapeError, match="not applicable"):
        fmt.encode(np.zeros((2, 2880), np.float32), name="gpt-oss.w1")
    with pytest.raises(ShapeError, match="not applicable"):
        fmt.from_mxfp4(np.zeros((2, 1440), np.uint8), np.zeros((2, 90), np.uint8))


# ---------------------------------------------------------------- encode
def small_inputs() -> dict[str, np.ndarray]:
    """A few super-blocks each of awkward and ordinary data (small: the kernel's lanes see all cases)."""
    rng = np.random.default_rng(11)
    gauss = rng.standard_normal((2, 512)).astype(np.float32)
    t5 = (rng.standard_t(5, (1, 768)) * 0.013).astype(np.float32)
    mx = decode_pair(*encode_pair(rng.standard_normal((1, 512)).astype(np.float32)))
    mx[0, :40] = -0.0                                      # signed zeros, a sub-block of only zeros
    sparse = np.zeros((1, 512), np.float32)
    sparse[0, [5, 77, 300]] = [2.0, -3.0, 1e-3]
    const = np.full((1, 768), 0.37, np.float32)
    const[0, 256:512] = -1.5                               # constant negative: the min alone
    const[0, 512:] = 0.0
    const[0, 600] = -0.0
    positive = (np.abs(rng.standard_normal((1, 256))) + 1).astype(np.float32)   # min above 0
    tiny = (rng.standard_normal((1, 256)) * 1e-9).astype(np.float32)   # below fp16's reach: zeros
    huge = (rng.standard_normal((1, 256)) * 1e30).astype(np.float32)   # d clamps to 65504
    mixed = rng.standard_normal((1, 256)).astype(np.float32)
    mixed[0, 128:] *= 1e-4                                 # sub-blocks with very different scales
    subnormal = np.full((1, 256), 2.0 ** -20, np.float32)
    subnormal[0, ::3] = -(2.0 ** -22)
    return {"gauss": gauss, "t5": t5, "mxfp4": mx, "sparse": sparse, "const": const, "positive": positive,
            "tiny": tiny, "huge": huge, "mixed": mixed, "subnormal": subnormal,
            "zeros": np.zeros((1, 256), np.float32)}


def importances(k: int) -> dict[str, np.ndarray | None]:
    rng = np.random.default_rng(12)
    spiky = np.exp(rng.normal(0, 2, k)).astype(np.float32)
    holes = spiky.copy()
    holes[:256] = 0.0                                      # a whole super-block of zero importance
    holes[300:310] = 0.0
    return {"none": None, "spiky": spiky, "holes": holes, "huge": spiky * np.float32(1e30)}


@pytest.mark.parametrize("iname", ["none", "spiky", "holes", "huge"])
@pytest.mark.parametrize("name", list(small_inputs()))
def test_kernel_and_reference_bytes_identical(name, iname):
    x = small_inputs()[name]
    im = importances(x.shape[-1])[iname]
    got = enc.encode(x, imatrix=im)
    assert got.shape == x.shape[:-1] + (x.shape[-1] // 256 * BB,) and got.dtype == np.uint8
    assert np.array_equal(got, enc.encode_reference(x, imatrix=im))


def test_super_blocks_are_independent_of_their_search_chunk():
    # The kernel works on enc.SB_CHUNK super-blocks at once; each block's bytes must not depend on
    # its neighbours or its position (7 blocks: a partial chunk too).
    x = small_inputs()
    blocks = np.concatenate([x["gauss"][0, :256], x["zeros"][0], x["huge"][0], x["t5"][0, 256:512],
                             x["tiny"][0], x["subnormal"][0], x["mxfp4"][0, :256]]).reshape(1, 7 * 256)
    got = enc.encode(blocks).reshape(-1, BB)
    alone = np.stack([enc.encode(b[None, :])[0] for b in blocks.reshape(-1, 256)])
    assert np.array_equal(got, alone)


def test_encoded_bytes_decode_alike_in_gguf_and_k3ckpt():
    rng = np.random.default_rng(5)
    fmt = get_format("gguf-q2_k")
    x = rng.standard_normal((4, 512)).astype(np.float32)
    packed = fmt.encode(x)["packed"]
    assert packed.shape == (4, 168) and packed.dtype == np.uint8
    assert same_bits(fmt.decode({"packed": packed}), gguf_decode(packed))
    assert np.array_equal(fmt.reference_encode(x)["packed"], packed)


def test_special_blocks_decode_as_expected():
    x = small_inputs()
    # all zero, and below fp16's reach: 84 zero bytes
    assert not enc.encode(x["zeros"]).any() and not enc.encode(x["tiny"]).any()
    # constant sub-blocks are exact up to the fp16 / 4-bit grid of d * sc (and dmin * mc)
    y = q2_k.decode_q2k(enc.encode(x["const"]))[0]
    assert np.abs(y[:256] - 0.37).max() < 2e-3 and np.abs(y[256:512] + 1.5).max() < 1e-2
    assert (y[512:] == 0).all()
    # huge values: finite output, d clamped to 65504
    h = enc.encode(x["huge"])
    assert np.isfinite(q2_k.decode_q2k(h)).all()
    assert np.frombuffer(h[0, 80:82].tobytes(), "<f2")[0] == np.float16(65504)
    # a block above zero everywhere: every sub-block's lowest level is still <= 0 (d, dmin >= 0,
    # as llama.cpp writes them), which costs accuracy but not much
    b = enc.encode(x["positive"])
    p = q2_k.decode_q2k(b)
    assert not (b[0, 81] & 0x80) and not (b[0, 83] & 0x80)
    assert snr_db(x["positive"], p) > 15


def test_beats_min_max_rounding_on_its_own_objective_and_in_snr():
    # Baseline any reasonable Q2_K encoder should beat: per sub-block min-max levels, nibbles
    # rounded on d = max scale / 15 and dmin = max min / 15, codes rounded.
    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    xb = x.astype(np.float64).reshape(-1, 16, 16)
    lo = np.minimum(xb.min(axis=2), 0)
    s = (xb.max(axis=2) - lo) / 3
    d = s.max(axis=1, keepdims=True) / 15
    dm = (-lo).max(axis=1, keepdims=True) / 15
    sc = np.rint(s / d)
    mc = np.rint(-lo / dm)
    a, b = (d * sc)[..., None], (dm * mc)[..., None]
    base = (a * np.clip(np.rint((xb + b) / np.where(a > 0, a, 1)), 0, 3) - b).reshape(x.shape)
    y = q2_k.decode_q2k(enc.encode(x))
    assert weighted_error(x, y) < 0.8 * weighted_error(x, base)
    assert snr_db(x, y) > snr_db(x, base) + 1.0
    assert snr_db(x, y) > 11.0             # iid Gaussian: llama.cpp's own Q2_K reaches 11.4 dB (ones)


def test_importance_moves_the_error_to_the_unimportant_columns():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    im = np.ones(512, np.float32)
    im[::4] = 100.0                                         # every fourth column matters most
    plain = q2_k.decode_q2k(enc.encode(x))
    weighted = q2_k.decode_q2k(enc.encode(x, imatrix=im))
    err = lambda y, cols: float(((y - x)[:, cols].astype(np.float64) ** 2).sum())  # noqa: E731
    assert err(weighted, slice(0, None, 4)) < 0.7 * err(plain, slice(0, None, 4))
    assert snr_db(x, weighted, im) > snr_db(x, plain, im) + 0.5
    # scaling the importance by a power of two changes nothing; all-zero importance is all ones
    assert np.array_equal(enc.encode(x, imatrix=im * 8), enc.encode(x, imatrix=im))
    assert np.array_equal(enc.encode(x, imatrix=np.zeros(512)), enc.encode(x))


def test_from_mxfp4_encodes_the_decoded_values():
    rng = np.random.default_rng(8)
    packed, scale = encode_pair(rng.standard_normal((3, 512)).astype(np.float32))
    fmt = get_format("gguf-q2_k")
    im = np.exp(rng.normal(0, 1, 512)).astype(np.float32)
    got = fmt.from_mxfp4(packed, scale, imatrix=im)["packed"]
    assert np.array_equal(got, enc.encode(decode_pair(packed, scale), imatrix=im))
    assert np.array_equal(fmt.reference_from_mxfp4(packed, scale, imatrix=im)["packed"], got)
    assert np.array_equal(fmt.from_float(decode_pair(packed, scale), imatrix=im)["packed"], got)


def test_bad_input_is_refused_in_one_line():
    x = np.zeros((2, 256), np.float32)
    x[1, 7] = np.nan
    with pytest.raises(NaNScaleError, match=r"non-finite value nan at \[1, 7\]"):
        enc.encode(x)
    with pytest.raises(UsageError, match="one number per column"):
        enc.encode(np.zeros((2, 256), np.float32), imatrix=np.ones(255))
    with pytest.raises(UsageError, match="finite and >= 0, column 3"):
        enc.encode(np.zeros((2, 256), np.float32), imatrix=np.r_[np.ones(3), -1.0, np.ones(252)])
    with pytest.raises(ShapeError, match="float32"):
        enc.encode(np.zeros((2, 256), np.float64))


def test_against_llama_cpp_quantizer_when_installed():
    # llama.cpp's own quantize_row_q2_K_impl (imatrix = ones) on MXFP4-ized Gaussian data: k3ckpt's
    # encoder must reach at least its SNR.  Needs the llama-cpp-python package (optional).
    rng = np.random.default_rng(9)
    x = decode_pair(*encode_pair(rng.standard_normal((8, 1024)).astype(np.float32)))
    ones = np.ones(1024, np.float32)
    out = ggml_quantize(GGMLQuantizationType.Q2_K, x, BB, ones)
    theirs = snr_db(x, q2_k.decode_q2k(out))
    ours = snr_db(x, q2_k.decode_q2k(enc.encode(x, imatrix=ones)))
    assert ours >= theirs, (ours, theirs)


# ---------------------------------------------------------------- golden
@pytest.mark.parametrize("vec", GOLDEN["vectors"], ids=lambda v: v["name"])
def test_golden_vectors(vec):
    x = np.array(vec["input"], dtype=np.float32).reshape(vec["shape"])
    im = np.array(vec["imatrix"], np.float32) if "imatrix" in vec else None
    packed = np.frombuffer(bytes.fromhex(vec["bytes"]), np.uint8).reshape(vec["shape"][:-1] + [-1])
    want = np.array(vec["decoded"], dtype=np.float32).reshape(vec["shape"])
    assert same_bits(q2_k.decode_q2k(packed), want)
    assert same_bits(q2_k.decode_q2k_ref(packed), want)
    assert same_bits(gguf_decode(packed), want)
    assert np.array_equal(enc.encode(x, imatrix=im), packed)
    assert np.array_equal(enc.encode_reference(x, imatrix=im), packed)
