"""ShardedWriter and save_file: layout, streaming, atomicity, and stock-reader compatibility."""

from __future__ import annotations

import json
import os
import stat

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from k3ckpt.errors import OutputExistsError, ShapeError, UnsupportedError, UsageError
from k3ckpt.io import ShardedWriter, TensorSpec, open_checkpoint, read_header, save_file


def _rng_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _listing(d) -> list[str]:
    return sorted(os.listdir(d))


SPECS = [
    TensorSpec("emb", "F32", (10, 4)),      # 160 B
    TensorSpec("l0.w", "BF16", (30,)),      # 60 B
    TensorSpec("l0.s", "U8", (50,)),        # 50 B
    TensorSpec("l1.w", "F16", (100,)),      # 200 B (alone: bigger than the limit)
    TensorSpec("empty", "I32", (0, 3)),     # 0 B
    TensorSpec("head", "F64", (5,)),        # 40 B
]


def test_multi_shard_layout_naming_index(tmp_path):
    data = {s.name: _rng_bytes(s.nbytes, i) for i, s in enumerate(SPECS)}
    w = ShardedWriter(tmp_path, SPECS, max_shard_bytes=219, metadata={"format": "pt"})
    # greedy: [emb 160] +60 would pass 219 -> new; [l0.w 60, l0.s 50] 110 +200 -> new;
    # [l1.w 200] +0 fits, +40 passes -> new; [head]
    assert w.shards == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    assert [w.shard_of[s.name] for s in SPECS] == [w.shards[i] for i in (0, 1, 1, 2, 2, 3)]
    for name in reversed(list(data)):
        w.write(name, data[name])
    paths = w.close()
    assert paths == [tmp_path / n for n in w.shards] + [tmp_path / "model.safetensors.index.json"]
    assert _listing(tmp_path) == sorted(w.shards + ["model.safetensors.index.json"])
    assert paths[-1].name == "model.safetensors.index.json"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": sum(s.nbytes for s in SPECS)},
                     "weight_map": {s.name: w.shard_of[s.name] for s in SPECS}}
    raw_index = (tmp_path / "model.safetensors.index.json").read_text()
    assert raw_index == json.dumps(index, indent=2, sort_keys=True) + "\n"
    with open_checkpoint(tmp_path) as ck:
        assert list(ck.tensors) == [s.name for s in SPECS]
        for s in SPECS:
            assert ck.read_bytes(s.name) == data[s.name]
            assert ck.headers[ck.tensors[s.name].shard].metadata == {"format": "pt"}


def test_template_count_and_single_shard_has_no_index(tmp_path):
    specs = [TensorSpec("a", "U8", (4,))]
    with ShardedWriter(tmp_path, specs, name_template="part{index}of{count}.safetensors") as w:
        w.write("a", b"abcd")
    assert _listing(tmp_path) == ["part1of1.safetensors"]
    d2 = tmp_path / "forced"
    with ShardedWriter(d2, specs, write_index=True) as w:
        w.write("a", b"abcd")
    assert json.loads((d2 / "model.safetensors.index.json").read_text())["weight_map"] == {
        "a": "model-00001-of-00001.safetensors"}


def test_out_of_order_chunks_and_overlap(tmp_path):
    spec = TensorSpec("big", "U8", (1000,))
    payload = _rng_bytes(1000, 7)
    with ShardedWriter(tmp_path, [spec, TensorSpec("x", "F32", (3,))]) as w:
        cuts = [0, 130, 131, 500, 999, 1000]
        pieces = [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)]
        for a, b in reversed(pieces):
            w.write_chunk("big", a, payload[a:b])
            assert "big" in w.missing() or (a, b) == pieces[0]
        w.write_chunk("x", 4, np.array([2.0, 3.0], np.float32))
        w.write_chunk("x", 0, np.array([1.0, 2.0], np.float32))  # overlaps the first chunk: allowed
        assert w.missing() == {}
        with pytest.raises(UsageError, match="already"):
            w.write_chunk("big", 0, b"z")
    with safe_open(str(tmp_path / "model-00001-of-00001.safetensors"), framework="numpy") as f:
        assert f.get_tensor("big").tobytes() == payload
        assert f.get_tensor("x").tolist() == [1.0, 2.0, 3.0]


def test_shard_is_final_as_soon_as_complete(tmp_path):
    specs = [TensorSpec("a", "U8", (8,)), TensorSpec("b", "U8", (8,))]
    w = ShardedWriter(tmp_path, specs, max_shard_bytes=8)
    w.write("b", b"B" * 8)
    assert _listing(tmp_path) == ["model-00002-of-00002.safetensors"]  # shard 1 not even opened yet
    w.write("a", b"A" * 8)
    assert "model-00001-of-00002.safetensors" in _listing(tmp_path)
    assert "model.safetensors.index.json" not in _listing(tmp_path)  # index only at close
    w.close()
    assert "model.safetensors.index.json" in _listing(tmp_path)


def test_abort_leaves_nothing(tmp_path):
    specs = [TensorSpec("a", "U8", (8,)), TensorSpec("b", "U8", (8,))]
    w = ShardedWriter(tmp_path, specs)
    w.write_chunk("a", 0, b"1234")
    assert _listing(tmp_path) == [".model-00001-of-00001.safetensors.partial"]
    w.abort()
    assert _listing(tmp_path) == []
    with pytest.raises(UsageError):
        w.write("b", b"x" * 8)


def test_exception_inside_with_leaves_no_final_name(tmp_path):
    specs = [TensorSpec("a", "U8", (8,)), TensorSpec("b", "U8", (8,))]
    with pytest.raises(RuntimeError):
        with ShardedWriter(tmp_path, specs) as w:
            w.write("a", b"A" * 8)
            raise RuntimeError("boom")
    assert _listing(tmp_path) == []


def test_close_with_missing_bytes_aborts(tmp_path):
    with pytest.raises(ShapeError, match="lacks 3 bytes"):
        with ShardedWriter(tmp_path, [TensorSpec("a", "U8", (8,))]) as w:
            w.write_chunk("a", 0, b"12345")
    assert _listing(tmp_path) == []


def test_abort_keeps_shards_already_final(tmp_path):
    specs = [TensorSpec("a", "U8", (8,)), TensorSpec("b", "U8", (8,))]
    w = ShardedWriter(tmp_path, specs, max_shard_bytes=8)
    w.write("a", b"A" * 8)
    w.abort()
    assert _listing(tmp_path) == ["model-00001-of-00002.safetensors"]


def test_mode_0644_and_loads_with_stock_reader(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal(7).astype(np.float16),
        "i64": rng.integers(-9, 9, (2, 2)).astype(np.int64),
        "bool": rng.integers(0, 2, 6).astype(bool),
        "bf16": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
        "scalar": np.array(1.5, np.float64),
        "c64": (rng.standard_normal(3) + 1j).astype(np.complex64),
        "strided": np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2],
    }
    p = save_file(tmp_path / "m.safetensors", arrays, metadata={"format": "np"})
    assert stat.S_IMODE(p.stat().st_mode) == 0o644
    assert _listing(tmp_path) == ["m.safetensors"]
    with safe_open(str(p), framework="numpy") as f:
        assert f.metadata() == {"format": "np"}
        for k, v in arrays.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert got.tobytes() == v.tobytes()
    assert read_header(p).data_start % 8 == 0


def test_save_file_raw_tuple_and_sub_byte(tmp_path):
    p = save_file(tmp_path / "q{x}.safetensors", {"w": ("F4", (2, 4), b"\x21\x43\x65\x87"),
                                                  "s": ("F8_E8M0", (2,), b"\x7f\x80")})
    assert p.name == "q{x}.safetensors" and p.exists()
    h = read_header(p)
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in h.tensors.values()] == [
        ("w", "F4", (2, 4), 4), ("s", "F8_E8M0", (2,), 2)]
    with open_checkpoint(p) as ck:
        assert ck.read_bytes("w") == b"\x21\x43\x65\x87"


def test_save_file_overwrites_by_default_writer_refuses(tmp_path):
    p = tmp_path / "a.safetensors"
    save_file(p, {"x": np.zeros(2, np.uint8)})
    save_file(p, {"x": np.ones(3, np.uint8)})
    assert read_header(p).tensors["x"].shape == (3,)
    with pytest.raises(OutputExistsError):
        save_file(p, {"x": np.ones(3, np.uint8)}, overwrite=False)
    with pytest.raises(OutputExistsError):
        ShardedWriter(tmp_path, [TensorSpec("x", "U8", (1,))], name_template="a.safetensors")


def test_refusals(tmp_path):
    with pytest.raises(UsageError, match="twice"):
        ShardedWriter(tmp_path, [TensorSpec("a", "U8", (1,)), TensorSpec("a", "U8", (2,))])
    with pytest.raises(UnsupportedError):
        TensorSpec("a", "F12", (1,))
    with pytest.raises(ShapeError):
        TensorSpec("a", "F4", (3,))
    with pytest.raises(ShapeError):
        TensorSpec("a", "U8", (-2,))
    with pytest.raises(UsageError):
        ShardedWriter(tmp_path, [TensorSpec("a", "U8", (1,))], max_shard_bytes=0)
    with pytest.raises(UsageError):
        ShardedWriter(tmp_path, [TensorSpec("a", "U8", (1,)), TensorSpec("b", "U8", (1,))],
                      max_shard_bytes=1, name_template="same.safetensors")
    for bad in ("../x-{index}.safetensors", "/abs-{index}.safetensors"):
        with pytest.raises(PermissionError):
            ShardedWriter(tmp_path, [TensorSpec("a", "U8", (1,))], name_template=bad)
    w = ShardedWriter(tmp_path, [TensorSpec("a", "F32", (4,))])
    with pytest.raises(UsageError, match="not in"):
        w.write("nope", b"1234")
    with pytest.raises(ShapeError):
        w.write("a", b"123")                                 # wrong size
    with pytest.raises(ShapeError):
        w.write("a", np.zeros(5, np.float32))
    with pytest.raises(ShapeError, match="passes"):
        w.write_chunk("a", 14, b"123")                       # past the end
    with pytest.raises(UsageError):
        w.write_chunk("a", -1, b"1")
    with pytest.raises(UsageError, match="contiguous"):
        w.write("a", np.zeros(8, np.float32)[::2])
    with pytest.raises(UsageError, match="big-endian"):
        w.write("a", np.zeros(4, ">f4"))
    w.abort()
    assert _listing(tmp_path) == []


def test_shard_of_only_empty_tensors_and_no_tensors(tmp_path):
    with ShardedWriter(tmp_path / "e", [TensorSpec("e", "U8", (0,))]) as w:
        pass
    assert read_header(tmp_path / "e" / w.shards[0]).tensors["e"].nbytes == 0
    with ShardedWriter(tmp_path / "n", []) as w:
        pass
    h = read_header(tmp_path / "n" / w.shards[0])
    assert h.tensors == {} and h.file_size == 16


def test_layout_edge_exactly_at_limit(tmp_path):
    specs = [TensorSpec("a", "U8", (60,)), TensorSpec("b", "U8", (40,)), TensorSpec("c", "U8", (1,))]
    w = ShardedWriter(tmp_path, specs, max_shard_bytes=100)
    assert [w.shard_of[n] for n in "abc"] == [w.shards[0], w.shards[0], w.shards[1]]  # 100 fits, 101 passes
    w.abort()


def test_concurrent_chunk_writes(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    specs = [TensorSpec(f"t{i}", "U8", (4096,)) for i in range(6)]
    payload = {s.name: _rng_bytes(4096, i) for i, s in enumerate(specs)}
    jobs = [(s.name, off) for s in specs for off in range(0, 4096, 512)]
    np.random.default_rng(0).shuffle(jobs)
    with ShardedWriter(tmp_path, specs, max_shard_bytes=8192) as w:
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda j: w.write_chunk(j[0], j[1], payload[j[0]][j[1]: j[1] + 512]), jobs))
    with open_checkpoint(tmp_path) as ck:
        assert all(ck.read_bytes(n) == payload[n] for n in payload)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hash_shards_while_writing(tmp_path, monkeypatch, seed):
    """hash_shards: each shard's sha256 is ready when it turns final and equals a fresh hash of
    the file, whatever order and chunking the writes come in (small steps force many pieces)."""
    import hashlib
    import threading

    from k3ckpt.io import _prefix_hash

    monkeypatch.setattr(_prefix_hash, "_STEP", 7)
    monkeypatch.setattr(_prefix_hash, "_CHUNK", 5)
    specs = SPECS + [TensorSpec("empty2", "F32", (0,)), TensorSpec("tail", "U8", (333,))]
    data = {s.name: _rng_bytes(s.nbytes, i + seed) for i, s in enumerate(specs)}
    seen = {}
    with ShardedWriter(tmp_path, specs, max_shard_bytes=300, hash_shards=True,
                       on_shard_final=lambda p: seen.setdefault(p.name, w.sha256[p.name])) as w:
        rng = np.random.default_rng(seed)
        pieces = [(s.name, o, min(o + 23, s.nbytes)) for s in specs for o in range(0, s.nbytes, 23)]
        for i in rng.permutation(len(pieces)):
            name, a, b = pieces[i]
            w.write_chunk(name, a, data[name][a:b])
    assert set(seen) == set(w.shards) and len(w.shards) > 2
    for name, digest in seen.items():
        assert digest == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
    assert not [t for t in threading.enumerate() if t.name == "k3ckpt-hash"]


def test_place_and_mark_written_for_a_writer_elsewhere(tmp_path):
    """place(name) gives another process a (temporary file, offset) to write the tensor into;
    mark_written records it, and the shard turns final with those bytes and a matching hash."""
    import hashlib
    import multiprocessing

    from k3ckpt.requant.worker import write_at   # what requant's pool workers call

    data = {s.name: _rng_bytes(s.nbytes, i) for i, s in enumerate(SPECS)}
    with ShardedWriter(tmp_path, SPECS, max_shard_bytes=300, hash_shards=True) as w:
        with pytest.raises(UsageError, match="0 bytes"):
            w.place("empty")
        for s in SPECS:
            if s.nbytes == 0:
                continue
            path, offset = w.place(s.name)
            assert os.path.basename(path).endswith(".partial") and w.needs(s.name)
            ctx = multiprocessing.get_context("spawn")
            p = ctx.Process(target=write_at, args=(path, offset, np.frombuffer(data[s.name], np.uint8)))
            p.start()
            p.join()
            assert p.exitcode == 0
            w.mark_written(s.name)
            assert not w.needs(s.name)
    for p in w.shards:
        assert w.sha256[p] == hashlib.sha256((tmp_path / p).read_bytes()).hexdigest()
    with open_checkpoint(tmp_path) as ck:
        for s in SPECS:
            assert ck.read_bytes(s.name) == data[s.name]


def test_whole_shards_written_elsewhere_are_adopted(tmp_path):
    """shard_layout tells another writer a shard's header and tensor order; the file it writes under
    the final name is adopted (size and header checked), reported with its hash, and the index comes
    at close as for shards written here."""
    import hashlib

    from k3ckpt.io.writer import atomic_write_bytes

    data = {s.name: _rng_bytes(s.nbytes, i) for i, s in enumerate(SPECS)}
    final = []
    reference = tmp_path / "here"
    with ShardedWriter(reference, SPECS, max_shard_bytes=219) as w:
        for s in SPECS:
            w.write(s.name, data[s.name])
    out = tmp_path / "elsewhere"
    w = ShardedWriter(out, SPECS, max_shard_bytes=219, on_shard_final=lambda p: final.append(p.name))
    assert w.unwritten() == w.shards
    w.write("head", data["head"])                      # one shard written here, as usual
    assert w.unwritten() == w.shards[:3]
    for name in w.unwritten():
        prefix, tensors = w.shard_layout(name)
        whole = prefix + b"".join(data[t] for t in tensors)
        atomic_write_bytes(out / name, whole)
        w.adopt(name, hashlib.sha256(whole).hexdigest())
        with pytest.raises(UsageError, match="already final"):
            w.adopt(name, "0" * 64)
    assert w.unwritten() == [] and not w.missing() and sorted(final) == w.shards
    w.close()
    assert {p: (out / p).read_bytes() for p in _listing(out)} == {p: (reference / p).read_bytes()
                                                                  for p in _listing(reference)}
    assert w.sha256[w.shards[0]] == hashlib.sha256((out / w.shards[0]).read_bytes()).hexdigest()


def test_adopt_checks_what_another_writer_left(tmp_path):
    w = ShardedWriter(tmp_path, SPECS, max_shard_bytes=219)
    name = w.shards[0]
    with pytest.raises(ShapeError, match="is missing"):
        w.adopt(name, "0" * 64)
    prefix, tensors = w.shard_layout(name)
    (tmp_path / name).write_bytes(prefix + b"\0" * (sum(w.specs[t].nbytes for t in tensors) - 1))
    with pytest.raises(ShapeError, match="does not match this layout"):
        w.adopt(name, "0" * 64)
    with pytest.raises(UsageError, match="no shard"):
        w.shard_layout("model-9.safetensors")
    assert w.unwritten() == w.shards
    w.abort()


def test_mark_written_false_records_nothing(tmp_path):
    specs = [TensorSpec("a", "U8", (8,)), TensorSpec("b", "U8", (8,))]
    w = ShardedWriter(tmp_path, specs)
    w.place("a")
    w.mark_written("a", written=False)
    assert w.needs("a")
    w.write("b", b"\1" * 8)
    with pytest.raises(ShapeError, match="lacks 8 bytes"):
        w.close()
    assert _listing(tmp_path) == []


def test_hash_shards_abort_stops_the_hasher(tmp_path):
    import threading

    w = ShardedWriter(tmp_path, SPECS, max_shard_bytes=300, hash_shards=True)
    w.write_chunk("emb", 0, _rng_bytes(80))
    assert [t for t in threading.enumerate() if t.name == "k3ckpt-hash"]
    w.abort()
    assert not [t for t in threading.enumerate() if t.name == "k3ckpt-hash"]
    assert _listing(tmp_path) == []


def test_hash_shards_do_not_hold_up_writing(tmp_path, monkeypatch):
    """A shard's hash finishes on its own thread: later shards are written meanwhile, and its
    on_shard_final runs once the digest is ready (in finalize order), at the latest at close()."""
    import hashlib
    import threading

    from k3ckpt.io import _prefix_hash

    gate = threading.Event()
    run = _prefix_hash.PrefixHasher._run
    first = []

    def slow_run(self):
        if not first:        # only the first shard's hasher waits
            first.append(self)
            gate.wait(10)
        run(self)

    monkeypatch.setattr(_prefix_hash.PrefixHasher, "_run", slow_run)
    data = {s.name: _rng_bytes(s.nbytes, i) for i, s in enumerate(SPECS)}
    seen = []
    w = ShardedWriter(tmp_path, SPECS, max_shard_bytes=300, hash_shards=True,
                      on_shard_final=lambda p: seen.append(p.name))
    for s in SPECS:
        w.write(s.name, data[s.name])
    assert all((tmp_path / n).is_file() for n in w.shards) and seen == []   # final, not yet reported
    gate.set()
    w.close()
    assert seen == w.shards
    for n in w.shards:
        assert w.sha256[n] == hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()


def test_abort_reports_shards_whose_hash_was_running(tmp_path, monkeypatch):
    """A shard already final when the run fails is still reported (after its hash is done), so
    a resumed run keeps it; unfinished shards leave nothing behind."""
    import threading

    from k3ckpt.io import _prefix_hash

    gate = threading.Event()
    run = _prefix_hash.PrefixHasher._run

    def slow_run(self):
        gate.wait(10)
        run(self)

    monkeypatch.setattr(_prefix_hash.PrefixHasher, "_run", slow_run)
    seen = []
    w = ShardedWriter(tmp_path, SPECS, max_shard_bytes=300, hash_shards=True,
                      on_shard_final=lambda p: seen.append((p.name, w.sha256[p.name])))
    first = w.shards[0]
    for s in SPECS:
        if w.shard_of[s.name] == first:
            w.write(s.name, _rng_bytes(s.nbytes))
    w.write_chunk("head", 0, _rng_bytes(8))      # another shard, left unfinished
    assert seen == [] and (tmp_path / first).is_file()
    threading.Timer(0.2, gate.set).start()
    w.abort()
    assert [n for n, _ in seen] == [first]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first]
