"""The format table and registry, parametrised over every registered format."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from k3ckpt.errors import NaNScaleError, NotFoundError, ShapeError, UnsupportedError, UsageError
from k3ckpt.formats import Format, FormatInfo, Part, PartSpec, format_table_markdown, get_format, list_formats
from k3ckpt.io.dtypes import lookup

ROOT = Path(__file__).resolve().parents[1]
IDS = [info.id for info in list_formats()]
ENCODABLE = [info.id for info in list_formats() if info.can_encode]


def random_parts(fmt: Format, shape, rng) -> dict[str, np.ndarray]:
    """Random stored bytes forming a valid encoding (random in every block part;
    formats with constrained per-tensor parts draw those from their domain)."""
    parts = fmt.sample_parts(shape, rng)
    specs = fmt.part_specs(shape)
    assert list(parts) == list(specs)
    for role, spec in specs.items():
        assert parts[role].shape == spec.shape and parts[role].dtype == np.dtype(lookup(spec.dtype).storage)
    return parts


def test_builtin_ids():
    assert {"mxfp4-pack-quantized", "gpt-oss-mxfp4", "gguf-mxfp4", "bf16", "f16", "f32", "fp8-e4m3",
            "moet-w2", "k3ckpt-mx2"} <= set(IDS)
    assert IDS == sorted(IDS)


# Rows the specs fix (ids not listed here are checked only for consistency).
KNOWN_ROWS = {
    "mxfp4-pack-quantized": ("1 + 16", 4.25, 0),
    "gpt-oss-mxfp4": ("1 + 16", 4.25, 0),
    "gguf-mxfp4": ("1 + 16", 4.25, 0),
    "moet-w2": ("1 + 8", 2.25, 0),
    "k3ckpt-mx2": ("1 + 8", 2.25, 9),
    "bf16": ("2", 16.0, 0),
}


@pytest.mark.parametrize("fid", sorted(KNOWN_ROWS))
def test_known_rows(fid):
    info = get_format(fid).info
    assert (info.fields_text, info.bits_per_weight, info.tensor_bytes) == KNOWN_ROWS[fid]


def test_unknown_format_lists_known():
    with pytest.raises(NotFoundError) as err:
        get_format("mxfp4")
    for fid in IDS:
        assert fid in str(err.value)


@pytest.mark.parametrize("fid", IDS)
def test_table_row_is_consistent(fid):
    info = get_format(fid).info
    assert isinstance(info, FormatInfo) and info.id == fid
    assert info.bytes_per_block == sum(n for _, n in info.fields)
    assert info.bits_per_weight == 8 * info.bytes_per_block / info.block
    assert sum(p.bytes_per_block for p in info.parts) == info.bytes_per_block
    assert info.fields_text == " + ".join(str(n) for _, n in info.fields)
    assert info.roles == tuple(p.role for p in info.parts) + tuple(t.role for t in info.tensor_parts)
    assert len(set(info.roles)) == len(info.roles)
    assert info.tensor_bytes == sum(t.nbytes for t in info.tensor_parts)
    assert all(isinstance(t, PartSpec) and t.suffix for t in info.tensor_parts)
    # every stored tensor (block or per-weight) has its own suffix, so names never collide
    suffixes = [p.suffix for p in info.parts] + [t.suffix for t in info.tensor_parts]
    assert len(set(suffixes)) == len(suffixes)
    page, _, anchor = info.spec.partition("#")
    text = (ROOT / page).read_text()
    slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    assert anchor in slugs, (info.spec, sorted(slugs))
    d = info.to_dict()
    assert d["bytes_per_block"] == info.bytes_per_block and d["tensor_bytes"] == info.tensor_bytes
    assert [t["role"] for t in d["tensor_parts"]] == [t.role for t in info.tensor_parts]
    assert json.loads(json.dumps(d)) == d


def _slug(heading: str) -> str:
    # GitHub's anchor rule: lower case, drop punctuation except - and _, spaces to -
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def test_readme_embeds_the_table():
    readme = (ROOT / "docs" / "formats" / "README.md").read_text()
    assert format_table_markdown() in readme


@pytest.mark.parametrize("fid", IDS)
def test_part_specs_and_logical_shape(fid):
    fmt = get_format(fid)
    shape = (3, 2, 4 * fmt.info.block)
    specs = fmt.part_specs(shape)
    assert tuple(s.role for s in specs.values()) == fmt.info.roles
    total = sum(s.nbytes for s in specs.values())
    if getattr(fmt, "tile", 1) == 1:  # 2-D tile formats (fp8-block) store partial edge tiles
        assert total == math.prod(shape) // fmt.info.block * fmt.info.bytes_per_block + fmt.info.tensor_bytes
    for t in fmt.info.tensor_parts:  # per-weight parts do not grow with the weight
        assert specs[t.role].shape == t.shape == fmt.part_specs((1, fmt.info.block))[t.role].shape
    parts = random_parts(fmt, shape, np.random.default_rng(0))
    assert fmt.logical_shape(parts) == shape


@pytest.mark.parametrize("fid", IDS)
def test_tensor_names_round_trip(fid):
    fmt = get_format(fid)
    base = "language_model.model.layers.1.block_sparse_moe.experts.7.w1"
    names = fmt.tensor_names(base)
    assert tuple(names) == fmt.info.roles
    assert len(set(names.values())) == len(names)
    for role, name in names.items():
        assert fmt.match_name(name) == (base, role)


def test_tensor_names_of_real_layouts():
    k3 = get_format("mxfp4-pack-quantized")
    assert k3.tensor_names("m.experts.0.w2") == {
        "packed": "m.experts.0.w2.weight_packed",
        "scale": "m.experts.0.w2.weight_scale",
    }
    assert k3.match_name("m.experts.0.w2.weight") is None
    oss = get_format("gpt-oss-mxfp4")
    assert oss.match_name("model.layers.3.mlp.experts.gate_up_proj_scales") == (
        "model.layers.3.mlp.experts.gate_up_proj",
        "scales",
    )
    assert oss.match_name("model.layers.3.mlp.experts.gate_up_proj_bias") is None


@pytest.mark.parametrize("fid", IDS)
def test_decode_random_bytes_kernel_equals_reference(fid):
    fmt = get_format(fid)
    rng = np.random.default_rng(abs(len(fid) * 7919))
    shape = (5, 3, 8 * fmt.info.block)
    parts = random_parts(fmt, shape, rng)
    for out in (np.float32, "bfloat16"):
        a = fmt.decode(parts, out=out)
        b = fmt.reference_decode(parts, out=out)
        assert a.shape == b.shape == shape and a.dtype == b.dtype
        nan = np.isnan(b.astype(np.float32))
        assert (np.isnan(a.astype(np.float32)) == nan).all()
        w = np.dtype(f"u{a.dtype.itemsize}")
        assert np.array_equal(a.view(w)[~nan], b.view(w)[~nan])


@pytest.mark.parametrize("fid", ENCODABLE)
@pytest.mark.parametrize("kind", ["gaussian", "zeros", "heavy"])
def test_encode_kernel_equals_reference(fid, kind):
    fmt = get_format(fid)
    rng = np.random.default_rng(3)
    shape = (4, 2, 6 * fmt.info.block)
    if kind == "zeros":
        x = np.zeros(shape, np.float32)
    elif kind == "gaussian":
        x = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    else:
        x = (rng.standard_t(2, shape) * 10.0 ** rng.uniform(-30, 3, shape[:-1] + (1,))).astype(np.float32)
    a = fmt.encode(x, name="t")
    b = fmt.reference_encode(x, name="t")
    specs = fmt.part_specs(shape)
    assert set(a) == set(b) == set(specs)
    for role, spec in specs.items():
        assert a[role].shape == spec.shape and a[role].dtype == np.dtype(lookup(spec.dtype).storage)
        assert np.array_equal(a[role].view(np.uint8), b[role].view(np.uint8)), role
    # Scalar block formats (one scale per <= 32 values) re-encode their own output
    # exactly: decode(encode(x)) is a fixed point of encode.  Super-block vector
    # codes (a grid search per 256 values) need not be, so they are held to
    # kernel == reference above only.
    if fmt.info.block <= 32 and getattr(fmt, "reencode_fixed_point", True):
        again = fmt.encode(fmt.decode(a))
        assert all(np.array_equal(again[r].view(np.uint8), a[r].view(np.uint8)) for r in a)


@pytest.mark.parametrize("fid", IDS)
def test_contract_errors(fid):
    fmt = get_format(fid)
    shape = (2, 4 * fmt.info.block)
    parts = random_parts(fmt, shape, np.random.default_rng(1))
    with pytest.raises(UsageError):
        fmt.decode({}, name="w")
    with pytest.raises(UsageError):
        fmt.decode({**parts, "extra": parts[fmt.info.parts[0].role]})
    with pytest.raises(UsageError):
        fmt.decode(parts, out=np.float64)
    first = fmt.info.parts[0].role
    bad_dtype = {**parts, first: np.zeros(parts[first].shape, np.int64)}
    with pytest.raises(ShapeError, match="layer.0.w1"):
        fmt.decode(bad_dtype, name="layer.0.w1")
    if len(fmt.info.parts) > 1 and getattr(fmt, "tile", 1) == 1:
        # a second block part that disagrees with the first
        role = fmt.info.parts[1].role
        with pytest.raises(ShapeError, match=role):
            fmt.decode({**parts, role: parts[role][:1]})
    for t in fmt.info.tensor_parts:
        # a per-weight part of the wrong shape, or missing
        with pytest.raises(ShapeError, match=t.role):
            fmt.decode({**parts, t.role: np.zeros(t.shape + (2,), parts[t.role].dtype)}, name="w")
        with pytest.raises(UsageError, match=t.role):
            fmt.decode({r: a for r, a in parts.items() if r != t.role}, name="w")
    with pytest.raises(ShapeError):
        fmt.part_specs(())
    if fmt.info.block > 1 and getattr(fmt, "tile", 1) == 1:
        with pytest.raises(ShapeError, match="multiple of"):
            fmt.part_specs((2, fmt.info.block + 1), name="w")
        if fmt.info.can_encode:
            with pytest.raises(ShapeError):
                fmt.encode(np.zeros((2, fmt.info.block + 2), np.float32))
    if not fmt.info.can_encode:
        with pytest.raises(UnsupportedError):
            fmt.encode(np.zeros(shape, np.float32))


@pytest.mark.parametrize("fid", [i for i in ENCODABLE if get_format(i).info.block > 1])
def test_block_formats_refuse_non_finite(fid):
    fmt = get_format(fid)
    x = np.ones((2, max(64, fmt.info.block)), np.float32)
    x[1, 5] = np.nan
    for enc in (fmt.encode, fmt.reference_encode):
        # UsageError or NaNScaleError: either names the position (both are ValueErrors)
        with pytest.raises((UsageError, NaNScaleError), match=r"\[1, 5\]"):
            enc(x, name="w")


def test_new_format_is_one_subclass():
    # a throwaway format registers by being defined; removed again afterwards
    from k3ckpt.formats import base

    class Demo(Format):
        info = FormatInfo(
            id="demo-test-only",
            title="demo",
            block=4,
            fields=(("scale", 2), ("codes", 2)),
            parts=(Part("codes", ".c", "U8", (2,)), Part("scale", ".s", "U16", (1,))),
            can_encode=False,
            can_decode=True,
            bf16_exact=False,
            spec="docs/formats/README.md",
        )

        def _decode_rows(self, rows, k, *, reference, bf16):
            return np.repeat(rows["scale"].astype(np.float32), 4, axis=1)

    try:
        fmt = get_format("demo-test-only")
        assert isinstance(fmt, Demo)
        assert fmt.part_specs((3, 8))["codes"].shape == (3, 4)
        out = fmt.decode({"codes": np.zeros((3, 4), np.uint8), "scale": np.ones((3, 2), np.uint16)})
        assert out.shape == (3, 8) and (out == 1).all()
    finally:
        del base._REGISTRY["demo-test-only"]


def test_new_format_with_tensor_parts():
    # a per-weight part (here one F32 multiplier) rides along in every registry path
    from k3ckpt.formats import base

    class DemoT(Format):
        info = FormatInfo(
            id="demo-tensor-parts-test-only",
            title="demo",
            block=4,
            fields=(("codes", 4),),
            parts=(Part("codes", ".c", "U8", (4,)),),
            can_encode=False,
            can_decode=True,
            bf16_exact=False,
            spec="docs/formats/README.md",
            tensor_parts=(PartSpec("mult", ".m", "F32", (1,)),),
        )

        def _decode_rows(self, rows, k, *, reference, bf16):
            return rows["codes"].astype(np.float32) * rows["mult"][0]

    try:
        fmt = get_format("demo-tensor-parts-test-only")
        assert fmt.info.tensor_bytes == 4 and fmt.info.roles == ("codes", "mult")
        assert {r: s.shape for r, s in fmt.part_specs((2, 3, 8)).items()} == {"codes": (2, 3, 8), "mult": (1,)}
        assert fmt.tensor_names("x.w") == {"codes": "x.w.c", "mult": "x.w.m"}
        assert fmt.match_name("x.w.m") == ("x.w", "mult")
        codes = np.arange(16, dtype=np.uint8).reshape(2, 8)
        mult = np.array([0.5], np.float32)
        out = fmt.decode({"codes": codes, "mult": mult})
        assert np.array_equal(out, codes * np.float32(0.5))
        assert fmt.logical_shape({"codes": codes, "mult": mult}) == (2, 8)
        assert "`mult` F32 [1] per weight" in format_table_markdown()
    finally:
        del base._REGISTRY["demo-tensor-parts-test-only"]


# -- what users type: find_format / target_format (issue 17, item 3) ---------------------------

@pytest.mark.parametrize("typed, fid", [
    ("IQ2_XS", "gguf-iq2_xs"), ("iq2_xs", "gguf-iq2_xs"), ("iq2-xs", "gguf-iq2_xs"), ("GGUF-IQ2_XS", "gguf-iq2_xs"),
    ("MOET-W2", "moet-w2"), ("moet_w2", "moet-w2"), ("mxfp4", "mxfp4-pack-quantized"), ("MXFP4_MOE", "gguf-mxfp4"),
    ("BF16", "bf16"), (" nvfp4 ", "nvfp4"),
])
def test_find_format_takes_llama_cpp_spellings(typed, fid):
    from k3ckpt.formats import find_format, target_format

    assert find_format(typed).id == fid and target_format(typed).id == fid


def test_unknown_format_is_one_usage_error_with_a_guess():
    from k3ckpt.formats import find_format, target_format

    for lookup_fn in (find_format, target_format):
        with pytest.raises(UsageError, match=r"^unknown --format 'moet-w3' \(did you mean moet-w2\? known formats: "):
            lookup_fn("moet-w3")
    with pytest.raises(UsageError, match=r"did you mean gguf-iq2_s( or [^?]+)?\?"):
        find_format("IQ2_M")
    with pytest.raises(UsageError, match=r"^unknown --tensor-type 'zz' \(known formats: bf16, "):
        find_format("zz", option="--tensor-type")


def test_decode_only_formats_are_not_targets():
    from k3ckpt.formats import find_format, is_target, target_format

    decode_only = [i.id for i in list_formats() if not is_target(get_format(i.id))]
    assert decode_only == ["fp8-block", "fp8-e4m3"]
    for fid in decode_only:
        assert find_format(fid.upper()).id == fid     # readable, so any lookup finds it
        with pytest.raises(UsageError, match=rf"^--format {fid} is decode-only: k3ckpt reads it but cannot write it"):
            target_format(fid)
    # and the list offered to a writer leaves them out
    with pytest.raises(UsageError) as err:
        target_format("nope")
    assert "fp8-block" not in str(err.value) and "moet-w2" in str(err.value)


def test_canonical_format_spec_keeps_the_method():
    from k3ckpt.formats import canonical_format_spec

    assert canonical_format_spec("MOET-W2:keep-scales") == "moet-w2:keep-scales"
    assert canonical_format_spec("IQ2_XS") == "gguf-iq2_xs"
    assert canonical_format_spec("keep") == "keep"


def test_cli_requant_and_plan_take_llama_cpp_names_and_refuse_alike(capsys, k3_tiny, tmp_path):
    from k3ckpt.cli.main import main

    rc = main(["requant", str(k3_tiny), str(tmp_path / "o"), "--format", "IQ2_XS", "--dry-run", "--json"])
    out = capsys.readouterr().out
    assert rc == 0 and "gguf-iq2_xs" in out
    for args in (["requant", str(k3_tiny), str(tmp_path / "x"), "--format", "iq2_m"],
                 ["plan", str(k3_tiny), "--devices", "8xH100", "--format", "iq2_m"]):
        rc = main(args)
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert "unknown --format 'iq2_m' (did you mean gguf-iq2_s" in err
    rc = main(["requant", str(k3_tiny), str(tmp_path / "y"), "--format", "fp8-block"])
    assert rc == 2 and "--format fp8-block is decode-only" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_formats_command_marks_targets(capsys):
    from k3ckpt.cli.main import main

    assert main(["formats", "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["fp8-block"]["requant_target"] is False and rows["moet-w2"]["requant_target"] is True
    assert main(["formats"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fp8-e4m3 "))
    assert "no (decode-only)" in line


# ------------------------------------------------------------ what a format can do, declared


def test_capabilities_are_declared_and_match_the_classes():
    for info in list_formats():
        fmt = get_format(info.id)
        assert ("mxfp4-codes" in info.encodes_from) == callable(getattr(fmt, "from_mxfp4", None)), info.id
        assert ("floats" in info.encodes_from) == info.can_encode, info.id
        assert info.containers[0] == "safetensors" and set(info.containers) <= {"safetensors", "gguf"}
        assert info.to_dict()["encodes_from"] == list(info.encodes_from)
    assert get_format("moet-w2").info.methods == ("refit", "keep-scales")
    assert {i.id for i in list_formats() if i.methods} == {"moet-w2"}


def test_every_mxfp4_encoder_is_reachable_through_the_registry():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (2, 128), dtype=np.uint8)     # [rows, K/2]: K = 256
    scale = rng.integers(118, 130, (2, 8), dtype=np.uint8)       # [rows, K/32]
    for info in list_formats():
        if "mxfp4-codes" not in info.encodes_from:
            continue
        fmt = get_format(info.id)
        parts = fmt.from_mxfp4(packed, scale, name="w")
        assert set(parts) <= set(info.roles) and fmt.decode(parts, name="w").shape == (2, 256), info.id
        ref = fmt.reference_from_mxfp4(packed, scale, name="w")
        assert all(np.array_equal(parts[k], ref[k]) for k in parts), info.id


def test_methods_come_from_the_registry():
    from k3ckpt.requant.plan import parse_format

    moet = get_format("moet-w2")
    assert moet.check_method(None) == "refit" and moet.check_method("keep-scales") == "keep-scales"
    assert parse_format("moet-w2").method == "refit"
    assert parse_format("moet-w2:keep-scales").method == "keep-scales"
    with pytest.raises(UsageError, match=r"one of \['keep-scales', 'refit'\]"):
        moet.check_method("nope")
    with pytest.raises(UsageError, match="refit or keep-scales"):
        parse_format("moet-w2:nope")
    with pytest.raises(UsageError, match="takes no method"):
        parse_format("k3ckpt-mx2:refit")


def test_ggml_types_are_gguf_types_with_the_same_bytes():
    """A format that says GGUF can hold it names a ggml type whose block is its block, byte for
    byte (gguf-py's table); the GGUF writer picks its encoders from these declarations."""
    import gguf

    from k3ckpt.gguf import produce

    held = [i for i in list_formats() if i.ggml_type]
    assert {i.id for i in held} >= {"gguf-iq2_xs", "gguf-iq2_xxs", "gguf-iq2_s", "gguf-iq1_s", "gguf-iq1_m", "gguf-q2_k",
                                  "gguf-iq3_xxs", "gguf-mxfp4", "f32", "f16", "bf16"}
    for info in held:
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[info.ggml_type]]
        assert info.bytes_per_block * block == nbytes * info.block, info.id
    assert set(produce._FROM_FLOAT.values()) == {(i.id, i.parts[0].role) for i in held if i.block > 1}
