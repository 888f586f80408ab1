"""The strict header parser and build_header, against the stock safetensors writer."""

from __future__ import annotations

import io
import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from k3ckpt.errors import InvalidFileError, ShapeError, TruncatedFileError, UnsupportedError, UsageError
from k3ckpt.io import dtypes
from k3ckpt.io.header import (
    MAX_HEADER_BYTES,
    Header,
    TensorInfo,
    build_header,
    parse_header_json,
    parse_header_length,
    read_header,
)

# safetensors Python TensorSpec dtype names (torch spelling) for each header dtype it can write.
STOCK_DTYPE = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}


def _json_of(prefix: bytes) -> bytes:
    (n,) = struct.unpack("<Q", prefix[:8])
    return prefix[8: 8 + n]


def test_stock_table_covers_all_but_f6():
    # F6 cannot be written from Python (FORMATS.md sec 4); every other dtype is compared with stock.
    assert set(dtypes.DTYPES) - set(STOCK_DTYPE) == {"F6_E2M3", "F6_E3M2"}


@pytest.mark.parametrize("name", sorted(dtypes.DTYPES))
def test_every_dtype_round_trips(name):
    # 8 elements: a whole number of bytes for every width (4, 6, 8, ... bits)
    entries = [("w", name, (2, 4), dtypes.lookup(name).nbytes((2, 4))), ("e", name, (0, 3), 0)]
    prefix, offsets = build_header(entries, {"format": "pt"})
    assert len(prefix) % 8 == 0
    data_size = offsets[-1][1]
    h = parse_header_json(_json_of(prefix), source="mem", file_size=len(prefix) + data_size)
    assert h.metadata == {"format": "pt"}
    w = h.tensors["w"]
    assert (w.dtype, w.shape, w.start, w.end) == (name, (2, 4), 0, data_size)
    assert w.nbytes == dtypes.lookup(name).bits  # 8 elements * bits / 8
    assert w.numel == 8
    assert h.tensors["e"].nbytes == 0 and h.tensors["e"].numel == 0
    assert h.data_start == len(prefix) and h.file_size == len(prefix) + data_size


@pytest.mark.parametrize("name", sorted(STOCK_DTYPE))
def test_matches_stock_serialize(name):
    """Stock serialize() for each dtype: our parse agrees, and build_header gives the same prefix."""
    nbytes = dtypes.lookup(name).nbytes((2, 4))
    buf = np.arange(64, dtype=np.uint8)
    # stock takes the F4 storage shape (bytes) and doubles the last dim
    stock_shape = [2, 2] if name == "F4" else [2, 4]
    specs = {
        "b.scale": safetensors.TensorSpec(dtype=STOCK_DTYPE[name], shape=stock_shape,
                                          data_ptr=buf.ctypes.data, data_len=nbytes),
        "a": safetensors.TensorSpec(dtype="float32", shape=[3], data_ptr=buf.ctypes.data, data_len=12),
    }
    blob = safetensors.serialize(specs, metadata={"format": "pt", "k": "v"})
    h = parse_header_json(_json_of(blob), source="stock", file_size=len(blob))
    assert h.file_size == len(blob)
    theirs = json.loads(_json_of(blob))
    for tname, info in h.tensors.items():
        assert theirs[tname] == {"dtype": info.dtype, "shape": list(info.shape),
                                 "data_offsets": [info.start, info.end]}
    assert h.tensors["b.scale"].shape == (2, 4) and h.tensors["b.scale"].dtype == name
    ours, _ = build_header([(t.name, t.dtype, t.shape, t.nbytes) for t in h.tensors.values()], h.metadata)
    assert ours == blob[: h.data_start]


def test_read_header_of_stock_save_file(tmp_path):
    p = tmp_path / "s.safetensors"
    tensors = {
        "z": np.zeros((2, 3), np.float32), "a": np.arange(5, dtype=np.uint8),
        "bf": np.ones(3, ml_dtypes.bfloat16), "empty": np.zeros((0, 7), np.int16), "scalar": np.float64(2.5),
    }
    tensors["scalar"] = np.array(2.5)
    safetensors.numpy.save_file(tensors, str(p), metadata={"format": "np"})
    h = read_header(p)
    with safetensors.safe_open(str(p), framework="numpy") as f:
        assert set(f.keys()) == set(h.tensors)
        assert f.metadata() == h.metadata
        for name in f.keys():
            assert list(f.get_slice(name).get_shape()) == list(h.tensors[name].shape)
    assert h.tensors["scalar"].shape == () and h.tensors["scalar"].nbytes == 8
    assert h.tensors["empty"].nbytes == 0
    starts = [t.start for t in h.tensors.values()]
    assert starts == sorted(starts)
    assert h.file_size == p.stat().st_size
    # the same header through the three read_header inputs
    with open(p, "rb") as f:
        assert read_header(f) == h
    assert read_header(str(p)) == h


class _MemSource:
    def __init__(self, blob: bytes, name: str = "mem"):
        self.blob, self.name, self.size = blob, name, len(blob)

    def pread(self, offset: int, n: int) -> bytes:
        return self.blob[offset: offset + n]

    def close(self) -> None:
        pass


def test_read_header_byte_source_reads_only_the_header():
    prefix, offs = build_header([("x", "U8", (1000,), 1000)])
    calls = []

    class Spy(_MemSource):
        def pread(self, offset, n):
            calls.append((offset, n))
            return super().pread(offset, n)

    h = read_header(Spy(prefix + bytes(1000)))
    assert h.tensors["x"].nbytes == 1000
    assert sum(n for _, n in calls) == len(prefix)


def test_read_header_rejects_other_objects():
    with pytest.raises(UsageError):
        read_header(12345)
    prefix, _ = build_header([("x", "U8", (3,), 3)])
    assert read_header(io.BytesIO(prefix + b"abc")).tensors["x"].nbytes == 3  # seekable, no descriptor
    with pytest.raises(TruncatedFileError):
        read_header(io.BytesIO(prefix + b"ab"))


def test_padding_alignment_for_many_name_lengths():
    for k in range(1, 40):
        prefix, _ = build_header([("t" * k, "U8", (k,), k)])
        n = struct.unpack("<Q", prefix[:8])[0]
        assert (8 + n) % 8 == 0
        js = prefix[8:]
        stripped = js.rstrip(b" ")
        assert stripped.endswith(b"}") and len(js) - len(stripped) < 8
        assert parse_header_json(js, source="m").tensors["t" * k].nbytes == k


def test_padding_with_other_whitespace_and_unpadded_are_valid():
    body = b'{"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    for js in (body, body + b" " * 13, body + b"\n\t "):
        assert parse_header_json(js, source="m", file_size=8 + len(js) + 2).data_size == 2


def test_metadata_rules():
    ok = parse_header_json(b'{"__metadata__":{"a":"1","b":""}}', source="m")
    assert ok.metadata == {"a": "1", "b": ""} and ok.tensors == {} and ok.data_size == 0
    assert parse_header_json(b'{"__metadata__":null}', source="m").metadata == {}  # as stock reads it
    for bad in (b'{"__metadata__":{"a":1}}', b'{"__metadata__":[]}', b'{"__metadata__":"x"}',
                b'{"__metadata__":{"a":null}}', b'{"__metadata__":{"a":{"b":"c"}}}'):
        with pytest.raises(InvalidFileError, match="__metadata__"):
            parse_header_json(bad, source="m")
    for bad in ({"a": 1}, ["a"], {1: "a"}):
        with pytest.raises(UsageError):
            build_header([], bad)
    assert build_header([], None)[0][8:].rstrip() == b"{}"


def test_build_header_refuses_bad_entries():
    with pytest.raises(UsageError):
        build_header([("a", "U8", (1,), 1), ("a", "U8", (1,), 1)])
    with pytest.raises(UsageError):
        build_header([("__metadata__", "U8", (1,), 1)])
    with pytest.raises(UnsupportedError):
        build_header([("a", "F3", (1,), 1)])
    with pytest.raises(ShapeError):
        build_header([("a", "F32", (2,), 4)])            # 8 bytes, not 4
    with pytest.raises(ShapeError):
        build_header([("a", "F4", (3,), 1)])             # 12 bits
    with pytest.raises(ShapeError):
        build_header([("a", "F4", (), 1)])
    with pytest.raises(ShapeError):
        build_header([("a", "U8", (-1,), 0)])
    with pytest.raises(ShapeError):
        build_header([("a", "U8", (True,), 1)])
    with pytest.raises(UsageError):
        build_header([("\ud800", "U8", (1,), 1)])        # lone surrogate: not UTF-8


def test_build_header_offsets_follow_given_order_and_unicode_names():
    prefix, offs = build_header([("z", "F32", (2,), 8), ("é层", "U8", (3,), 3), ("a", "BF16", (), 2)])
    assert offs == [(0, 8), (8, 11), (11, 13)]
    h = parse_header_json(_json_of(prefix), source="m", file_size=len(prefix) + 13)
    assert list(h.tensors) == ["z", "é层", "a"]


def test_empty_tensors_sharing_an_offset_keep_header_order():
    js = (b'{"b":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},'
          b'"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
          b'"a":{"dtype":"F32","shape":[0,5],"data_offsets":[0,0]}}')
    h = parse_header_json(js, source="m", file_size=8 + len(js) + 2)
    assert list(h.tensors) == ["b", "a", "x"]


def test_header_length_rules():
    assert parse_header_length(struct.pack("<Q", 10), source="f", file_size=18) == 10
    with pytest.raises(TruncatedFileError):
        parse_header_length(struct.pack("<Q", 11), source="f", file_size=18)
    with pytest.raises(TruncatedFileError):
        parse_header_length(b"\x01\x00", source="f")
    with pytest.raises(InvalidFileError, match="limit"):
        parse_header_length(struct.pack("<Q", MAX_HEADER_BYTES + 1), source="f")
    assert parse_header_length(struct.pack("<Q", MAX_HEADER_BYTES), source="f") == MAX_HEADER_BYTES
    with pytest.raises(InvalidFileError, match="limit"):
        parse_header_length(struct.pack("<Q", 100), source="f", max_header=99)
    with pytest.raises(InvalidFileError):
        parse_header_length(struct.pack("<Q", 0), source="f")


def test_errors_name_file_and_tensor():
    js = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}'
    with pytest.raises(InvalidFileError) as ei:
        parse_header_json(js, source="shard-7.safetensors")
    e = ei.value
    assert e.file == "shard-7.safetensors" and e.tensor == "w"
    assert "8" in str(e) and "4" in str(e)  # expected vs found


def test_dataclasses_are_frozen():
    t = TensorInfo("a", "U8", (2,), 0, 2)
    with pytest.raises(AttributeError):
        t.start = 1  # type: ignore[misc]
    h = Header({"a": t}, {}, 8)
    assert (h.data_start, h.data_size, h.file_size) == (16, 2, 18)
