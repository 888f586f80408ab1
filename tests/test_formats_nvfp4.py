"""NVFP4 (compressed-tensors and ModelOpt naming): golden vectors, kernel == reference,
ml_dtypes oracles for E4M3 / E2M1, encode rule, per-tensor scale handling."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from k3ckpt.errors import ShapeError, UsageError
from k3ckpt.formats.base import get_format
from k3ckpt.formats.nvfp4 import (
    decode_nvfp4,
    decode_nvfp4_ref,
    encode_nvfp4,
    encode_nvfp4_ref,
    global_scale_for,
)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "nvfp4_vectors.json").read_text())
CT = get_format("nvfp4")
MO = get_format("nvfp4-modelopt")


def _f(v) -> np.float32:
    return np.float32(float(v))


def _bytes(rows) -> np.ndarray:
    return np.array([[int(h, 16) for h in row] for row in rows], np.uint8)


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(b)
    return bool((np.isnan(a) == nan).all() and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def _parts(fmt, packed, scale, g):
    return {"packed": packed, "scale": scale, fmt.info.tensor_parts[0].role: np.array([g], np.float32)}


@pytest.mark.parametrize("reference", [False, True])
def test_golden_decode(reference):
    for case in GOLDEN["decode"]:
        fmt = get_format(case["naming"])
        parts = _parts(fmt, _bytes(case["packed"]), _bytes(case["scale"]), case["global"])
        got = (fmt.reference_decode if reference else fmt.decode)(parts)
        want = np.array([[_f(v) for v in row] for row in case["expected"]], np.float32)
        assert _same_bits(got, want), case["why"]


@pytest.mark.parametrize("reference", [False, True])
def test_golden_encode(reference):
    enc = encode_nvfp4_ref if reference else encode_nvfp4
    for case in GOLDEN["encode"]:
        x = np.array([[_f(v) for v in case["x"]]], np.float32)
        for given in (None, case["global"]):  # the automatic global is 2688 / 6 = 448 here
            packed, scale, g = enc(x, None if given is None else np.float32(given))
            assert g == np.float32(case["global"])
            assert np.array_equal(scale[0], _bytes([case["scale"]])[0]), case["why"]
            assert np.array_equal(packed[0], _bytes([case["packed"]])[0]), case["why"]
        if "codes" in case:
            codes = np.array(case["codes"], np.uint8)
            assert np.array_equal(packed[0], codes[0::2] | (codes[1::2] << 4))


def test_nibble_order_matches_the_mxfp4_pair_layout():
    # FORMATS / torchao vector: [0.5, -1, 6, -0] -> A1 87 (low nibble = even column)
    x = np.array([[0.5, -1.0, 6.0, -0.0] + [0.0] * 12], np.float32)
    packed, scale, g = encode_nvfp4(x)
    assert g == np.float32(448.0) and list(packed[0, :2]) == [0xA1, 0x87]


@pytest.mark.parametrize("fid", ["nvfp4", "nvfp4-modelopt"])
def test_decode_random_bytes_kernel_equals_reference_and_oracle(fid):
    fmt = get_format(fid)
    rng = np.random.default_rng(len(fid))
    parts = fmt.sample_parts((3, 4, 64), rng)
    role = fmt.info.tensor_parts[0].role
    a = fmt.decode(parts)
    b = fmt.reference_decode(parts)
    assert _same_bits(a, b)
    # oracle: ml_dtypes' E2M1 and E4M3, the per-tensor scale applied the way each naming does
    packed, scale, g = parts["packed"], parts["scale"], parts[role][0]
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(3, 4, 64)
    vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s = scale.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    eff = (s * g) if fid == "nvfp4-modelopt" else (s / g)
    assert _same_bits(a, vals * np.repeat(eff.astype(np.float32), 16, axis=-1))
    assert _same_bits(fmt.decode(parts, out="bfloat16"), a.astype(ml_dtypes.bfloat16))


def _inputs(kind, rng):
    shape = (6, 2, 64)
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    if kind == "gaussian":
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)
    if kind == "heavy":
        return (rng.standard_t(2, shape) * 10.0 ** rng.uniform(-6, 6, shape[:-1] + (1,))).astype(np.float32)
    # every E2M1 midpoint, both signs, at eff = 1 (block amax 6, global 448)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    x = rng.choice(np.concatenate([mids, -mids, [0.0, -0.0]]), shape).astype(np.float32)
    x[..., ::16] = 6.0
    return x


@pytest.mark.parametrize("fid", ["nvfp4", "nvfp4-modelopt"])
@pytest.mark.parametrize("kind", ["zeros", "gaussian", "heavy", "ties"])
def test_encode_kernel_equals_reference(fid, kind):
    fmt = get_format(fid)
    x = _inputs(kind, np.random.default_rng(len(kind)))
    a = fmt.encode(x, name="t")
    b = fmt.reference_encode(x, name="t")
    assert set(a) == set(b) == set(fmt.info.roles)
    for role in a:
        assert a[role].shape == b[role].shape and np.array_equal(a[role].view(np.uint8), b[role].view(np.uint8)), role


def test_e4m3_rounding_ties_match_ml_dtypes():
    # Block amax 6 * m with m every value between two E4M3 neighbours and at their midpoints:
    # with global 1 the block scale is E4M3(m) (compressed-tensors: global * amax / 6).
    finite = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    mids = (finite[:-1] + finite[1:]) / 2
    quarter = finite[:-1] + (finite[1:] - finite[:-1]) * 0.25
    m = np.concatenate([finite, mids, quarter, [500.0]]).astype(np.float32)
    x = np.zeros((len(m), 16), np.float32)
    x[:, 0] = m * np.float32(6.0)
    assert np.array_equal(x[:, 0] / np.float32(6.0), m)  # exact, so pre == m
    _, scale, _ = encode_nvfp4(x, np.float32(1.0))
    _, scale_ref, _ = encode_nvfp4_ref(x, np.float32(1.0))
    want = np.minimum(m, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).copy()
    want[want == 0] = 0x30
    assert np.array_equal(scale[:, 0], want) and np.array_equal(scale_ref[:, 0], want)


@pytest.mark.parametrize("kind", ["gaussian", "heavy"])
def test_encode_rule_and_stable_reencode(kind):
    x = _inputs(kind, np.random.default_rng(11))
    parts = CT.encode(x)
    g = parts["global_scale"][0]
    assert g == np.float32(2688.0) / np.float32(np.abs(x).max())
    y = CT.decode(parts)
    eff = (parts["scale"].view(ml_dtypes.float8_e4m3fn).astype(np.float32) / g).astype(np.float32)
    # error <= half the widest E2M1 gap (4 -> 6) times the block's scale
    err = np.abs(y - x).reshape(6, 2, 4, 16).max(axis=-1)
    assert (err <= eff * 1.0001).all()
    # re-encoding the decoded values with the stored global gives the same bytes
    again = CT.encode_with_global(y, g)
    assert all(np.array_equal(again[r].view(np.uint8), parts[r].view(np.uint8)) for r in parts)


def test_per_tensor_scale_handling():
    x = (np.random.default_rng(4).standard_normal((4, 32)) * 0.1).astype(np.float32)
    mo = MO.encode(x)
    assert mo["scale_2"].shape == (1,) and mo["scale_2"][0] == np.float32(np.abs(x).max()) / np.float32(2688.0)
    y = MO.decode(mo)
    assert np.array_equal(MO.decode({**mo, "scale_2": mo["scale_2"].reshape(())}), y)  # ModelOpt files: shape []
    ct = CT.encode(x)
    with pytest.raises(ShapeError, match="global_scale"):
        CT.decode({**ct, "global_scale": np.ones((2,), np.float32)}, name="w")
    with pytest.raises(UsageError, match="positive"):
        CT.decode({**ct, "global_scale": np.zeros((1,), np.float32)}, name="w")
    with pytest.raises(UsageError, match="global_scale"):
        CT.decode({r: a for r, a in ct.items() if r != "global_scale"}, name="w")
    assert global_scale_for(np.zeros((2, 16))) == 1.0 and global_scale_for(np.zeros(3), multiply=True) == 1.0
    assert np.isfinite(global_scale_for(np.full((1, 16), 1e-40, np.float32)))
    assert (CT.decode(CT.encode(np.zeros((2, 32), np.float32))) == 0).all()
    with pytest.raises(ShapeError):
        decode_nvfp4(np.zeros((2, 8), np.uint8), np.zeros((2, 2), np.uint8), np.float32(1))
    with pytest.raises(ShapeError):
        decode_nvfp4_ref(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), np.float64(1))


def test_names_and_table_rows():
    assert CT.tensor_names("m.experts.3.w1") == {
        "packed": "m.experts.3.w1.weight_packed", "scale": "m.experts.3.w1.weight_scale",
        "global_scale": "m.experts.3.w1.weight_global_scale"}
    assert MO.tensor_names("m.experts.3.w1") == {
        "packed": "m.experts.3.w1.weight", "scale": "m.experts.3.w1.weight_scale",
        "scale_2": "m.experts.3.w1.weight_scale_2"}
    assert MO.match_name("m.experts.3.w1.weight_scale_2") == ("m.experts.3.w1", "scale_2")
    for fmt in (CT, MO):
        assert fmt.info.fields_text == "1 + 8" and fmt.info.bits_per_weight == 4.5 and fmt.info.tensor_bytes == 4


def test_refuses_non_finite():
    x = np.ones((2, 32), np.float32)
    x[1, 5] = np.nan
    for enc in (encode_nvfp4, encode_nvfp4_ref):
        with pytest.raises(UsageError, match=r"\[1, 5\]"):
            enc(x, name="w")
    with pytest.raises(ShapeError, match="multiple of 16"):
        CT.encode(np.ones((2, 24), np.float32))
