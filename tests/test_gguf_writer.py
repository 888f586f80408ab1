"""The GGUF container and writer, read back with the gguf package's own reader."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from k3ckpt.errors import InvalidFileError, OutputExistsError, ShapeError, UsageError
from k3ckpt.gguf import container as C
from k3ckpt.gguf.writer import GGUFWriter, split_paths

Q = gguf.GGMLQuantizationType


def _kvs():
    return [
        C.KV("general.architecture", C.STRING, "kimi-k3"),
        C.KV("kimi-k3.block_count", C.UINT32, 3),
        C.KV("kimi-k3.expert_weights_scale", C.FLOAT32, 2.5),
        C.KV("kimi-k3.attention.head_count_kv", C.ARRAY, [1, 0, 0], C.INT32),
        C.KV("tokenizer.ggml.tokens", C.ARRAY, ["a", "b", "\u00e9t\u00e9"], C.STRING),
        C.KV("kimi-k3.expert_weights_norm", C.BOOL, True),
        C.KV("general.file_type", C.UINT64, 2**40 + 3),
    ]


def _tensors(rng):
    """(TensorInfo, bytes) pairs of several types, odd sizes included (alignment padding)."""
    out = []
    for name, t, shape in [("token_embd.weight", Q.BF16, (7, 32)),
                           ("blk.0.ffn_gate_exps.weight", Q.IQ2_XS, (3, 2, 256)),
                           ("blk.0.ffn_down_exps.weight", Q.MXFP4, (3, 5, 64)),
                           ("output_norm.weight", Q.F32, (3,)),
                           ("blk.0.attn_k_b.weight", Q.Q8_0, (2, 4, 32))]:
        info = C.TensorInfo(name, int(t), shape)
        out.append((info, rng.integers(0, 256, info.nbytes, dtype=np.uint8).tobytes()))
    return out


def _write(path, pairs, *, piece=None, **kw):
    with GGUFWriter(path, _kvs(), [i for i, _ in pairs], **kw) as w:
        for info, data in pairs:
            step = piece or len(data)
            for s in range(0, len(data), step):
                w.write(info.name, data[s:s + step])
    return w


def _fields(r):
    out = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        out[k] = f.contents()
    return out


def test_one_file_reads_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    pairs = _tensors(rng)
    path = tmp_path / "m.gguf"
    w = _write(path, pairs, piece=13)     # pieces that cut blocks and rows at odd places
    assert w.paths == [path] and os.path.getsize(path) == w.total_size
    r = gguf.GGUFReader(path)
    got = _fields(r)
    assert got["general.architecture"] == "kimi-k3"
    assert got["kimi-k3.block_count"] == 3 and got["kimi-k3.expert_weights_norm"] is True
    assert got["kimi-k3.expert_weights_scale"] == pytest.approx(2.5)
    assert got["kimi-k3.attention.head_count_kv"] == [1, 0, 0]
    assert got["tokenizer.ggml.tokens"] == ["a", "b", "\u00e9t\u00e9"]
    assert got["general.file_type"] == 2**40 + 3
    assert not any(k.startswith("split.") for k in got)
    assert [t.name for t in r.tensors] == [i.name for i, _ in pairs]
    for t, (info, data) in zip(r.tensors, pairs):
        assert t.tensor_type == info.ggml_type
        assert tuple(int(d) for d in t.shape) == info.shape[::-1]     # ggml's ne: innermost first
        assert t.data_offset % C.DEFAULT_ALIGNMENT == 0
        assert t.n_bytes == info.nbytes and bytes(np.asarray(t.data).reshape(-1).view(np.uint8)) == data
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert not list(tmp_path.glob(".*"))


def test_gguf_package_dequantizes_what_we_laid_out(tmp_path):
    """A real quantized tensor: gguf-py's quantizer's bytes, our layout, its dequantizer back."""
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    q = gguf.quants.quantize(x, Q.Q8_0)
    info = C.TensorInfo("blk.0.ffn_up.weight", int(Q.Q8_0), x.shape)
    assert info.nbytes == q.nbytes
    _write(tmp_path / "q.gguf", [(info, q.tobytes())])
    t = gguf.GGUFReader(tmp_path / "q.gguf").tensors[0]
    back = gguf.quants.dequantize(np.asarray(t.data), Q.Q8_0).reshape(x.shape)
    np.testing.assert_array_equal(back, gguf.quants.dequantize(q, Q.Q8_0).reshape(x.shape))


def test_splits_named_and_keyed_as_gguf_split(tmp_path):
    rng = np.random.default_rng(2)
    pairs = _tensors(rng)
    limit = 400      # bytes of (padded) data per split
    w = _write(tmp_path / "Kimi-K3-IQ2_XS.gguf", pairs, split_max_bytes=limit)
    n = len(w.paths)
    assert n > 2
    assert [p.name for p in w.paths] == [f"Kimi-K3-IQ2_XS-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    seen = []
    for no, p in enumerate(w.paths):
        r = gguf.GGUFReader(p)
        f = _fields(r)
        assert (f["split.no"], f["split.count"], f["split.tensors.count"]) == (no, n, len(pairs))
        assert r.fields["split.no"].types == [gguf.GGUFValueType.UINT16]
        assert r.fields["split.tensors.count"].types == [gguf.GGUFValueType.INT32]
        assert ("general.architecture" in f) == (no == 0)        # metadata in the first split only
        data = sum(C.pad(int(t.n_bytes), 32) for t in r.tensors)
        assert data <= limit or len(r.tensors) == 1
        seen += [(t.name, bytes(np.asarray(t.data).reshape(-1).view(np.uint8))) for t in r.tensors]
    assert seen == [(i.name, d) for i, d in pairs]


def test_plan_splits_rule():
    t = [C.TensorInfo(f"t{i}", int(Q.F32), (n,)) for i, n in enumerate([8, 8, 100, 8])]   # 32, 32, 400, 32 B
    assert [[x.name for x in s] for s in C.plan_splits(t, 64)] == [["t0", "t1"], ["t2"], ["t3"]]
    assert len(C.plan_splits(t, None)) == 1
    with pytest.raises(UsageError):
        C.plan_splits(t, 0)


def test_split_paths_single_and_many(tmp_path):
    assert split_paths(tmp_path / "a.gguf", 1) == [tmp_path / "a.gguf"]
    assert split_paths(tmp_path / "a.gguf", 2)[1].name == "a-00002-of-00002.gguf"


def test_error_leaves_no_partial_file(tmp_path):
    pairs = _tensors(np.random.default_rng(3))
    path = tmp_path / "m.gguf"
    with pytest.raises(RuntimeError):
        with GGUFWriter(path, _kvs(), [i for i, _ in pairs]) as w:
            w.write(pairs[0][0].name, pairs[0][1][:5])
            raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []


def test_incomplete_close_and_bad_writes(tmp_path):
    pairs = _tensors(np.random.default_rng(4))
    w = GGUFWriter(tmp_path / "m.gguf", _kvs(), [i for i, _ in pairs])
    with pytest.raises(ShapeError, match="holds"):
        w.write(pairs[0][0].name, pairs[0][1] + b"x")
    with pytest.raises(UsageError, match="not in this GGUF plan"):
        w.write("nope", b"")
    with pytest.raises(ShapeError, match="incomplete"):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_resume_keeps_finished_splits_and_checks_them(tmp_path):
    pairs = _tensors(np.random.default_rng(5))
    infos = [i for i, _ in pairs]
    out = tmp_path / "m.gguf"
    first = _write(out, pairs, split_max_bytes=400)
    want = [p.read_bytes() for p in first.paths]
    # an interrupted rerun: the first split is done, the rest were lost
    for p in first.paths[1:]:
        p.unlink()
    w = GGUFWriter(out, _kvs(), infos, split_max_bytes=400, done_splits=[first.paths[0].name])
    todo = [(i, d) for i, d in pairs if w.needs(i.name)]
    assert 0 < len(todo) < len(pairs)
    for i, d in todo:
        w.write(i.name, d)
    assert [p.read_bytes() for p in w.close()] == want
    # a finished split from other options is refused, not kept
    other = [C.KV("general.architecture", C.STRING, "deepseek2")]
    with pytest.raises(InvalidFileError, match="does not match"):
        GGUFWriter(out, other, infos, split_max_bytes=400, done_splits=[first.paths[0].name])
    with pytest.raises(OutputExistsError):
        GGUFWriter(out, _kvs(), infos, split_max_bytes=400)


@pytest.mark.parametrize("bad, match", [
    (lambda: C.TensorInfo("x", int(Q.IQ2_XS), (4, 100)), "blocks of 256"),
    (lambda: C.TensorInfo("x" * 64, int(Q.F32), (4,)), "1-63 bytes"),
    (lambda: C.TensorInfo("x", int(Q.F32), (1, 1, 1, 1, 1)), "1-4 positive dims"),
    (lambda: C.KV("k", C.ARRAY, [1]), "item type"),
    (lambda: C.FileLayout.build([C.KV("a", C.UINT8, 1)] * 2, []), "repeat"),
])
def test_bad_layouts_are_refused(bad, match):
    with pytest.raises((UsageError, ShapeError), match=match):
        bad()


def test_golden_header_bytes():
    """docs/formats/gguf.md's worked example, byte for byte."""
    layout = C.FileLayout.build([C.KV("general.architecture", C.STRING, "x")],
                                [C.TensorInfo("w", int(Q.F32), (2, 3))])
    want = bytes.fromhex(
        "47475546" "03000000" "0100000000000000" "0100000000000000"        # magic, v3, 1 tensor, 1 kv
        "1400000000000000" + "general.architecture".encode().hex() +      # key
        "08000000" "0100000000000000" "78"                                 # STRING "x"
        "0100000000000000" "77" "02000000"                                 # tensor "w", 2 dims
        "0300000000000000" "0200000000000000"                              # ne = [3, 2] (innermost first)
        "00000000" "0000000000000000")                                     # F32, offset 0
    assert layout.header[:len(want)] == want
    assert len(want) == 106 and len(layout.header) == 128                       # padded to 32
    assert set(layout.header[len(want):]) == {0}
    assert layout.offsets == (128,) and layout.size == 128 + 32                 # 24 data bytes padded to 32
