"""Reading GGUF back: `k3ckpt inspect FILE.gguf` and `k3ckpt dequant FILE.gguf DST`.

The files are k3ckpt's own (`write_gguf` on the tiny K3); what inspect reports is
held to what the writer planned, and what dequant writes to the gguf package's own
reader and dequantizers (independent of our kernels) and, for MXFP4 experts, to the
MXFP4 source decoded by k3ckpt.formats.mxfp4.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from k3ckpt import api
from k3ckpt.errors import InvalidFileError, NotFoundError, OutputExistsError, TruncatedFileError, UsageError
from k3ckpt.gguf import dequant as gguf_dequant
from k3ckpt.gguf.convert import plan_gguf, write_gguf
from k3ckpt.io.reader import open_checkpoint

ROOT = str(Path(__file__).resolve().parents[1])
SPLIT_BYTES = 1_000_000


@pytest.fixture(scope="module")
def ckpt(k3_tiny):
    return open_checkpoint(k3_tiny)


@pytest.fixture(scope="module")
def iq2_split(ckpt, tmp_path_factory):
    """The tiny K3 with IQ2_XS experts in several splits, and the writer's plan for it."""
    out = tmp_path_factory.mktemp("iq2") / "k3.gguf"
    res = write_gguf(ckpt, out, expert_type="iq2_xs", split_max_bytes=SPLIT_BYTES)
    assert len(res.paths) >= 3
    kvs, planned, _ = plan_gguf(ckpt, expert_type="iq2_xs")
    return res, {kv.key: kv.value for kv in kvs}, planned


@pytest.fixture(scope="module")
def mxfp4_file(ckpt, tmp_path_factory):
    return write_gguf(ckpt, tmp_path_factory.mktemp("mxfp4") / "k3-MXFP4.gguf", expert_type="mxfp4",
                      split_max_bytes=None).paths[0]


def _tensors(paths):
    out = {}
    for p in paths:
        out.update({t.name: t for t in gguf.GGUFReader(p).tensors})
    return out


# ---------------------------------------------------------------------------- inspect
def test_inspect_reads_the_whole_set_from_any_split(iq2_split):
    res, kvs, planned = iq2_split
    reports = [api.inspect(p) for p in (res.paths[0], res.paths[len(res.paths) // 2], res.paths[-1])]
    first = reports[0]
    for r in reports[1:]:
        assert (r.files, r.by_type, r.by_role, r.metadata) == (first.files, first.by_type, first.by_role,
                                                               first.metadata)
    assert [f.name for f in first.files] == [p.name for p in res.paths]
    assert [f.split_no for f in first.files] == list(range(len(res.paths)))
    assert [f.size for f in first.files] == [p.stat().st_size for p in res.paths]
    assert sum(f.tensors for f in first.files) == first.tensor_count == res.tensors
    assert first.total_bytes == sum(p.info.nbytes for p in planned)
    assert sum(f.size for f in first.files) == res.bytes_written          # the writer's whole files
    assert {b.key: b.bytes for b in first.by_type} == res.bytes_by_type
    params: dict[str, int] = {}
    for p in planned:
        key = gguf.GGMLQuantizationType(p.info.ggml_type).name
        params[key] = params.get(key, 0) + math.prod(p.info.shape)
    assert {b.key: b.params for b in first.by_type} == params
    assert first.params_total == sum(params.values())
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XS]
    assert {b.key: b.bits_per_weight for b in first.by_type}["IQ2_XS"] == size * 8 / block


def test_inspect_kv_summary_is_the_writers_metadata(iq2_split):
    res, kvs, planned = iq2_split
    r = api.inspect(res.paths[1])
    arch = kvs["general.architecture"]
    assert r.architecture == arch == "kimi-k3"
    assert r.block_count == kvs[f"{arch}.block_count"]
    assert r.context_length == kvs[f"{arch}.context_length"]
    assert r.embedding_length == kvs[f"{arch}.embedding_length"]
    assert (r.expert_count, r.expert_used_count, r.expert_shared_count) == (
        kvs[f"{arch}.expert_count"], kvs[f"{arch}.expert_used_count"], kvs[f"{arch}.expert_shared_count"])
    assert r.vocab_size == kvs[f"{arch}.vocab_size"] == len(kvs["tokenizer.ggml.tokens"])
    assert r.file_type == kvs["general.file_type"] and r.file_type_name == "MOSTLY_IQ2_XS"
    assert r.chat_template == ("tokenizer.chat_template" in kvs)
    assert r.kv_count == len(kvs) + 3                        # the first split's split.* keys
    assert r.metadata["tokenizer.ggml.tokens"] == {"type": "ARRAY[STRING]", "length": r.vocab_size}
    assert r.metadata[f"{arch}.attention.head_count_kv"]["value"] == kvs[f"{arch}.attention.head_count_kv"]


def test_inspect_roles(iq2_split):
    res, _, planned = iq2_split
    r = api.inspect(res.paths[0], tensors=True)
    roles = {b.key: b for b in r.by_role}
    experts = [p for p in planned if p.info.name.endswith("_exps.weight")]
    assert roles["routed_expert"].tensors == len(experts) == 9
    assert roles["routed_expert"].bytes == sum(p.info.nbytes for p in experts) == res.bytes_by_type["IQ2_XS"]
    assert roles["shared_expert"].tensors == sum("_shexp" in p.info.name for p in planned)
    assert roles["norm"].tensors == sum("_norm" in p.info.name for p in planned)
    assert roles["embedding"].tensors == roles["lm_head"].tensors == 1
    assert sum(b.tensors for b in r.by_role) == res.tensors
    rows = {t.name: t for t in r.tensors}
    assert rows["blk.3.attn_kv_a_mqa.weight"].role == "attention" and rows["blk.0.ssm_beta.weight"].role == "attention"
    assert rows["blk.1.ffn_gate_inp.weight"].role == "other"
    want = {p.info.name: (p.info.shape, p.info.nbytes) for p in planned}
    assert {n: (t.shape, t.bytes) for n, t in rows.items()} == want


def _cli(*args, cmd="inspect"):
    return subprocess.run([sys.executable, "-m", "k3ckpt", cmd, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)


def test_inspect_cli_text_json_and_list(iq2_split):
    res, _, _ = iq2_split
    p = _cli(res.paths[-1], "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["format"] == "gguf" and d["tensor_count"] == res.tensors and len(d["files"]) == len(res.paths)
    assert {b["key"]: b["bytes"] for b in d["by_type"]} == res.bytes_by_type
    p = _cli(res.paths[0], "--list-tensors")
    assert p.returncode == 0, p.stderr
    assert "by ggml type" in p.stdout and "by role" in p.stdout
    line = next(x for x in p.stdout.splitlines() if x.startswith("blk.1.ffn_up_exps.weight"))
    assert line.split()[1:4] == ["IQ2_XS", "8x256x256", "routed_expert"]
    p = _cli(res.paths[0], "--scan")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--scan" in p.stderr


# ---------------------------------------------------------------------------- dequant
@pytest.fixture(scope="module")
def iq2_f32(iq2_split, tmp_path_factory):
    res, _, _ = iq2_split
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf_dequant, "CHUNK_BYTES", 5000)        # many chunks per tensor, rows cut unevenly
    try:
        dst = tmp_path_factory.mktemp("dq") / "f32"
        out = api.dequant(res.paths[1], dst, dtype="f32", max_shard_size=2_000_000)
    finally:
        mp.undo()
    return out, open_checkpoint(dst)


def test_dequant_values_are_the_gguf_packages(iq2_split, iq2_f32):
    res, _, _ = iq2_split
    out, got = iq2_f32
    src = _tensors(res.paths)
    assert sorted(got.tensors) == sorted(src) and out.tensors == len(src)
    assert len(out.shards) > 1 and not out.left_out
    quantized = 0
    for name, t in src.items():
        e = got.entry(name)
        assert tuple(e.shape) == tuple(int(d) for d in t.shape[::-1]), name      # numpy order: GGUF's ne reversed
        if t.tensor_type.name in ("F32", "BF16"):
            assert e.dtype == t.tensor_type.name and got.read_bytes(name) == bytes(np.asarray(t.data).view(np.uint8))
            continue
        quantized += 1
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert e.dtype == "F32"
        np.testing.assert_array_equal(got.read_raw(name).view(np.float32).reshape(want.shape), want)
    assert quantized == len(out.decoded) == 9 and out.copied == len(src) - 9


def test_dequant_output_is_config_free_with_the_metadata(iq2_split, iq2_f32):
    res, kvs, _ = iq2_split
    out, got = iq2_f32
    dst = Path(out.dst)
    assert not (dst / "config.json").exists()
    doc = json.loads((dst / gguf_dequant.METADATA_NAME).read_text())
    assert doc["format"] == "k3ckpt-gguf-metadata" and [f["name"] for f in doc["files"]] == [p.name for p in res.paths]
    meta = doc["metadata"]
    assert set(meta) == set(kvs) | {"split.no", "split.count", "split.tensors.count"}
    assert meta["tokenizer.ggml.tokens"]["value"] == list(kvs["tokenizer.ggml.tokens"])
    assert meta["general.file_type"] == {"type": "UINT32", "value": kvs["general.file_type"]}
    assert meta["split.count"]["value"] == len(res.paths)
    t = doc["tensors"]["blk.2.ffn_down_exps.weight"]
    assert t["ggml_type"] == "IQ2_XS" and t["written_as"] == "F32" and t["shape"] == list(got.entry(
        "blk.2.ffn_down_exps.weight").shape)
    assert api.verify(dst).ok


def test_mxfp4_experts_decode_to_the_mxfp4_source(ckpt, mxfp4_file, tmp_path):
    from k3ckpt.formats.mxfp4 import decode_pair

    text = ckpt.config["text_config"]
    out = api.dequant(mxfp4_file, tmp_path / "bf16", dtype="bf16", tensors=r"_exps\.")
    got = open_checkpoint(tmp_path / "bf16")
    assert sorted(got.tensors) == sorted(out.decoded)
    assert len(out.left_out) + out.tensors == len(_tensors([mxfp4_file])) and out.left_out
    assert not out.inexact           # MXFP4 values are exact in bf16
    layers = sorted({int(n.split(".")[1]) for n in got.tensors})
    assert len(got.tensors) == 3 * len(layers) and layers
    for layer in layers:
        for proj, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            x = got.read_raw(f"blk.{layer}.ffn_{proj}_exps.weight").view(np.uint16)
            assert x.shape[0] == text["num_experts"]
            for e in range(x.shape[0]):
                base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}."
                want = decode_pair(ckpt.read_raw(base + "weight_packed"), ckpt.read_raw(base + "weight_scale"))
                # equal values; not equal bits: ggml's MXFP4 table (kvalues_mxfp4, int8) has no -0, so
                # E2M1's -0 code decodes to +0
                mine = (x[e].astype(np.uint32) << 16).view(np.float32)
                np.testing.assert_array_equal(mine, want)
                zero = want == 0
                assert zero.any() and not np.signbit(mine[zero]).any()


def test_bf16_tensor_round_trips_exactly(ckpt, mxfp4_file, tmp_path):
    api.dequant(mxfp4_file, tmp_path / "out", tensors=r"^blk\.1\.ffn_down_shexp\.weight$")
    got = open_checkpoint(tmp_path / "out")
    src = "language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight"
    e = got.entry("blk.1.ffn_down_shexp.weight")
    assert list(got.tensors) == ["blk.1.ffn_down_shexp.weight"]
    assert (e.dtype, tuple(e.shape)) == (ckpt.entry(src).dtype, tuple(ckpt.entry(src).shape))
    assert got.read_bytes("blk.1.ffn_down_shexp.weight") == ckpt.read_bytes(src)


def test_dequant_dry_run_and_refusals(mxfp4_file, tmp_path):
    out = api.dequant(mxfp4_file, tmp_path / "dry", dry_run=True, max_shard_size="1MB")
    assert out.dry_run and out.fits and not (tmp_path / "dry").exists()
    assert out.shards[-1] == "model.safetensors.index.json" and len(out.shards) > 2
    with pytest.raises(UsageError, match="matches no tensor"):
        api.dequant(mxfp4_file, tmp_path / "none", tensors="no-such-tensor")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(OutputExistsError):
        api.dequant(mxfp4_file, tmp_path / "full")
    assert not (tmp_path / "none").exists()


def test_cli_dequant_gguf(mxfp4_file, tmp_path):
    p = _cli(mxfp4_file, tmp_path / "o", "--tensors", "blk\\.2\\.", "--dtype", "f16", cmd="dequant")
    assert p.returncode == 0, p.stderr
    assert "under their GGUF names" in p.stdout and "left out:" in p.stdout
    got = open_checkpoint(tmp_path / "o")
    assert sorted(got.tensors) == sorted(n for n in _tensors([mxfp4_file]) if n.startswith("blk.2."))
    t = _tensors([mxfp4_file])["blk.2.ffn_up_exps.weight"]
    want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float16)
    assert got.entry("blk.2.ffn_up_exps.weight").dtype == "F16"
    np.testing.assert_array_equal(got.read_raw("blk.2.ffn_up_exps.weight").view(np.float16).reshape(want.shape), want)


# ---------------------------------------------------------------------------- bad input
def _copy_set(res, dst: Path) -> list[Path]:
    dst.mkdir()
    out = []
    for p in res.paths:
        (dst / p.name).write_bytes(p.read_bytes())
        out.append(dst / p.name)
    return out


def _patch_kv(path: Path, key: str, fmt: str, value) -> None:
    """Overwrite the value of a scalar metadata key in place (it follows the key and its u32 type)."""
    raw = bytearray(path.read_bytes())
    at = raw.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key) + 4
    struct.pack_into(fmt, raw, at, value)
    path.write_bytes(bytes(raw))


def test_missing_split_is_refused_from_any_split(iq2_split, tmp_path):
    res, _, _ = iq2_split
    paths = _copy_set(res, tmp_path / "set")
    paths[1].unlink()
    for p in (paths[0], paths[-1]):
        with pytest.raises(NotFoundError, match=f"1 of {len(paths)} splits missing.*first {paths[1].name}"):
            api.inspect(p)
    with pytest.raises(NotFoundError, match="splits missing"):
        api.dequant(paths[0], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_inconsistent_split_count_is_refused(iq2_split, mxfp4_file, tmp_path):
    res, _, _ = iq2_split
    paths = _copy_set(res, tmp_path / "set")
    _patch_kv(paths[2], "split.count", "<H", len(paths) + 1)
    with pytest.raises(InvalidFileError, match=f"split.count {len(paths) + 1} where .* has {len(paths)}"):
        api.inspect(paths[0])
    with pytest.raises(InvalidFileError, match="which its name does not say"):
        api.inspect(paths[2])
    lone = tmp_path / "set" / "lone-00002-of-00003.gguf"          # a single file renamed as a split
    lone.write_bytes(mxfp4_file.read_bytes())
    with pytest.raises(InvalidFileError, match="named as split 2 of 3 but has no split.count key"):
        api.inspect(lone)


def test_not_a_gguf_and_truncated_files_are_one_line(iq2_split, tmp_path, k3_tiny):
    res, _, _ = iq2_split
    bad = tmp_path / "text.gguf"
    bad.write_text("hello, not a GGUF file at all\n")
    with pytest.raises(InvalidFileError, match="not a GGUF file"):
        api.inspect(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(InvalidFileError, match="not a GGUF file"):
        api.inspect(empty)
    st = next(Path(k3_tiny).glob("*.safetensors"))
    renamed = tmp_path / "weights.gguf"
    renamed.write_bytes(st.read_bytes()[:4096])
    with pytest.raises(InvalidFileError, match="not a GGUF file"):
        api.dequant(renamed, tmp_path / "o")
    whole = res.paths[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(TruncatedFileError, match=r"tensor '.+' ends at byte [\d,]+ but the file has"):
        api.inspect(cut)
    cut.write_bytes(whole[:300])
    with pytest.raises(TruncatedFileError, match="ends inside its GGUF header"):
        api.inspect(cut)
    with pytest.raises(NotFoundError):
        api.inspect(tmp_path / "absent.gguf")
    p = _cli(cut)
    assert p.returncode == 2 and p.stderr.startswith("k3ckpt: error:") and p.stderr.count("\n") == 1, p.stderr


def test_a_hostile_array_length_is_refused_not_looped_on(iq2_split, tmp_path):
    res, _, _ = iq2_split
    raw = bytearray(res.paths[0].read_bytes())
    key = b"tokenizer.ggml.token_type"
    at = raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 4   # past the value and item types
    struct.pack_into("<Q", raw, at, 1 << 60)
    hostile = tmp_path / f"hostile-00001-of-{len(res.paths):05d}.gguf"
    hostile.write_bytes(bytes(raw))
    with pytest.raises(TruncatedFileError, match="array items of 'tokenizer.ggml.token_type'"):
        api.inspect(hostile)
