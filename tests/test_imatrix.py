"""k3ckpt.imatrix: llama.cpp importance matrices written by hand (GGUF with gguf.GGUFWriter, the
legacy .dat with struct) and read back as llama-quantize normalises them; one-line errors."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from k3ckpt.errors import InvalidFileError, NotFoundError, UsageError
from k3ckpt.imatrix import Imatrix, ImatrixEntry, read_imatrix

UP = "blk.3.ffn_up_exps.weight"
Q = "blk.0.attn_q.weight"


def write_gguf(path, entries, *, kind="imatrix", datasets=("calib.txt",), chunk_count=7, chunk_size=512,
               dtype=np.float32, skip=()):
    """entries: name -> (sums [n_mat, n_per_row], counts [n_mat]); ``skip`` leaves tensors out."""
    w = gguf.GGUFWriter(path, "llama")
    if kind is not None:
        w.add_type(kind)
    if datasets is not None:
        w.add_array("imatrix.datasets", list(datasets))
    w.add_uint32("imatrix.chunk_count", chunk_count)
    w.add_uint32("imatrix.chunk_size", chunk_size)
    for name, (sums, counts) in entries.items():
        if name + ".in_sum2" not in skip:
            w.add_tensor(name + ".in_sum2", np.asarray(sums, dtype))
        if name + ".counts" not in skip:
            w.add_tensor(name + ".counts", np.asarray(counts, np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def legacy_bytes(entries, *, chunk_count=None, dataset=None) -> bytes:
    """entries: name -> (ncall, values); the layout of llama.cpp's save_imatrix_legacy."""
    out = [struct.pack("<i", len(entries))]
    for name, (ncall, vals) in entries.items():
        raw = name.encode()
        vals = np.asarray(vals, "<f4")
        out += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, vals.size), vals.tobytes()]
    if chunk_count is not None:
        out.append(struct.pack("<i", chunk_count))
        if dataset is not None:
            out += [struct.pack("<i", len(dataset.encode())), dataset.encode()]
    return b"".join(out)


@pytest.fixture
def gguf_file(tmp_path):
    rng = np.random.default_rng(0)
    sums = (rng.random((4, 256)) * 100).astype(np.float32)
    return write_gguf(tmp_path / "im.gguf", {
        UP: (sums, [10, 0, 3, 1]),                              # four experts, one never routed to
        Q: (np.full((1, 512), 6.0, np.float32), [3]),
    }), sums


# ---------------------------------------------------------------------- GGUF
def test_gguf_values_are_divided_by_their_counts(gguf_file):
    path, sums = gguf_file
    im = read_imatrix(path)
    assert isinstance(im, Imatrix) and im.kind == "gguf"
    assert im.names == (Q, UP) and len(im) == 2 and UP in im
    assert (im.datasets, im.chunk_count, im.chunk_size) == (("calib.txt",), 7, 512)
    e = im.entry(UP)
    assert isinstance(e, ImatrixEntry) and (e.n_mat, e.n_per_row) == (4, 256) and e.counts == (10, 0, 3, 1)
    assert e.values.dtype == np.float32 and not e.values.flags.writeable
    assert np.array_equal(e.values[0], sums[0] / np.float32(10))
    assert np.array_equal(e.values[1], np.ones(256, np.float32))        # count 0: all ones
    assert np.array_equal(e.values[2], sums[2] / np.float32(3))
    assert np.array_equal(e.values[3], sums[3])
    assert np.array_equal(im.columns(Q, 512), np.full(512, 2.0, np.float32))
    assert np.array_equal(im.columns(UP, 256, expert=2), e.values[2])


def test_gguf_counts_round_to_the_nearest_integer(tmp_path):
    path = write_gguf(tmp_path / "r.gguf", {Q: (np.full((2, 8), 9.0), [2.6, 0.4])})
    e = read_imatrix(path).entry(Q)
    assert e.counts == (3, 0)
    assert np.array_equal(e.values, np.stack([np.full(8, 3.0), np.ones(8)]).astype(np.float32))


def test_columns_refuses_what_does_not_fit(gguf_file):
    im = read_imatrix(gguf_file[0])
    with pytest.raises(UsageError, match="pass expert="):
        im.columns(UP, 256)
    with pytest.raises(UsageError, match="no expert 4"):
        im.columns(UP, 256, expert=4)
    with pytest.raises(UsageError, match="not a multiple of rows of 300"):
        im.columns(UP, 300, expert=0)
    with pytest.raises(NotFoundError, match="no importance entry 'blk.9.ffn_up_exps.weight'"):
        im.entry("blk.9.ffn_up_exps.weight")


@pytest.mark.parametrize("case, match", [
    ("model", "general.type is 'model', not 'imatrix'"),
    ("notype", "general.type is None"),
    ("nocounts", "has no .counts tensor"),
    ("nosums", "has no .in_sum2 tensor"),
    ("f16", "is F16, not F32"),
    ("shape", r"expected \{1, 2\}"),
    ("negative", "negative or non-finite counts"),
    ("nan", "non-finite values"),
    ("empty", "no importance data"),
])
def test_gguf_bad_files_are_one_line_errors(tmp_path, case, match):
    path = tmp_path / f"{case}.gguf"
    good = {Q: (np.ones((2, 8)), [1, 2])}
    if case == "model":
        write_gguf(path, good, kind="model")
    elif case == "notype":
        write_gguf(path, good, kind=None)
    elif case == "nocounts":
        write_gguf(path, good, skip=(Q + ".counts",))
    elif case == "nosums":
        write_gguf(path, good, skip=(Q + ".in_sum2",))
    elif case == "f16":
        write_gguf(path, good, dtype=np.float16)
    elif case == "shape":
        write_gguf(path, {Q: (np.ones((2, 8)), [1, 2, 3])})
    elif case == "negative":
        write_gguf(path, {Q: (np.ones((2, 8)), [1, -2])})
    elif case == "nan":
        write_gguf(path, {Q: (np.full((2, 8), np.nan), [1, 2])})
    else:
        write_gguf(path, {})
    with pytest.raises(InvalidFileError, match=match) as err:
        read_imatrix(path).entry(Q)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_truncated_gguf_is_an_error(tmp_path, gguf_file):
    data = open(gguf_file[0], "rb").read()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:100])
    with pytest.raises(InvalidFileError, match="not a readable GGUF file"):
        read_imatrix(bad)


# -------------------------------------------------------------------- legacy
def test_legacy_values_are_divided_by_ncall(tmp_path):
    rng = np.random.default_rng(1)
    # as llama.cpp writes them: (sum / count) * ncall per value, experts concatenated
    raw_sums = rng.random(3 * 64).astype(np.float32) * 50
    counts = np.array([4, 8, 2], np.float32)
    ncall = 5
    stored = (raw_sums / np.repeat(counts, 64)) * np.float32(ncall)
    path = tmp_path / "im.dat"
    path.write_bytes(legacy_bytes({UP: (ncall, stored), Q: (0, np.full(16, 2.5))}, chunk_count=12,
                                  dataset="wiki.train.raw"))
    im = read_imatrix(path)
    assert im.kind == "legacy" and im.names == (Q, UP)
    assert (im.datasets, im.chunk_count, im.chunk_size) == (("wiki.train.raw",), 12, 0)
    e = im.entry(UP)
    assert (e.n_mat, e.n_per_row) == (1, 192) and e.counts == (5,)
    assert np.array_equal(e.values[0], (stored / np.float32(ncall)).astype(np.float32))
    np.testing.assert_allclose(im.columns(UP, 64, expert=1), raw_sums[64:128] / 8, rtol=1e-6)
    assert np.array_equal(im.columns(Q, 16), np.full(16, 2.5, np.float32))   # ncall 0: as stored


@pytest.mark.parametrize("tail", ["none", "count", "count+name"])
def test_legacy_trailer_is_optional(tmp_path, tail):
    kw = {"none": {}, "count": {"chunk_count": 3}, "count+name": {"chunk_count": 3, "dataset": "d"}}[tail]
    path = tmp_path / "t.dat"
    path.write_bytes(legacy_bytes({Q: (1, np.ones(8))}, **kw))
    im = read_imatrix(path)
    assert im.chunk_count == (0 if tail == "none" else 3)
    assert im.datasets == (("d",) if tail == "count+name" else ())


@pytest.mark.parametrize("case, match", [
    ("empty", "shorter than its entry count"),
    ("zero", "entry count 0"),
    ("cut-values", "ends inside entry 'blk.0.attn_q.weight'"),
    ("cut-name", "ends inside entry 0's name"),
    ("name-length", "name length -3"),
    ("garbage", "does not end the file"),
    ("twice", "appears twice"),
    ("nval", "0 values"),
])
def test_legacy_bad_files_are_one_line_errors(tmp_path, case, match):
    good = legacy_bytes({Q: (1, np.ones(8))}, chunk_count=1, dataset="d")
    data = {
        "empty": b"",
        "zero": struct.pack("<i", 0),
        "cut-values": good[:40],
        "cut-name": good[:10],
        "name-length": struct.pack("<ii", 1, -3),
        "garbage": good + b"xx",
        "twice": legacy_bytes({Q: (1, np.ones(8))})[4:],
        "nval": struct.pack("<ii", 1, len(Q)) + Q.encode() + struct.pack("<ii", 1, 0),
    }[case]
    if case == "twice":
        data = struct.pack("<i", 2) + data + data
    path = tmp_path / f"{case}.dat"
    path.write_bytes(data)
    with pytest.raises(InvalidFileError, match=match) as err:
        read_imatrix(path)
    assert "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(NotFoundError, match="no such importance-matrix file"):
        read_imatrix(tmp_path / "nope.gguf")


def test_an_entry_drives_the_encoders(gguf_file):
    # the importance of expert 2 of a stacked tensor, given to the Q2_K encoder as its per-column weights
    from k3ckpt.requant import q2_k

    im = read_imatrix(gguf_file[0])
    x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    cols = im.columns(UP, 256, expert=2)
    assert np.array_equal(q2_k.encode(x, imatrix=cols), q2_k.encode_reference(x, imatrix=cols))
    assert not np.array_equal(q2_k.encode(x, imatrix=cols), q2_k.encode(x))
