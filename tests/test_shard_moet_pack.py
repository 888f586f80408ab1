"""The vLLM-Moet pack format: MOET.md's worked examples byte for byte, closed forms vs permutations."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k3ckpt.errors import ShapeError, UsageError
from k3ckpt.formats.moet_w2 import pack_codes, unpack_codes
from k3ckpt.requant.moet import encode_keep_scales
from k3ckpt.shard.moet_pack import (
    ALIGN,
    QUANTIZER_ABI,
    PackIdentity,
    SlotGeometry,
    build_slot,
    code_byte_offset,
    expected_values_from_mxfp4,
    pack_fragment_major,
    pack_scales,
    scale_byte_offset,
    slot_values,
    split_slot,
    tp_slice_expert,
    unpack_fragment_major,
    unpack_scales,
)

EX1_BYTES = bytes.fromhex("10 32 54 76 98 BA DC FE A2 E6 80 D5 11 11 77 77")


def _digits(s: str) -> np.ndarray:
    return np.array([int(c) for c in s], dtype=np.uint8)


# ------------------------------------------------------------------ EX1
def test_ex1_codes_and_plane_bytes():
    packed = np.zeros((16, 32), np.uint8)
    packed[0, :16] = np.frombuffer(EX1_BYTES, np.uint8)
    scale = np.full((16, 2), 0x7A, np.uint8)
    codes, sc = encode_keep_scales(packed, scale)
    assert np.array_equal(unpack_codes(codes[0, :8]), _digits("22222333111110002130213022223333"))
    plane = pack_fragment_major(codes)
    assert plane.size == 16 * 64 // 4
    got = plane[[0, 8, 16, 24, 1, 9, 17, 25]]
    assert bytes(got) == bytes.fromhex("AA FE 55 01 36 36 AA FF")
    # scale 0x7A = 2^-5 survives verbatim
    assert np.all(sc == 0x7A)


def test_ex1_scale_offsets():
    assert scale_byte_offset(0, 0, 64) == 0
    assert scale_byte_offset(0, 1, 64) == 16
    assert scale_byte_offset(5, 0, 64) == 5
    assert scale_byte_offset(17, 3, 128) == 113
    s = np.arange(32 * 4, dtype=np.uint8).reshape(32, 4)
    plane = pack_scales(s)
    assert plane[113] == s[17, 3]
    sp = pack_scales(np.arange(16 * 2, dtype=np.uint8).reshape(16, 2))
    assert (sp[0], sp[16], sp[5]) == (0, 1, 10)   # (row 0, block 0), (row 0, block 1), (row 5, block 0)


def test_ex1_ds4_up_row_offsets():
    # DS4 TP1: w13 [4096, 4096]; up row 0 is r = 2048
    assert code_byte_offset(2048, 0, 4096) == (2_097_152, 0)
    assert scale_byte_offset(2048, 0, 4096) == 262_144


# ------------------------------------------------------------------ EX2
def test_ex2_toy_lanes():
    r, k = np.meshgrid(np.arange(16), np.arange(64), indexing="ij")
    plane = pack_fragment_major(pack_codes((r + k) % 4))
    assert plane.size == 256
    lane = lambda g, t: bytes(plane[(g * 4 + t) * 8: (g * 4 + t) * 8 + 8])  # noqa: E731
    assert lane(0, 0) == b"\xE4" * 8
    assert lane(1, 0) == b"\x39" * 8
    assert lane(0, 1) == b"\xE4" * 8


# ------------------------------------------------------------------ EX4
def test_ex4_ds4_slot_and_name():
    g = SlotGeometry(4096, 4096, 4096, 2048)
    assert [n for _, n in g.parts] == [4_194_304, 524_288, 2_097_152, 262_144]
    assert g.slot_bytes == 7_077_888 and g.stride == g.slot_bytes and g.stride // ALIGN == 1728
    ident = PackIdentity("my-ckpt-id", "auto", "base", 44, 256, g.slot_bytes, g.stride)
    assert ident.quantizer_abi == QUANTIZER_ABI == "tsym4-e8m0-fragmajor-a32-v2"
    assert ident.stem(0, 1) + ".pack" == "base.v2.e48aea122f14b34a4ef0.rank0of1.pack"
    assert ident.row_offset(5, 17) == 9_180_020_736
    assert ident.file_size == 44 * 256 * g.stride and ident.file_size / 2**30 == 74.25
    assert 43 * 256 * g.slot_bytes / 2**30 == pytest.approx(72.56, abs=0.005)   # written: 43 MoE layers
    assert ident.stem(1, 2, (0, 4)) == "base.v2.e48aea122f14b34a4ef0.rank1of2.pp0of4"


def test_geometry_table():
    ds4tp2 = SlotGeometry.for_expert(2048, 4096, tp=2)                               # DS4-Flash TP2
    assert (ds4tp2.n13, ds4tp2.k13, ds4tp2.n2, ds4tp2.k2) == (2048, 4096, 4096, 1024)
    assert ds4tp2.slot_bytes == 3_538_944
    assert SlotGeometry(2048, 6144, 6144, 1024).slot_bytes == 5_308_416            # GLM-5.2 TP2
    assert SlotGeometry(1024, 7168, 7168, 512).slot_bytes == 3_096_576             # Kimi-K2.7 TP4
    k3 = SlotGeometry.for_expert(3072, 3584)
    assert (k3.n13, k3.k13, k3.n2, k3.k2) == (6144, 3584, 3584, 3072)
    assert k3.slot_bytes == k3.stride == 9_289_728
    k3tp4 = SlotGeometry.for_expert(3072, 3584, tp=4)
    assert (k3tp4.n13, k3tp4.k13, k3tp4.n2, k3tp4.k2) == (1536, 3584, 3584, 768)
    assert k3tp4.slot_bytes == k3tp4.stride == 2_322_432
    with pytest.raises(ShapeError):
        SlotGeometry(4096, 4000, 4096, 2048)      # K % 64
    with pytest.raises(UsageError):
        SlotGeometry.for_expert(3072, 3584, tp=5)


def test_sidecar_and_identity_checks():
    ident = PackIdentity("id", "auto", "base", 5, 8, 55_296, 57_344)
    side = json.loads(ident.sidecar_bytes([2, 0, 1]))
    assert side == {"E": 8, "ckpt_id": "id", "layers": [0, 1, 2], "n_layers": 5,
                    "quantizer_abi": QUANTIZER_ABI, "slot_bytes": 55_296, "stride": 57_344, "tag": "base",
                    "version": 2, "zero_mode": "auto"}
    assert list(side) == sorted(side)
    for bad in (dict(ckpt_id=""), dict(zero_mode="x"), dict(tag="a/b"), dict(stride=55_296), dict(E=0)):
        with pytest.raises(UsageError):
            PackIdentity(**{**dict(ckpt_id="id", zero_mode="auto", tag="base", n_layers=5, E=8,
                                   slot_bytes=55_296, stride=57_344), **bad})
    with pytest.raises(UsageError):
        ident.row_offset(5, 0)
    with pytest.raises(UsageError):
        ident.sidecar([5])


# ------------------------------------------------------------------ closed forms == permutations
@pytest.mark.parametrize("n,k", [(16, 64), (32, 128), (48, 192)])
def test_plane_matches_closed_form(n, k):
    rng = np.random.default_rng(n + k)
    codes = rng.integers(0, 4, (n, k), dtype=np.uint8)
    plane = pack_fragment_major(pack_codes(codes))
    rr, kk = np.meshgrid(np.arange(n), np.arange(k), indexing="ij")
    byte = np.empty_like(rr)
    shift = np.empty_like(rr)
    for r in range(n):
        for c in range(k):
            byte[r, c], shift[r, c] = code_byte_offset(r, c, k)
    assert np.array_equal((plane[byte] >> shift) & 3, codes)
    assert np.array_equal(unpack_codes(unpack_fragment_major(plane, n, k)), codes)
    s = rng.integers(0, 256, (n, k // 32), dtype=np.uint8)
    sp = pack_scales(s)
    offs = np.array([[scale_byte_offset(r, b, k) for b in range(k // 32)] for r in range(n)])
    assert np.array_equal(sp[offs], s)
    assert np.array_equal(unpack_scales(sp, n, k), s)
    assert sorted(offs.ravel()) == list(range(n * k // 32))


def test_plane_shape_errors():
    with pytest.raises(ShapeError):
        pack_fragment_major(np.zeros((8, 16), np.uint8))      # N % 16
    with pytest.raises(ShapeError):
        unpack_fragment_major(np.zeros(10, np.uint8), 16, 64)
    with pytest.raises(ShapeError):
        pack_scales(np.zeros((16, 3), np.uint8))              # K = 96


# ------------------------------------------------------------------ slots
def _expert(rng, inter, hidden):
    def pair(n, k):
        return (rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                rng.integers(100, 150, (n, k // 32), dtype=np.uint8))
    return pair(inter, hidden), pair(inter, hidden), pair(hidden, inter)


def test_slot_decodes_to_runtime_map():
    rng = np.random.default_rng(3)
    gate, up, down = _expert(rng, 128, 64)
    down[1][0, 0] = 0xFF            # a NaN block
    gate[0][0, :16] = np.frombuffer(EX1_BYTES, np.uint8)
    g = SlotGeometry.for_expert(128, 64)
    slot = build_slot(g, gate, up, down)
    assert slot.dtype == np.uint8 and slot.size == g.slot_bytes
    assert np.array_equal(slot, build_slot(g, gate, up, down, reference=True))
    w13, w2 = slot_values(g, slot)
    assert np.array_equal(w13[:128], expected_values_from_mxfp4(*gate))
    assert np.array_equal(w13[128:], expected_values_from_mxfp4(*up))
    assert np.array_equal(w2, expected_values_from_mxfp4(*down), equal_nan=True)
    assert np.isnan(w2[0, :32]).all() and not np.isnan(w2[0, 32:]).any()
    # EX1's first block, row 0 of gate: levels of codes 2222233311111000... times 2^(s-127)
    f = 2.0 ** (int(gate[1][0, 0]) - 127)
    assert np.array_equal(w13[0, :8] / f, [1, 1, 1, 1, 1, 4, 4, 4])
    parts = split_slot(g, slot.tobytes())
    assert np.array_equal(parts["sc2"], down[1])
    with pytest.raises(ShapeError):
        build_slot(g, up, gate, gate)


def test_expected_values_independent_table():
    # all 16 nibbles: |v| <= 2 -> 1, >= 3 -> 4, sign bit kept (0x8 = -0 -> -1)
    packed = np.array([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2], np.uint8)
    v = expected_values_from_mxfp4(packed, np.array([[127]], np.uint8))
    assert v[0, :16].tolist() == [1, 1, 1, 1, 1, 4, 4, 4, -1, -1, -1, -1, -1, -4, -4, -4]


def test_tp_slice():
    rng = np.random.default_rng(1)
    gate, up, down = _expert(rng, 256, 64)
    g1, u1, d1 = tp_slice_expert(gate, up, down, 1, 2)
    assert np.array_equal(g1[0], gate[0][128:]) and np.array_equal(u1[1], up[1][128:])
    assert np.array_equal(d1[0], down[0][:, 64:]) and np.array_equal(d1[1], down[1][:, 4:])
    w13, w2 = slot_values(SlotGeometry.for_expert(256, 64, tp=2),
                          build_slot(SlotGeometry.for_expert(256, 64, tp=2), g1, u1, d1))
    assert np.array_equal(w2, expected_values_from_mxfp4(*down)[:, 128:])
    assert tp_slice_expert(gate, up, down, 3, 4)[2][0].shape == (64, 32)    # 64-wide shares are fine
    with pytest.raises(ShapeError):
        tp_slice_expert(gate, up, down, 0, 8)                                # 32-wide are not


def test_code_map_matches_values_and_encoder():
    """The verifier's float-free check (codes + scales) agrees with the decoded values."""
    from k3ckpt.shard.moet_pack import expected_codes_from_mxfp4

    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, (16, 64), dtype=np.uint8)
    scale = rng.integers(0, 255, (16, 4), dtype=np.uint8)
    codes = expected_codes_from_mxfp4(packed)
    assert np.array_equal(pack_codes(codes), encode_keep_scales(packed, scale)[0])
    f = np.repeat(np.ldexp(1.0, scale.astype(np.int64) - 127), 32, axis=1)
    assert np.array_equal(np.array([-4.0, -1.0, 1.0, 4.0])[codes] * f, expected_values_from_mxfp4(packed, scale))


@pytest.mark.parametrize("n,k", [(16, 64), (32, 192), (48, 128)])
def test_plane_kernel_equals_reference(n, k):
    from k3ckpt.shard.moet_pack import codes_plane_from_mxfp4, codes_plane_from_mxfp4_reference

    rng = np.random.default_rng(n * k)
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    plane = codes_plane_from_mxfp4(packed)
    assert np.array_equal(plane, codes_plane_from_mxfp4_reference(packed))
    assert np.array_equal(unpack_fragment_major(plane, n, k),
                          encode_keep_scales(packed, np.zeros((n, k // 32), np.uint8))[0])
    for v in (0x00, 0x88, 0xFF):   # +0 / -0 pairs and the largest negatives
        full = np.full((n, k // 2), v, np.uint8)
        assert np.array_equal(codes_plane_from_mxfp4(full), codes_plane_from_mxfp4_reference(full))


def test_slot_with_half_not_whole_tiles():
    # I = 8 rows per half: gate and up share row tiles, so the slot is packed from the stacked rows
    g = SlotGeometry(16, 64, 64, 64)
    rng = np.random.default_rng(9)
    gate = (rng.integers(0, 256, (8, 32), dtype=np.uint8), rng.integers(120, 130, (8, 2), dtype=np.uint8))
    up = (rng.integers(0, 256, (8, 32), dtype=np.uint8), rng.integers(120, 130, (8, 2), dtype=np.uint8))
    down = (rng.integers(0, 256, (64, 32), dtype=np.uint8), rng.integers(120, 130, (64, 2), dtype=np.uint8))
    w13, _ = slot_values(g, build_slot(g, gate, up, down))
    assert np.array_equal(w13, np.concatenate([expected_values_from_mxfp4(*gate), expected_values_from_mxfp4(*up)]))


def test_code_map_exhaustive():
    from k3ckpt.shard.moet_pack import expected_codes_from_mxfp4

    table = [2, 2, 2, 2, 2, 3, 3, 3, 1, 1, 1, 1, 1, 0, 0, 0]   # MOET.md section 1, _NIBBLE_TO_CODE
    b = np.arange(256, dtype=np.uint8).reshape(1, 256)
    got = expected_codes_from_mxfp4(b)[0]
    assert got.tolist() == [table[v & 15] if i % 2 == 0 else table[v >> 4] for v in range(256) for i in (0, 1)]


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def test_ex3_nvfp4_float_path():
    """EX3: NVFP4 -> 2-bit through the runtime's float64 path, zero mode `sign`."""
    from k3ckpt.shard.moet_pack import codes_scales_from_f64

    first = [0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x7, 0x9, 0xA, 0xB, 0xC, 0xD, 0xE, 0xF, 0x0, 0x8]
    second = [0x7, 0xF, 0x1, 0x9, 0x0, 0x0, 0x0, 0x0, 0x2, 0x3, 0x4, 0x5, 0xA, 0xB, 0xC, 0xD]
    # NVFP4: e2m1 x e4m3 block scale (per 16) x scale_2, exactly in float64
    w = np.concatenate([E2M1[first] * 0.5, E2M1[second] * 2.0]) * 0.25
    w = np.tile(w, (16, 2))                     # [16, 64]: two identical 32-blocks per row
    codes, scales = codes_scales_from_f64(w, "sign")
    assert np.all(scales == 126)                # amax 3.0 -> round(log2 0.5) = -1
    assert np.array_equal(codes[0, :32], _digits("22222221111111213021222222231110"))
    assert bytes(pack_codes(codes[0, :32])) == bytes.fromhex("AA 6A 55 65 63 AA EA 15")
    # the re-snapped nibbles, through the same map
    snapped = [0, 0, 1, 1, 1, 2, 3, 8, 8, 9, 9, 9, 0xA, 0xB, 0, 8, 7, 0xF, 1, 9, 0, 0, 0, 0, 2, 3, 4, 5, 0xA, 0xB,
               0xC, 0xD]
    from k3ckpt.requant.moet import NIBBLE_TO_CODE

    assert np.array_equal(codes[0, :32], NIBBLE_TO_CODE[snapped])


def test_ex3b_zero_modes():
    from k3ckpt.shard.moet_pack import codes_scales_from_f64

    block = np.array([0.0] * 8 + [1.0, -1.0] * 12)
    w = np.tile(block, (16, 2))
    assert np.array_equal(codes_scales_from_f64(w, "sign")[0][0, :8], _digits("22222222"))
    assert np.array_equal(codes_scales_from_f64(w, "auto")[0][0, :8], _digits("21212121"))
    assert np.array_equal(codes_scales_from_f64(w, "alt")[0][0, :8], _digits("21212121"))
    # auto keeps the signs when the zeros carry both signs often enough
    w2 = w.copy()
    w2[:, 1:8:2] = -0.0
    assert np.array_equal(codes_scales_from_f64(w2, "auto")[0][0, :8], _digits("21212121"))
    w3 = w.copy()
    w3[:, 0:4] = -0.0                           # half the zeros negative: `sign`
    assert np.array_equal(codes_scales_from_f64(w3, "auto")[0][0, :8], _digits("11112222"))
    assert codes_scales_from_f64(np.zeros((16, 32)), "sign")[1].tolist() == [[0]] * 16   # amax 0 -> -127
    # midpoints go to the lower magnitude: 2.5 -> 2 (small class), 3.5 -> 3 (big class)
    mid = np.tile(np.array([6.0, 2.5, -2.5, 3.5, 0.75, 1.75] + [1.0] * 26), (16, 1))
    c, s = codes_scales_from_f64(mid, "sign")
    assert s[0, 0] == 127 and c[0, :6].tolist() == [3, 2, 1, 3, 2, 2]
    with pytest.raises(UsageError):
        codes_scales_from_f64(w, "x")
