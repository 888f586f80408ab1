"""Checkpoint reader: the three checkpoint kinds, bounded reads, index rules, path safety.

Fixture shards are written by the stock ``safetensors.numpy.save_file`` so the reader is
checked against an independent writer.
"""

from __future__ import annotations

import gzip
import json
import os
from importlib import resources
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from k3ckpt.errors import InvalidFileError, NotFoundError, ShapeError, UnsafePathError, UsageError
from k3ckpt.io import (
    ByteSource,
    LocalFile,
    checkpoint_from_sources,
    load_config,
    open_checkpoint,
    parse_index,
    save_file,
)

INDEX = "model.safetensors.index.json"


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"l{seed}.w": rng.standard_normal((6, 5)).astype(np.float32),
        f"l{seed}.bf": rng.standard_normal((4, 3)).astype(ml_dtypes.bfloat16),
        f"l{seed}.q": rng.integers(0, 256, (7, 16), dtype=np.uint8),
        f"l{seed}.s": np.array(seed, np.int64),
        f"l{seed}.e": np.zeros((0, 4), np.float16),
    }


def _write_sharded(d: Path, n: int = 2, *, config: dict | None = None) -> dict[str, np.ndarray]:
    d.mkdir(parents=True, exist_ok=True)
    allt: dict[str, np.ndarray] = {}
    wm = {}
    for i in range(n):
        t = _tensors(i)
        shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        safetensors.numpy.save_file(t, str(d / shard), metadata={"format": "pt"})
        allt.update(t)
        wm.update({k: shard for k in t})
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return allt


def _check_all(ck, tensors: dict[str, np.ndarray]) -> None:
    assert set(ck.tensors) == set(tensors)
    for name, arr in tensors.items():
        raw = ck.read_raw(name)
        assert raw.shape == arr.shape
        if arr.dtype == ml_dtypes.bfloat16:
            assert raw.dtype == np.uint16
            assert np.array_equal(raw.view(ml_dtypes.bfloat16), arr)
        else:
            assert raw.dtype == arr.dtype
            assert np.array_equal(raw, arr)
        assert ck.read_bytes(name) == arr.tobytes()
        assert raw.flags.writeable


def test_index_folder(tmp_path):
    tensors = _write_sharded(tmp_path, 3, config={"model_type": "toy", "n": 3})
    with open_checkpoint(tmp_path) as ck:
        assert ck.root == tmp_path
        assert ck.shards == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
        assert ck.config == {"model_type": "toy", "n": 3}
        assert ck.index_metadata == {"total_size": 1}
        _check_all(ck, tensors)
        # checkpoint order: shard order, then offset inside the shard
        order = [(ck.shards.index(e.shard), e.data_offset) for e in ck.tensors.values()]
        assert order == sorted(order)
        for s in ck.shards:
            assert ck.shard_size(s) == (tmp_path / s).stat().st_size
        e = ck.tensors["l1.w"]
        assert (e.name, e.dtype, e.shape, e.nbytes) == ("l1.w", "F32", (6, 5), 120)
        assert e.data_offset == ck.headers[e.shard].data_start + e.info.start
        assert ck.total_size == sum(a.nbytes for a in tensors.values())


def test_single_file_and_folder_without_index(tmp_path):
    t = _tensors(5)
    safetensors.numpy.save_file(t, str(tmp_path / "only.safetensors"))
    with open_checkpoint(tmp_path / "only.safetensors") as ck:
        assert ck.shards == ["only.safetensors"] and ck.config is None
        _check_all(ck, t)

    d = tmp_path / "noindex"
    d.mkdir()
    allt = {}
    for i in (10, 2, 1):  # natural order: 1, 2, 10
        ti = _tensors(i)
        safetensors.numpy.save_file(ti, str(d / f"part-{i}.safetensors"))
        allt.update(ti)
    (d / ".hidden.safetensors").write_bytes(b"junk")  # skipped
    (d / "notes.txt").write_text("x")
    with open_checkpoint(d) as ck:
        assert ck.shards == ["part-1.safetensors", "part-2.safetensors", "part-10.safetensors"]
        assert ck.index_metadata == {}
        _check_all(ck, allt)


def test_empty_folder_and_missing_path(tmp_path):
    with pytest.raises(NotFoundError):
        open_checkpoint(tmp_path)
    with pytest.raises(NotFoundError):
        open_checkpoint(tmp_path / "nope")


def test_rows_bytes_chunks(tmp_path):
    tensors = _write_sharded(tmp_path, 1)
    q = tensors["l0.q"]
    with open_checkpoint(tmp_path) as ck:
        assert np.array_equal(ck.read_rows("l0.q", 2, 5), q[2:5])
        assert ck.read_rows("l0.q", 3, 3).shape == (0, 16)
        assert np.array_equal(ck.read_rows("l0.bf", 1, 3).view(ml_dtypes.bfloat16), tensors["l0.bf"][1:3])
        assert ck.read_bytes("l0.q", 17, 40) == q.tobytes()[17:40]
        assert ck.read_bytes("l0.q", 40, 40) == b""
        for cb in (1, 7, 16, 112, 1000):
            chunks = list(ck.iter_chunks("l0.q", cb))
            assert b"".join(chunks) == q.tobytes()
            assert all(0 < len(c) <= cb for c in chunks)
        assert list(ck.iter_chunks("l0.e")) == []
        assert ck.read_raw("l0.e").shape == (0, 4)
        assert ck.read_raw("l0.s").shape == () and int(ck.read_raw("l0.s")) == 0
        with pytest.raises(NotFoundError):
            ck.read_raw("nope")
        with pytest.raises(UsageError):
            ck.read_bytes("l0.q", 5, 4)
        with pytest.raises(UsageError):
            ck.read_bytes("l0.q", 0, 113)
        with pytest.raises(UsageError):
            ck.read_rows("l0.q", 0, 8)
        with pytest.raises(ShapeError):
            ck.read_rows("l0.s", 0, 1)
        with pytest.raises(UsageError):
            list(ck.iter_chunks("l0.q", 0))


def test_sub_byte_dtype_reads_flat_bytes(tmp_path):
    packed = bytes(range(12))
    p = save_file(tmp_path / "f4.safetensors", {"w": ("F4", (4, 6), packed), "odd": ("F4", (2, 3), b"\x01\x02\x03")})
    with open_checkpoint(p) as ck:
        raw = ck.read_raw("w")
        assert raw.dtype == np.uint8 and raw.shape == (12,) and raw.tobytes() == packed
        assert ck.read_rows("w", 1, 3).tobytes() == packed[3:9]
        with pytest.raises(ShapeError):
            ck.read_rows("odd", 0, 1)  # a row of 3 F4 elements is 1.5 bytes


class MemSource:
    """An in-memory ByteSource with only pread (like a remote range reader)."""

    def __init__(self, name: str, blob: bytes):
        self.name, self.size, self.blob = name, len(blob), blob
        self.read = 0
        self.closed = False

    def pread(self, offset: int, n: int) -> bytes:
        self.read += n
        return self.blob[offset: offset + n]

    def close(self) -> None:
        self.closed = True


def test_sources_without_local_files(tmp_path):
    tensors = _write_sharded(tmp_path, 2)
    index = json.loads((tmp_path / INDEX).read_text())
    srcs = {n: MemSource(n, (tmp_path / n).read_bytes()) for n in sorted(set(index["weight_map"].values()))}
    assert all(isinstance(s, ByteSource) for s in srcs.values())
    ck = checkpoint_from_sources(index, dict(srcs), {"a": 1})
    assert ck.root is None and ck.config == {"a": 1}
    # opening read only headers
    assert all(s.read == ck.headers[n].data_start for n, s in srcs.items())
    _check_all(ck, tensors)
    ck.close()
    assert all(s.closed for s in srcs.values())


def test_opener_is_used_and_open_reads_headers_only(tmp_path):
    _write_sharded(tmp_path, 2)
    made = {}

    def opener(name):
        made[name] = MemSource(name, (tmp_path / name).read_bytes())
        return made[name]

    with open_checkpoint(tmp_path, opener=opener) as ck:
        assert sorted(made) == ck.shards
        assert all(made[s].read == ck.headers[s].data_start for s in ck.shards)


def test_local_file_reads(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(100)))
    f = LocalFile(p)
    assert f.name == "f.bin" and f.size == 100
    assert f.pread(10, 5) == bytes(range(10, 15))
    buf = bytearray(3)
    f.pread_into(97, memoryview(buf))
    assert bytes(buf) == b"\x61\x62\x63"
    with pytest.raises(InvalidFileError):  # TruncatedFileError
        f.pread(98, 5)
    f.close()
    f.close()
    with pytest.raises(NotFoundError):
        LocalFile(tmp_path / "missing")


def test_close_releases_descriptors(tmp_path):
    _write_sharded(tmp_path, 2)
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    ck = open_checkpoint(tmp_path)
    ck.read_raw("l1.w")
    ck.close()
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before


# ---- index rules --------------------------------------------------------------------


def _set_index(d: Path, mutate) -> None:
    index = json.loads((d / INDEX).read_text())
    mutate(index)
    (d / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("bad", ["../x.safetensors", "/tmp/x.safetensors", "sub/../../x.safetensors",
                                 "./model.safetensors", "a//b.safetensors", "..\\x.safetensors", "C:x"])
def test_index_path_tricks_refused(tmp_path, bad):
    d = tmp_path / "ck"
    _write_sharded(d, 1)
    (tmp_path / "x.safetensors").write_bytes((d / "model-00001-of-00001.safetensors").read_bytes())
    _set_index(d, lambda ix: ix["weight_map"].update({"l0.w": bad}))
    with pytest.raises(UnsafePathError):
        open_checkpoint(d)


def test_symlink_leaving_folder_refused_inside_allowed(tmp_path):
    d = tmp_path / "ck"
    _write_sharded(d, 1)
    shard = "model-00001-of-00001.safetensors"
    outside = tmp_path / "outside.safetensors"
    os.replace(d / shard, outside)
    os.symlink(outside, d / shard)
    with pytest.raises(UnsafePathError, match="outside"):
        open_checkpoint(d)
    os.unlink(d / shard)
    (d / "store").mkdir()
    os.replace(outside, d / "store" / "real.safetensors")
    os.symlink("store/real.safetensors", d / shard)  # relative link that stays inside: fine
    with open_checkpoint(d) as ck:
        assert "l0.w" in ck
    # no index: a link in the folder that leaves it is refused too
    d2 = tmp_path / "noindex"
    d2.mkdir()
    os.symlink(d / "store" / "real.safetensors", d2 / "a.safetensors")
    with pytest.raises(UnsafePathError):
        open_checkpoint(d2)


def test_hf_cache_snapshot_links_into_blobs_allowed(tmp_path):
    repo = tmp_path / "models--org--name"
    blobs = repo / "blobs"
    snap = repo / "snapshots" / "abc123"
    _write_sharded(tmp_path / "src", 1)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in ("model-00001-of-00001.safetensors", INDEX):
        os.replace(tmp_path / "src" / name, blobs / f"sha-{len(name)}")
        os.symlink(f"../../blobs/sha-{len(name)}", snap / name)
    with open_checkpoint(snap) as ck:
        assert np.array_equal(ck.read_raw("l0.q"), _tensors(0)["l0.q"])


def test_subfolder_shard_names_are_allowed(tmp_path):
    d = tmp_path / "ck"
    _write_sharded(d, 1)
    (d / "sub").mkdir()
    os.replace(d / "model-00001-of-00001.safetensors", d / "sub" / "s.safetensors")
    _set_index(d, lambda ix: ix.update(weight_map={k: "sub/s.safetensors" for k in ix["weight_map"]}))
    with open_checkpoint(d) as ck:
        assert ck.shards == ["sub/s.safetensors"]


def test_missing_shard(tmp_path):
    _write_sharded(tmp_path, 2)
    os.unlink(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(NotFoundError, match="missing"):
        open_checkpoint(tmp_path)


def test_index_lists_tensor_no_header_holds(tmp_path):
    _write_sharded(tmp_path, 2)
    _set_index(tmp_path, lambda ix: ix["weight_map"].update({"ghost": "model-00001-of-00002.safetensors"}))
    with pytest.raises(InvalidFileError, match="does not hold") as ei:
        open_checkpoint(tmp_path)
    assert ei.value.tensor == "ghost" and "model-00001-of-00002" in str(ei.value)


def test_header_tensor_not_in_index(tmp_path):
    _write_sharded(tmp_path, 2)
    _set_index(tmp_path, lambda ix: ix["weight_map"].pop("l1.q"))
    with pytest.raises(InvalidFileError, match="does not list") as ei:
        open_checkpoint(tmp_path)
    assert ei.value.tensor == "l1.q"


def test_tensor_listed_for_other_shard(tmp_path):
    _write_sharded(tmp_path, 2)
    _set_index(tmp_path, lambda ix: ix["weight_map"].update({"l1.q": "model-00001-of-00002.safetensors"}))
    with pytest.raises(InvalidFileError) as ei:
        open_checkpoint(tmp_path)
    msg = str(ei.value)
    assert "model-00001-of-00002" in msg and "model-00002-of-00002" in msg and ei.value.tensor == "l1.q"


def test_tensor_in_two_shards(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    safetensors.numpy.save_file({"a": np.zeros(2), "dup": np.ones(3)}, str(d / "x1.safetensors"))
    safetensors.numpy.save_file({"b": np.zeros(2), "dup": np.ones(3)}, str(d / "x2.safetensors"))
    with pytest.raises(InvalidFileError, match="both") as ei:
        open_checkpoint(d)
    assert "x1.safetensors" in str(ei.value) and "x2.safetensors" in str(ei.value)


@pytest.mark.parametrize("index_text", [
    "[]", '{"weight_map": []}', '{"metadata": {}}', '{"weight_map": {"a": 3}}', '{"weight_map": {"a": ""}}',
    '{"weight_map": {}, "metadata": 5}', '{"weight_map": {"a": "x", "a": "y"}}', "{bad json", "\xff",
])
def test_bad_index_json(tmp_path, index_text):
    _write_sharded(tmp_path, 1)
    (tmp_path / INDEX).write_bytes(index_text.encode("latin-1"))
    with pytest.raises(InvalidFileError):
        open_checkpoint(tmp_path)


def test_config_json(tmp_path):
    _write_sharded(tmp_path, 1, config={"a": {"b": [1, 2.5, None]}})
    with open_checkpoint(tmp_path) as ck:
        assert ck.config == {"a": {"b": [1, 2.5, None]}}
    for bad in (b"{not json", b"[1, 2]", b'{"x": NaN}', b'{"a": 1, "a": 2}', b"\xfe\xff"):
        (tmp_path / "config.json").write_bytes(bad)
        with pytest.raises(InvalidFileError) as ei:
            open_checkpoint(tmp_path)
        assert "config.json" in str(ei.value)


def test_packaged_k3_index_and_config_pass_the_rules():
    data = resources.files("k3ckpt") / "data"
    index = json.loads(gzip.decompress((data / "k3_index.json.gz").read_bytes()))
    wm, meta = parse_index(index, source="k3_index.json")
    shards = set(wm.values())
    assert len(shards) == 96 and len(wm) == 497_220
    assert meta["total_size"] == 1_560_860_324_864
    with resources.as_file(data / "k3_config.json") as p:
        cfg = load_config(p)
    assert "text_config" in cfg
