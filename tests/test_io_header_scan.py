"""The plain-header scanner (numba) against the strict JSON parser: for every
input, valid or not, both paths reach the same Header or the same error."""

from __future__ import annotations

import json
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3ckpt.errors import K3ckptError
from k3ckpt.io import header as H
from k3ckpt.io._header_scan import scan_header


def _outcome(raw: bytes, monkeypatch, *, plain: bool, file_size=None):
    monkeypatch.setattr(H, "_PLAIN_SCAN_MIN", 0 if plain else 1 << 60)
    try:
        return H.parse_header_json(raw, source="x", file_size=file_size)
    except K3ckptError as e:
        return (type(e), str(e))


def _same(raw: bytes, monkeypatch, file_size=None):
    strict = _outcome(raw, monkeypatch, plain=False, file_size=file_size)
    assert _outcome(raw, monkeypatch, plain=True, file_size=file_size) == strict
    return strict


def _header(n=40, seed=0, metadata=None) -> bytes:
    rng = random.Random(seed)
    entries = []
    for i in range(n):
        dt = rng.choice(["BF16", "U8", "F32", "F8_E4M3", "I64", "F4", "BOOL"])
        shape = tuple(rng.choice([0, 1, 2, 32, 896]) for _ in range(rng.randint(0, 3)))
        if dt == "F4":   # four-bit elements must fill whole bytes
            shape = shape[:-1] + (2,) if shape else (2,)
        from k3ckpt.io import dtypes

        entries.append((f"model.layers.{i}.mlp.experts.{i % 7}.w{i % 3}.weight", dt, shape,
                        dtypes.lookup(dt).nbytes(shape)))
    rng.shuffle(entries)
    prefix, _ = H.build_header(entries, metadata)
    return prefix[8:]


def test_scanner_takes_writer_output_and_agrees(monkeypatch):
    raw = _header(200, metadata={"format": "pt", "note": "a {b} [c], d:e"})
    spans, meta, *_ = scan_header(__import__("numpy").frombuffer(raw, dtype="uint8"))
    assert meta[0] >= 0 and len(spans) == 200          # the plain path really ran
    h = _same(raw, monkeypatch)
    assert isinstance(h, H.Header) and len(h.tensors) == 200 and h.metadata["note"] == "a {b} [c], d:e"


def test_key_order_apart_from_offset_order(monkeypatch):
    """Keys sorted by name (the stock writer's order) with data laid out otherwise, repeated
    (dtype, shape) pairs and empty tensors sharing an offset: the fast path accepts it and
    gives the strict parser's Header, kind table included."""
    from k3ckpt.io._header_scan import plain_header

    rng = random.Random(5)
    doc, pos = {}, 0
    for i in rng.sample(range(300), 300):
        shape = [rng.choice([0, 1, 7, 32]), rng.choice([2, 16])]
        n = shape[0] * shape[1] * 2
        doc[f"t.{i:03d}"] = {"dtype": "BF16", "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(dict(sorted(doc.items())), separators=(",", ":")).encode()
    assert plain_header(raw, source="x") is not None
    h = _same(raw, monkeypatch, file_size=8 + len(raw) + pos)
    assert list(h.tensors) != sorted(h.tensors) and h.data_size == pos
    strict = _outcome(raw, monkeypatch, plain=False)
    fast = _outcome(raw, monkeypatch, plain=True)
    kinds, kind_of = fast.kind_table()
    assert len(set(kinds)) == len(kinds) and (kinds, kind_of.tolist()) == (
        strict.kind_table()[0], strict.kind_table()[1].tolist())
    assert [kinds[k] for k in kind_of] == [(t.dtype, t.shape) for t in h.tensors.values()]


def test_whitespace_layouts_agree(monkeypatch):
    doc = json.loads(_header(30, metadata={"a": "b"}))
    for raw in (json.dumps(doc, indent=2).encode(), json.dumps(doc).encode(),
                json.dumps(doc, separators=(",", ":")).encode() + b"  \t\r\n"):
        spans, meta, *_ = scan_header(__import__("numpy").frombuffer(raw, dtype="uint8"))
        assert meta[0] != -2
        assert isinstance(_same(raw, monkeypatch), H.Header)


@pytest.mark.parametrize("edit", [
    lambda s: s.replace('"dtype"', '"dtype" ', 1).replace('"shape":', '"shape" :', 1),   # still plain
    lambda s: s.replace('"shape"', '"SHAPE"', 1),                      # unknown key
    lambda s: s.replace('"data_offsets":[0,', '"data_offsets":[00,', 1),  # leading zero
    lambda s: s.replace('"data_offsets":[0,', '"data_offsets":[-0,', 1),
    lambda s: s.replace('"data_offsets":[0,', '"data_offsets":[0.0,', 1),
    lambda s: s.replace('"data_offsets":[0,', '"data_offsets":[1e0,', 1),
    lambda s: s.replace('"data_offsets":[0,', '"data_offsets":[99999999999999999999999,', 1),
    lambda s: s.replace('{"dtype"', '{"shape":[1],"dtype"', 1),         # duplicate / reordered keys
    lambda s: s.replace('model.layers.1.', 'model\\u002elayers.1.', 1),  # escape: same name, strict path
    lambda s: s.replace('model.layers.1.', 'model\\ud800layers.1.', 1),  # lone surrogate
    lambda s: s.replace('model.layers.2.', 'model.layers.1.', 1),        # may duplicate a name
    lambda s: s[:-1] + ',}',
    lambda s: s + 'x',
    lambda s: s.replace('"BF16"', '"BF17"', 1),
    lambda s: s.replace('"U8"', 'true', 1),
    lambda s: s.replace('"__metadata__":{', '"__metadata__":{"n":1,', 1),
    lambda s: s.replace('"__metadata__":{', '"__metadata__":{"k":"v","k":"w",', 1),
    lambda s: s.replace('"__metadata__":{"format":"pt"}', '"__metadata__":{"format":"pt"},"__metadata__":{}', 1),
    lambda s: s.replace('],"data_offsets"', ',]' + ',"data_offsets"', 1),
    lambda s: s.replace('"shape":[', '"shape":[ ', 1),
    lambda s: s.replace('"shape":[]', '"shape":[ ]', 1),
    lambda s: s.replace(':[', ':\u00e9[', 1),
])
def test_edits_agree(edit, monkeypatch):
    raw = edit(_header(60, seed=3, metadata={"format": "pt"}).decode()).encode()
    _same(raw, monkeypatch)


def test_file_size_rules_agree(monkeypatch):
    raw = _header(50, seed=4)
    h = _outcome(raw, monkeypatch, plain=False)
    size = 8 + len(raw) + h.data_size
    for fs in (size, size - 1, size + 1):
        _same(raw, monkeypatch, file_size=fs)


def _edited(raw: bytes, flips, cuts) -> bytes:
    """``raw`` with bytes set (position modulo the length, value) and runs deleted (start, length)."""
    raw = bytearray(raw)
    for at, v in flips:
        raw[at % len(raw)] = v
    for at, k in cuts:
        at %= len(raw)
        del raw[at: at + k]
    return bytes(raw)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=4),
       st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 20)), max_size=2))
def test_fuzz_byte_edits_agree(seed, flips, cuts):
    """Random byte changes and deletions of a valid header: both paths agree."""
    mp = pytest.MonkeyPatch()
    try:
        _same(_edited(_header(25, seed=seed % 50, metadata={"format": "pt"} if seed % 2 else None), flips, cuts),
              mp)
    finally:
        mp.undo()


def _index_outcome(raw: bytes, monkeypatch, *, plain: bool):
    monkeypatch.setattr(H, "_PLAIN_SCAN_MIN", 0 if plain else 1 << 60)
    try:
        return H.loads_index(raw, source="x")
    except K3ckptError as e:
        return (type(e), str(e))


def _index_same(raw: bytes, monkeypatch):
    strict = _index_outcome(raw, monkeypatch, plain=False)
    assert _index_outcome(raw, monkeypatch, plain=True) == strict
    return strict


def _index(n=50, indent=2) -> bytes:
    wm = {f"model.layers.{i}.mlp.experts.{i % 5}.w1.weight": f"model-{i % 4 + 1:05d}-of-00004.safetensors"
          for i in range(n)}
    return json.dumps({"metadata": {"total_size": 123, "note": ["a", {"b": None}]}, "weight_map": wm},
                      indent=indent).encode()


def test_index_scan_agrees(monkeypatch):
    from k3ckpt.io._header_scan import scan_index

    for raw in (_index(), _index(indent=None), _index(0)):
        assert scan_index(__import__("numpy").frombuffer(raw, dtype="uint8"))[0]   # the plain path ran
        obj = _index_same(raw, monkeypatch)
        assert obj == json.loads(raw)


@pytest.mark.parametrize("edit", [
    lambda s: s.replace('"weight_map"', '"weight_map": {}, "weight_map"', 1),
    lambda s: s.replace('"metadata"', '"metadata": 1, "metadata"', 1),
    lambda s: s.replace('"model.layers.1.', '"model.layers.0.', 1).replace('"model.layers.1.', '"model.layers.0.', 1),
    lambda s: s.replace('"total_size": 123', '"total_size": NaN', 1),
    lambda s: s.replace('"total_size": 123', '"total_size": 01', 1),
    lambda s: s.replace('safetensors"', 'safetensors\\u0022"', 1),
    lambda s: s.replace('safetensors"', 'safetensors', 1),
    lambda s: s.replace('"weight_map"', '"weight_maps"', 1),
    lambda s: s.replace(': "model-0', ': 5, "x": "model-0', 1),
    lambda s: s.replace('{"b": null}', '{"b": null', 1),
    lambda s: s + "}",
    lambda s: "[" + s + "]",
])
def test_index_edits_agree(edit, monkeypatch):
    _index_same(edit(_index().decode()).encode(), monkeypatch)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 255)), max_size=3),
       st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 20)), max_size=2))
def test_fuzz_index_edits_agree(flips, cuts):
    mp = pytest.MonkeyPatch()
    try:
        _index_same(_edited(_index(40), flips, cuts), mp)
    finally:
        mp.undo()


# ---------------------------------------------------------------------------
# the index checked against the headers: the columns path (``match_names``) against
# the dict path, on checkpoints whose index and headers agree or disagree


def _checkpoint(d, shards: dict[str, list[str]], index: dict[str, str] | str) -> None:
    """Shards holding the named U8 tensors (two bytes each) and an index (a weight map, or raw text)."""
    d.mkdir()
    for shard, names in shards.items():
        prefix, offs = H.build_header([(n, "U8", (2,), 2) for n in names])
        (d / shard).write_bytes(prefix + bytes(2 * len(names)))
    text = index if isinstance(index, str) else json.dumps({"metadata": {"total_size": 1}, "weight_map": index},
                                                           indent=2)
    (d / "model.safetensors.index.json").write_text(text)


def _open_outcome(d, monkeypatch, *, plain: bool):
    from k3ckpt.io import reader

    monkeypatch.setattr(H, "_PLAIN_SCAN_MIN", 0 if plain else 1 << 60)
    took_columns = False
    try:
        loaded = reader._load_json_file(d / "model.safetensors.index.json", what="index JSON", index=True)
        took_columns = isinstance(loaded, reader.IndexColumns)
        with reader.open_checkpoint(d) as ck:
            got = [(n, e.shard, e.data_offset) for n, e in ck.tensors.items()], ck.index_metadata
    except K3ckptError as e:
        got = (type(e), str(e))
    return got, took_columns


_A = [f"model.layers.{i}.mlp.experts.{j}.w1.weight" for i in range(3) for j in range(4)]
_B = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(3)] + ["lm_head.weight"]
_S1, _S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
_AGREE = {**dict.fromkeys(_A, _S1), **dict.fromkeys(_B, _S2)}


@pytest.mark.parametrize("shards, index", [
    ({_S1: _A, _S2: _B}, _AGREE),                                                 # agree
    ({_S1: _A, _S2: _B}, dict(sorted(_AGREE.items(), reverse=True))),             # any order
    ({_S1: _A, _S2: _B}, {k: v for k, v in _AGREE.items() if k != _A[5]}),       # held, not listed
    ({_S1: _A, _S2: _B}, {**_AGREE, "model.extra.weight": _S2}),                  # listed, not held
    ({_S1: _A, _S2: _B}, {**_AGREE, _A[3]: _S2}),                                 # listed for the other shard
    ({_S1: _A, _S2: _B + [_A[0]]}, _AGREE),                                       # held by both shards
    ({_S1: _A, _S2: _B + [_A[0]]}, {**_AGREE, "model.extra.weight": _S2}),        # held twice, counts equal
    ({_S1: _A, _S2: _B[:-1] + ["lm_head.weighs"]}, _AGREE),                       # one byte apart
    ({_S1: _A, _S2: _B[:-1] + ["lm_head.weight\n"]}, _AGREE),                     # a newline in a held name
    ({_S1: _A, _S2: _B[:-1] + ["lm_head.weight\u00e9"]}, _AGREE),                 # not ASCII
    ({_S1: _A, _S2: _B}, json.dumps({"weight_map": _AGREE}).replace(
        f'"{_A[1]}"', f'"{_A[0]}"', 1)),                                           # the index repeats a name
    ({_S1: _A, _S2: _B}, json.dumps({"metadata": [], "weight_map": _AGREE})),     # metadata not an object
    ({_S1: _A, _S2: _B}, json.dumps({"metadata": None, "weight_map": _AGREE})),
    ({_S1: _A, _S2: _B}, {**_AGREE, _A[0]: "../x.safetensors"}),                  # unsafe shard name
    ({_S1: _A, _S2: _B}, dict.fromkeys(_A + _B, _S1)),                             # one shard not listed
])
def test_index_check_agrees(tmp_path, monkeypatch, shards, index):
    _checkpoint(tmp_path / "ck", shards, index)
    strict, _ = _open_outcome(tmp_path / "ck", monkeypatch, plain=False)
    fast, took_columns = _open_outcome(tmp_path / "ck", monkeypatch, plain=True)
    assert fast == strict
    if isinstance(index, dict) and "../" not in "".join(index.values()):
        assert took_columns   # the columns path really ran


def test_index_check_agrees_on_the_packaged_k3_names(tmp_path, monkeypatch):
    """The K3 index's real names, a few thousand, spread over shards as the index says."""
    from k3ckpt.fixtures import real_k3_index

    wm = real_k3_index()["weight_map"]
    shards: dict[str, list[str]] = {}
    for n in sorted(wm):   # every shard keeps some of its names: a numbered set must be whole
        shards.setdefault(wm[n], []).append(n)
    shards = {s: names[:: max(1, len(wm) // 3000)] for s, names in shards.items()}
    names = [n for ns in shards.values() for n in ns]
    _checkpoint(tmp_path / "ck", shards, {n: wm[n] for n in names})
    strict, _ = _open_outcome(tmp_path / "ck", monkeypatch, plain=False)
    fast, took_columns = _open_outcome(tmp_path / "ck", monkeypatch, plain=True)
    assert took_columns and fast == strict and len(strict[0]) == len(names)


def test_index_check_with_a_header_the_strict_parser_read(tmp_path, monkeypatch):
    """One header spells a name with a JSON escape (the strict parser reads it), the
    others are plain: the columns check joins that header's names and still decides."""
    from k3ckpt.io import reader

    _checkpoint(tmp_path / "ck", {_S1: _A, _S2: _B}, _AGREE)
    shard = tmp_path / "ck" / _S2
    blob = shard.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    js = blob[8: 8 + n].replace(b'"lm_head.weight"', b'"lm\\u005fhead.weight"')
    shard.write_bytes(struct.pack("<Q", len(js)) + js + blob[8 + n:])
    monkeypatch.setattr(H, "_PLAIN_SCAN_MIN", 0)
    calls = []
    real = reader._shard_table
    monkeypatch.setattr(reader, "_shard_table", lambda headers: calls.append(1) or real(headers))
    with reader.open_checkpoint(tmp_path / "ck") as ck:
        assert type(ck.headers[_S2].tensors) is dict and "lm_head.weight" in ck.tensors
        assert ck.tensors["lm_head.weight"].shard == _S2
    assert calls == [1]   # the lookup above built the table; the check did not need it
    _checkpoint(tmp_path / "ck2", {_S1: _A, _S2: _B}, {**_AGREE, "lm_head.weight": _S1})
    (tmp_path / "ck2" / _S2).write_bytes(shard.read_bytes())
    with pytest.raises(K3ckptError, match="index lists it in shard"):
        reader.open_checkpoint(tmp_path / "ck2")


def test_index_check_decides_agreement_without_the_dict_path(tmp_path, monkeypatch):
    """An index that agrees with its headers is settled by the columns check alone."""
    from k3ckpt.io import reader

    _checkpoint(tmp_path / "ck", {_S1: _A, _S2: _B}, dict(sorted(_AGREE.items(), reverse=True)))
    monkeypatch.setattr(H, "_PLAIN_SCAN_MIN", 0)
    calls = []
    monkeypatch.setattr(reader, "_shard_table", lambda headers: calls.append(1) or {})
    with reader.open_checkpoint(tmp_path / "ck") as ck:
        assert len(ck.tensors) == len(_AGREE) and not calls
