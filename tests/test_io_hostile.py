"""Files we must not trust: every malformed input raises a typed K3ckptError, nothing else.

Hand-written cases cover each rule in docs/safetensors-io.md; a hypothesis fuzz test mutates
valid files and checkpoints and checks that only K3ckptError subclasses escape.  Where our
parser accepts a mutated file, the stock safetensors reader must accept it too.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3ckpt.errors import (
    InvalidFileError,
    K3ckptError,
    NotFoundError,
    TruncatedFileError,
    UnsafePathError,
    UnsupportedError,
)
from k3ckpt.io import build_header, dtypes, open_checkpoint, parse_header_json, read_header, save_file
from k3ckpt.io.header import MAX_HEADER_BYTES


def _blob(header: dict | bytes, data: bytes = b"", *, n: int | None = None) -> bytes:
    js = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(js) if n is None else n) + js + data


def _ent(dtype: str, shape, offs) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offs}


def _read(tmp_path: Path, blob: bytes):
    p = tmp_path / "h.safetensors"
    p.write_bytes(blob)
    return read_header(p)


def _valid_blob() -> bytes:
    prefix, offs = build_header(
        [("a.weight", "F32", (3, 4), 48), ("a.scale", "U8", (5,), 5), ("b", "BF16", (2,), 4), ("e", "I8", (0,), 0)],
        {"format": "pt"},
    )
    return prefix + bytes(range(57))


def test_valid_reference_file(tmp_path):
    blob = _valid_blob()
    h = _read(tmp_path, blob)
    assert h.file_size == len(blob)
    assert safetensors.deserialize(blob)  # stock agrees it is valid


def test_truncated_at_every_cut_point(tmp_path):
    blob = _valid_blob()
    p = tmp_path / "model.safetensors"
    for cut in range(len(blob)):
        p.write_bytes(blob[:cut])
        with pytest.raises(TruncatedFileError):
            read_header(p)
        with pytest.raises(TruncatedFileError):
            open_checkpoint(p)


def test_header_length_beyond_file_and_over_cap(tmp_path):
    js = json.dumps({"x": _ent("U8", [1], [0, 1])}).encode()
    with pytest.raises(TruncatedFileError, match="needs"):
        _read(tmp_path, _blob(js, b"\x00", n=len(js) + 2))
    with pytest.raises(InvalidFileError, match="limit"):
        _read(tmp_path, _blob(js, b"\x00", n=MAX_HEADER_BYTES + 1))
    with pytest.raises(InvalidFileError, match="limit"):
        _read(tmp_path, _blob(js, b"\x00", n=2**64 - 1))
    with pytest.raises(InvalidFileError):
        _read(tmp_path, _blob(b"", n=0))


@pytest.mark.parametrize("js, match", [
    (b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"\xff":1}', "UTF-8"),
    (b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}\xc3', "UTF-8"),
    (b"[1,2]", "start with"),
    (b'"abc"', "start with"),
    (b" {}", "start with"),
    (b"{}x", "parse"),
    (b"{} {}", "parse"),
    (b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
     "more than once"),
    (b'{"x":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "more than once"),
    (b'{"__metadata__":{"a":"b","a":"c"}}', "more than once"),
    (b'{"x\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "surrogate"),
    (b'{"__metadata__":{"a":"\\udfff"}}', "surrogate"),
    (b'{"x":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}', "NaN"),
    (b'{"x":{"dtype":"U8","shape":[Infinity],"data_offsets":[0,1]}}', "Infinity"),
    (b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,-Infinity]}}', "Infinity"),
    (b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}', "parse"),
    (b'{"x":1}', "must be an object"),
    (b'{"x":{"dtype":"U8","shape":[1]}}', "missing"),
    (b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":0}}', "unexpected"),
    (b'{"x":{"dtype":5,"shape":[1],"data_offsets":[0,1]}}', "dtype"),
    (b'{"x":{"dtype":"U8","shape":1,"data_offsets":[0,1]}}', "shape"),
    (b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0]}}', "data_offsets"),
    (b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}}', "data_offsets"),
    (b'{"x":{"dtype":"U8","shape":[1],"data_offsets":"0,1"}}', "data_offsets"),
])
def test_bad_json(js, match):
    with pytest.raises(InvalidFileError, match=match):
        parse_header_json(js, source="f")


def test_deep_nesting_and_long_numbers():
    with pytest.raises(InvalidFileError, match="nests too deeply"):
        parse_header_json(b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}", source="f")
    with pytest.raises(InvalidFileError, match="parse"):  # Python refuses > 4300-digit ints
        parse_header_json(b'{"x":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,1]}}', source="f")


@pytest.mark.parametrize("shape", [[-1], [2.0], [True], [False, 1], [None], ["2"], [2**64], [[2]]])
def test_bad_dims(shape):
    with pytest.raises(InvalidFileError, match="shape"):
        parse_header_json(json.dumps({"x": _ent("U8", shape, [0, 2])}).encode(), source="f")


@pytest.mark.parametrize("offs", [[-1, 1], [2, 1], [0.0, 1], [True, 1], [0, 2**64], [None, 1]])
def test_bad_offsets(offs):
    with pytest.raises(InvalidFileError, match="data_offsets"):
        parse_header_json(json.dumps({"x": _ent("U8", [1], offs)}).encode(), source="f")


@pytest.mark.parametrize("tensors, match", [
    ({"a": _ent("U8", [4], [0, 4]), "b": _ent("U8", [4], [2, 6])}, "overlaps"),
    ({"a": _ent("U8", [4], [0, 4]), "b": _ent("U8", [4], [5, 9])}, "gap"),
    ({"a": _ent("U8", [4], [1, 5])}, "gap"),
    ({"a": _ent("U8", [4], [0, 4]), "b": _ent("U8", [4], [0, 4])}, "overlaps"),
    ({"a": _ent("U8", [0], [0, 0]), "b": _ent("U8", [4], [0, 4]), "c": _ent("U8", [0], [2, 2])}, "overlaps"),
    ({"a": _ent("F32", [3], [0, 4])}, "needs 12"),
    ({"a": _ent("BF16", [2, 2], [0, 4])}, "needs 8"),
    ({"a": _ent("F4", [3], [0, 2])}, "whole number of bytes"),
    ({"a": _ent("F6_E2M3", [2], [0, 2])}, "whole number of bytes"),
    ({"a": _ent("U8", [2**63, 2**63], [0, 4])}, "needs more"),
])
def test_bad_layout(tensors, match):
    with pytest.raises(InvalidFileError, match=match):
        parse_header_json(json.dumps(tensors).encode(), source="f")


def test_huge_shapes_are_cheap_and_exact():
    # a million-dim shape stops multiplying once it passes the offsets' span
    with pytest.raises(InvalidFileError, match="needs more"):
        parse_header_json(json.dumps({"a": _ent("U8", [9] * 1_000_000, [0, 4])}).encode(), source="f")
    # a zero dim makes any shape empty: valid, no MemoryError, sizes as Python ints
    h = parse_header_json(json.dumps({"a": _ent("F64", [2**63, 2**63, 0], [0, 0])}).encode(), source="f")
    assert h.tensors["a"].numel == 0 and h.tensors["a"].nbytes == 0
    # sizes beyond 2**64 bytes compare exactly (float or uint64 arithmetic would round or wrap)
    big = 2**62
    h = parse_header_json(json.dumps({"a": _ent("U8", [big], [0, big])}).encode(), source="f")
    assert h.data_size == big
    with pytest.raises(TruncatedFileError):
        parse_header_json(json.dumps({"a": _ent("U8", [big], [0, big])}).encode(), source="f", file_size=100)
    with pytest.raises(InvalidFileError, match="needs"):
        parse_header_json(json.dumps({"a": _ent("F64", [2**61 + 1], [0, 2**63])}).encode(), source="f")


def test_unknown_dtype(tmp_path):
    with pytest.raises(UnsupportedError, match="F12") as ei:
        _read(tmp_path, _blob({"w": _ent("F12", [1], [0, 1])}, b"\x00"))
    assert ei.value.tensor == "w" and "h.safetensors" in str(ei.value)
    for bad in ("u8", "", "float32"):
        with pytest.raises(UnsupportedError):
            parse_header_json(json.dumps({"w": _ent(bad, [1], [0, 1])}).encode(), source="f")


def test_trailing_and_missing_bytes(tmp_path):
    hdr = {"w": _ent("U8", [4], [0, 4])}
    assert _read(tmp_path, _blob(hdr, b"1234")).data_size == 4
    with pytest.raises(InvalidFileError, match="trailing"):
        _read(tmp_path, _blob(hdr, b"12345"))
    with pytest.raises(TruncatedFileError):
        _read(tmp_path, _blob(hdr, b"123"))
    with pytest.raises(InvalidFileError, match="trailing"):
        _read(tmp_path, _blob({}, b"x"))


def test_index_naming_missing_shard_or_outside(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    save_file(d / "a.safetensors", {"x": np.zeros(2, np.uint8)})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
    with pytest.raises(NotFoundError, match="b.safetensors"):
        open_checkpoint(d)
    save_file(tmp_path / "evil.safetensors", {"y": np.zeros(2, np.uint8)})
    for bad in ("../evil.safetensors", str(tmp_path / "evil.safetensors")):
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"x": "a.safetensors", "y": bad}}))
        with pytest.raises(UnsafePathError):
            open_checkpoint(d)


def test_not_a_regular_file(tmp_path):
    from k3ckpt.io import LocalFile

    with pytest.raises(InvalidFileError, match="regular"):
        read_header(tmp_path)
    with pytest.raises(InvalidFileError, match="regular"):
        LocalFile(tmp_path).pread(0, 0)


def test_file_changed_size_after_open(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(p, {"x": np.zeros(8, np.uint8)})
    from k3ckpt.io import LocalFile

    f = LocalFile(p)
    with open(p, "ab") as fh:
        fh.write(b"more")
    with pytest.raises(InvalidFileError, match="changed size"):
        f.pread(0, 8)


# ---- fuzzing ------------------------------------------------------------------------------

FUZZ = settings(max_examples=200, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def _valid_parts(draw) -> tuple[dict, bytes]:
    n = draw(st.integers(0, 4))
    entries = []
    for i in range(n):
        dt = draw(st.sampled_from(["U8", "F32", "BF16", "F4", "I64", "F8_E4M3"]))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        if dt == "F4":
            shape = shape + (2,)
        entries.append((f"t{i}", dt, shape, dtypes.lookup(dt).nbytes(shape)))
    prefix, offs = build_header(entries, {"format": "pt"} if draw(st.booleans()) else None)
    data = bytes(draw(st.binary(min_size=offs[-1][1], max_size=offs[-1][1]))) if offs else b""
    return json.loads(prefix[8:]), prefix + data


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8: 8 + n]), blob[8 + n:]


def _join(header: dict, data: bytes, pad: bytes = b"") -> bytes:
    js = json.dumps(header).encode() + pad
    return struct.pack("<Q", len(js)) + js + data


@st.composite
def mutated_files(draw) -> bytes:
    header, blob = _valid_parts(draw)
    _, data = _split(blob)
    tensors = [k for k in header if k != "__metadata__"]
    kind = draw(st.sampled_from(["none", "flip", "truncate", "insert", "json_edit", "json_edit_len", "length",
                                 "offsets", "shape", "dtype", "pad", "data_len"]))
    if kind == "flip" and blob:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(blob) - 1))
            blob = blob[:i] + bytes([blob[i] ^ draw(st.integers(1, 255))]) + blob[i + 1:]
    elif kind == "truncate":
        blob = blob[: draw(st.integers(0, max(0, len(blob) - 1)))]
    elif kind == "insert":
        i = draw(st.integers(0, len(blob)))
        blob = blob[:i] + draw(st.binary(min_size=1, max_size=8)) + blob[i:]
    elif kind in ("json_edit", "json_edit_len"):
        if header and draw(st.booleans()):
            k = draw(st.sampled_from(list(header)))
            if isinstance(header[k], dict) and header[k] and draw(st.booleans()):
                sub = draw(st.sampled_from(list(header[k])))
                header[k][sub] = draw(_json_values)
            else:
                header[k] = draw(_json_values)
        else:
            header[draw(st.text(max_size=6))] = draw(_json_values)
        js = json.dumps(header).encode()
        n = len(js) if kind == "json_edit" else draw(st.integers(0, len(js) + 16))
        blob = struct.pack("<Q", n) + js + data
    elif kind == "length":
        blob = struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + blob[8:]
    elif kind in ("offsets", "shape", "dtype") and tensors:
        # small, plausible edits: the layout rules (gap, overlap, size) must catch them
        e = header[draw(st.sampled_from(tensors))]
        if kind == "offsets":
            i = draw(st.integers(0, 1))
            e["data_offsets"][i] = max(0, e["data_offsets"][i] + draw(st.integers(-4, 4)))
        elif kind == "shape":
            op = draw(st.sampled_from(["bump", "append", "drop"]))
            if op == "bump" and e["shape"]:
                i = draw(st.integers(0, len(e["shape"]) - 1))
                e["shape"][i] = max(0, e["shape"][i] + draw(st.integers(-2, 2)))
            elif op == "append":
                e["shape"].append(draw(st.integers(0, 3)))
            elif e["shape"]:
                e["shape"].pop()
        else:
            e["dtype"] = draw(st.sampled_from(sorted(dtypes.DTYPES) + ["F12", "f32", "U4"]))
        blob = _join(header, data)
    elif kind == "pad":
        blob = _join(header, data, draw(st.text(" \t\n\r", max_size=9)).encode())
    elif kind == "data_len":
        blob = _join(header, data[: len(data) - draw(st.integers(0, 3))] + b"\0" * draw(st.integers(0, 3)))
    return blob


@FUZZ
@given(blob=mutated_files())
def test_fuzz_read_header_raises_only_our_errors(blob):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "f.safetensors"
        p.write_bytes(blob)
        try:
            h = read_header(p)
        except K3ckptError:
            return
    # accepted: it must describe exactly this file, and the stock reader must agree
    assert h.file_size == len(blob)
    theirs = dict(safetensors.deserialize(blob))
    assert set(theirs) == set(h.tensors)
    for name, t in h.tensors.items():
        assert theirs[name]["dtype"] == t.dtype and list(theirs[name]["shape"]) == list(t.shape)
        assert bytes(theirs[name]["data"]) == blob[h.data_start + t.start: h.data_start + t.end]


@st.composite
def mutated_checkpoints(draw) -> tuple[dict[str, bytes], bytes]:
    """(shard name -> bytes, index bytes), one part mutated."""
    shards = {}
    wm = {}
    for s in range(draw(st.integers(1, 3))):
        _, blob = _valid_parts(draw)
        name = f"model-{s + 1:05d}.safetensors"
        hdr = json.loads(blob[8: 8 + struct.unpack("<Q", blob[:8])[0]])
        # tensor names unique across shards
        js = json.dumps({(k if k == "__metadata__" else f"s{s}.{k}"): v for k, v in hdr.items()}).encode()
        blob = struct.pack("<Q", len(js)) + js + blob[8 + struct.unpack("<Q", blob[:8])[0]:]
        shards[name] = blob
        wm.update({f"s{s}.{k}": name for k in hdr if k != "__metadata__"})
    index: object = {"metadata": {"total_size": 0}, "weight_map": wm}
    what = draw(st.sampled_from(["index_value", "index_key", "index_bytes", "shard_bytes", "shard_truncate"]))
    if what == "index_value" and wm:
        k = draw(st.sampled_from(sorted(wm)))
        wm[k] = draw(st.sampled_from(["../x.safetensors", "/etc/passwd", "", "a/../../b", "model-00009.safetensors",
                                      "model-00001.safetensors", "sub/", "."]) | st.text(max_size=8) | _json_values)
    elif what == "index_key":
        wm[draw(st.text(max_size=6))] = draw(st.sampled_from(sorted(shards)))
    index_bytes = json.dumps(index).encode()
    if what == "index_bytes":
        i = draw(st.integers(0, len(index_bytes) - 1))
        index_bytes = index_bytes[:i] + draw(st.binary(max_size=3)) + index_bytes[i + 1:]
    elif what in ("shard_bytes", "shard_truncate"):
        name = draw(st.sampled_from(sorted(shards)))
        b = shards[name]
        if what == "shard_truncate":
            shards[name] = b[: draw(st.integers(0, max(0, len(b) - 1)))]
        else:
            i = draw(st.integers(0, len(b) - 1))
            shards[name] = b[:i] + bytes([b[i] ^ draw(st.integers(1, 255))]) + b[i + 1:]
    return shards, index_bytes


@FUZZ
@given(case=mutated_checkpoints())
def test_fuzz_open_checkpoint_raises_only_our_errors(case):
    shards, index_bytes = case
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "ck"
        root.mkdir()
        (Path(d) / "x.safetensors").write_bytes(next(iter(shards.values())))  # bait outside the folder
        for name, b in shards.items():
            (root / name).write_bytes(b)
        (root / "model.safetensors.index.json").write_bytes(index_bytes)
        try:
            ck = open_checkpoint(root)
        except K3ckptError:
            return
        with ck:
            for s in ck.shards:
                assert (root / s).resolve().parent == root.resolve()
                assert ck.shard_size(s) == os.path.getsize(root / s)
            for name in ck.tensors:
                assert len(ck.read_bytes(name)) == ck.tensors[name].nbytes


def _open_outcome(root: Path):
    try:
        with open_checkpoint(root) as ck:
            return [(n, e.shard, e.data_offset) for n, e in ck.tensors.items()], ck.index_metadata
    except K3ckptError as e:
        return type(e), str(e)


@FUZZ
@given(case=mutated_checkpoints())
def test_fuzz_open_checkpoint_fast_path_agrees(case):
    """The same mutated checkpoints with the fast path taking every header and index
    (threshold 0) and with the strict parser alone: the same checkpoint or the same error."""
    from k3ckpt.io import header as H

    shards, index_bytes = case
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "ck"
        root.mkdir()
        for name, b in shards.items():
            (root / name).write_bytes(b)
        (root / "model.safetensors.index.json").write_bytes(index_bytes)
        mp = pytest.MonkeyPatch()
        try:
            mp.setattr(H, "_PLAIN_SCAN_MIN", 1 << 60)
            strict = _open_outcome(root)
            mp.setattr(H, "_PLAIN_SCAN_MIN", 0)
            assert _open_outcome(root) == strict
        finally:
            mp.undo()


@pytest.mark.parametrize("second", ["[2.0]", "[true]", "[2, 0.0e0]", "[1e0, 2]"])
def test_repeated_shapes_still_refuse_floats_and_bools(second):
    # The parser checks a (dtype, shape) pair once and then only offsets; a float
    # or bool dim equal to a checked int (2.0 == 2, true == 1) must not ride on it.
    js = ('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
          '"b":{"dtype":"U8","shape":' + second + ',"data_offsets":[2,4]}}')
    with pytest.raises(InvalidFileError):
        parse_header_json(js.encode(), source="t")


def test_repeated_shapes_duplicate_key_inside_entry():
    js = ('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
          '"b":{"dtype":"U8","shape":[2],"shape":[2],"data_offsets":[2,4]}}')
    with pytest.raises(InvalidFileError, match="more than once"):
        parse_header_json(js.encode(), source="t")


@pytest.mark.parametrize("value", [["a.safetensors"], {"x": 1}, 3, None])
def test_index_value_that_is_not_a_shard_name(value):
    from k3ckpt.io.reader import parse_index

    with pytest.raises(InvalidFileError, match="shard name"):
        parse_index({"weight_map": {"w": value}}, source="idx")
