"""shard_checkpoint / verify_output on the tiny K3: placement and cache plans, both pack layouts,
resume, bad input, and the k3ckpt pack layout's golden vectors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from k3ckpt.errors import (
    DiskSpaceError,
    InvalidFileError,
    OutputExistsError,
    ResumeMismatchError,
    UnsupportedError,
    UsageError,
)
from k3ckpt.io.manifest import RunManifest
from k3ckpt.io.reader import open_checkpoint
from k3ckpt.shard import materialize
from k3ckpt.placement.devices import parse_devices
from k3ckpt.shard.materialize import rank_work, shard_checkpoint
from k3ckpt.shard.moet_pack import PackIdentity, SlotGeometry, expected_values_from_mxfp4, slot_values
from k3ckpt.shard.packs import ALIGN, ExpertPack, PackBuilder, PackRecord, RecordPart
from k3ckpt.placement.spec import MoEGeometry
from k3ckpt.placement.planner import make_plan
from k3ckpt.shard.source import read_source
from k3ckpt.shard.verify import verify_output

EXPERT_BYTES = 3 * (256 * 128 + 256 * 8)   # k3-tiny: w1, w3 [256, 256], w2 [256, 256] MXFP4 (packed + scale)
LAYERS = (1, 2, 3)
PREFIX = "language_model.model.layers"
# docs/formats/expert-pack.md, "Worked example"
GOLDEN_PACK_SHA256 = "1dfc258590f9748dbb373488938a44e24750d5ad84b8f44b7d0e835acb5804eb"


def geometry(dense_bytes=10**6, expert_bytes=EXPERT_BYTES, layer_ids=LAYERS, experts=8):
    """k3-tiny's MoE geometry by hand (config: 4 layers, layer 0 dense, 8 experts, top-2)."""
    return MoEGeometry(len(layer_ids), experts, 2, expert_bytes, dense_bytes, layer_ids, "k3-tiny")


def loads(seed=0):
    return np.random.default_rng(seed).lognormal(0, 1, (3, 8))


@pytest.fixture(scope="module")
def ckpt(k3_tiny):
    with open_checkpoint(k3_tiny) as c:
        yield c


@pytest.fixture(scope="module")
def placement_plan():
    return make_plan(geometry(), parse_devices("2xH100"), loads(), redundant=3)


@pytest.fixture(scope="module")
def cache_plan():
    ds = parse_devices("2xRTX-5090", nvme="1x7", host_dram="1MB")
    # dense weights fill each GPU but for 4 experts: a real HBM tier, a host tier and NVMe;
    # stages of 3 and 1 decoder layers (VLLM_PP_LAYER_PARTITION=3,1): MoE layers 1-2 | 3
    return make_plan(geometry(dense_bytes=2 * (ds.device.hbm_bytes - 4 * EXPERT_BYTES)), ds, loads(),
                     pp_partition=[3, 1])


def expert_names(layer, e):
    base = f"{PREFIX}.{layer}.block_sparse_moe.experts.{e}"
    return [f"{base}.{w}.{p}" for w in ("w1", "w3", "w2") for p in ("weight_packed", "weight_scale")]


def file_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "k3ckpt-manifest.json"}


# ------------------------------------------------------------------ placement
def test_placement_ranks(ckpt, placement_plan, tmp_path):
    pl = placement_plan.placement
    r = shard_checkpoint(ckpt, placement_plan, tmp_path / "out", progress=False)
    assert r.mode == "placement" and len(r.ranks) == 2 and all(s.pack is None for s in r.ranks)
    src = read_source(ckpt)
    for rank in (0, 1):
        folder = tmp_path / "out" / f"rank-{rank:05d}"
        info = json.loads((folder / "rank.json").read_bytes())
        slots = np.flatnonzero(pl.slot2gpu == rank)
        assert info["slots"] == slots.tolist()
        assert info["slot_experts"] == pl.phy2log[:, slots].tolist()
        with open_checkpoint(folder) as out:
            want = set(src.dense)
            for row, layer in enumerate(LAYERS):
                for e in pl.phy2log[row, slots]:
                    want.update(expert_names(layer, int(e)))
            assert set(out.tensors) == want
            for name in out.tensors:
                assert out.read_bytes(name) == ckpt.read_bytes(name), name
            # experts of a layer come in slot order within the rank's files
            names = [n for n in out.tensors
                     if ".experts." in n and f"{PREFIX}.1." in n and n.endswith("w1.weight_packed")]
            order = [int(n.split(".experts.")[1].split(".")[0]) for n in names]
            assert order == list(dict.fromkeys(int(e) for e in pl.phy2log[0, slots]))
    rep = verify_output(tmp_path / "out", source=ckpt)
    assert rep.ok, rep.problems
    assert rep.tensors_checked == sum(s.tensors for s in r.ranks)
    assert RunManifest.load(tmp_path / "out").state == "complete"


def test_one_rank_only(ckpt, placement_plan, tmp_path):
    r = shard_checkpoint(ckpt, placement_plan, tmp_path / "out", ranks=[1], progress=False)
    assert [s.rank for s in r.ranks] == [1]
    assert not (tmp_path / "out" / "rank-00000").exists()
    assert verify_output(tmp_path / "out", source=ckpt).ok


# ------------------------------------------------------------------ cache, k3ckpt packs
def test_cache_k3ckpt_pack(ckpt, cache_plan, tmp_path):
    c = cache_plan.cache
    assert c.layer_bounds.tolist() == [0, 2, 3] and (c.hbm_slots == 4).all()
    r = shard_checkpoint(ckpt, cache_plan, tmp_path / "out", progress=False)
    stride = -(-EXPERT_BYTES // ALIGN) * ALIGN
    for rank, layers in ((0, (1, 2)), (1, (3,))):
        folder = tmp_path / "out" / f"rank-{rank:05d}"
        pack = ExpertPack.load(folder / "experts.pack.json")
        assert pack.stride == stride and pack.record_bytes == EXPERT_BYTES
        assert [x.layer for x in pack.records] == [layer for layer in layers for _ in range(8)]
        data = (folder / "experts.pack").read_bytes()
        assert len(data) == pack.file_size == len(pack.records) * stride
        pre = c.preload[c.preload[:, 0] == rank]
        for layer in layers:
            recs = [x for x in pack.records if x.layer == layer]
            # plan order: the HBM tier, the host tier (hottest first), then the rest by id
            planned = [int(x[3]) for x in pre if LAYERS[int(x[2])] == layer]
            assert [x.expert for x in recs][: len(planned)] == planned
            rest = [x.expert for x in recs][len(planned):]
            assert rest == sorted(set(range(8)) - set(planned))
            for x in recs:
                rec = data[x.offset: x.offset + x.size]
                assert rec == b"".join(ckpt.read_bytes(n) for n in expert_names(layer, x.expert))
                assert data[x.offset + x.size: x.offset + stride] == bytes(stride - x.size)
                assert hashlib.sha256(rec).hexdigest() == x.sha256 and x.offset % ALIGN == 0
                assert pack.tensor_names(layer, x.expert) == expert_names(layer, x.expert)
        info = json.loads((folder / "rank.json").read_bytes())
        hbm = [[LAYERS[int(x[2])], int(x[3])] for x in pre if x[1] == 0]
        assert info["hbm"] == hbm and info["moe_layers"] == list(layers)
        with open_checkpoint(folder) as out:
            experts = {(int(n.split(".")[3]), int(n.split(".experts.")[1].split(".")[0]))
                       for n in out.tensors if ".experts." in n}
            assert experts == {tuple(k) for k in hbm}
            dense_layers = {int(n.split(".")[3]) for n in out.tensors if n.startswith(PREFIX + ".")}
            # stage 0 runs decoder layers 0-2 (dense layer 0 goes with the first MoE layer), stage 1 layer 3
            assert dense_layers == ({0, 1, 2} if rank == 0 else {3})
            assert ("language_model.model.embed_tokens.weight" in out.tensors) == (rank == 0)
            assert ("language_model.lm_head.weight" in out.tensors) == (rank == 1)
    assert r.ranks[0].pack_records == 16 and r.ranks[1].pack_records == 8
    rep = verify_output(tmp_path / "out", source=ckpt)
    assert rep.ok, rep.problems
    assert rep.records_checked == 24


def test_cache_moet_pack(ckpt, cache_plan, tmp_path):
    r = shard_checkpoint(ckpt, cache_plan, tmp_path / "out", layout="moet", ckpt_id="tiny-id", progress=False)
    g = SlotGeometry.for_expert(256, 256)
    assert (g.slot_bytes, g.stride) == (55_296, 57_344)
    ident = PackIdentity("tiny-id", "auto", "base", 5, 8, g.slot_bytes, g.stride)  # n_layers = 4 hidden + 1
    store = tmp_path / "out" / "moet-store"
    names = sorted(p.name for p in store.iterdir())
    assert names == sorted(f"{ident.stem(0, 1, (p, 2))}{ext}" for p in (0, 1) for ext in (".json", ".pack"))
    for stage, layers in ((0, (1, 2)), (1, (3,))):
        stem = ident.stem(0, 1, (stage, 2))
        side = json.loads((store / f"{stem}.json").read_bytes())
        assert side == ident.sidecar(range(len(layers)))
        pack = store / f"{stem}.pack"
        assert pack.stat().st_size == ident.file_size
        data = pack.read_bytes()
        for key, layer in enumerate(layers):       # layer_key restarts at 0 in each stage
            for e in range(8):
                row = data[ident.row_offset(key, e): ident.row_offset(key, e) + g.stride]
                w13, w2 = slot_values(g, row)
                n = expert_names(layer, e)
                arr = {x: ckpt.read_raw(x) for x in n}
                assert np.array_equal(w13[:256], expected_values_from_mxfp4(arr[n[0]], arr[n[1]]), equal_nan=True)
                assert np.array_equal(w13[256:], expected_values_from_mxfp4(arr[n[2]], arr[n[3]]), equal_nan=True)
                assert np.array_equal(w2, expected_values_from_mxfp4(arr[n[4]], arr[n[5]]), equal_nan=True)
        # rows of other layers are holes
        assert data[ident.row_offset(len(layers), 0):] == bytes(ident.file_size - ident.row_offset(len(layers), 0))
    info = json.loads((tmp_path / "out" / "rank-00001" / "rank.json").read_bytes())
    assert info["moet"]["layer_keys"] == [[3, 0]] and info["moet"]["ckpt_id"] == "tiny-id"
    assert r.ranks[1].pack.endswith(".pp1of2.pack")
    rep = verify_output(tmp_path / "out", source=ckpt)
    assert rep.ok, rep.problems


# ------------------------------------------------------------------ resume
class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("layout", ["k3ckpt", "moet"])
def test_resume_gives_same_bytes(ckpt, cache_plan, tmp_path, monkeypatch, layout):
    ref = tmp_path / "ref"
    shard_checkpoint(ckpt, cache_plan, ref, layout=layout, progress=False)
    real = materialize._copy_expert
    calls = {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 13:          # partway into layer 2: layer 1 of stage 0 is committed
            raise Boom()
        return real(*a, **k)

    monkeypatch.setattr(materialize, "_copy_expert", dying)
    out = tmp_path / "out"
    with pytest.raises(Boom):
        shard_checkpoint(ckpt, cache_plan, out, layout=layout, progress=False)
    assert any(p.name.endswith(".building") for p in out.rglob(".*"))
    m = RunManifest.load(out)
    assert m.state == "running"
    committed = {k: v for k, v in m._data["extra"].items() if k.startswith("pack:") and v}
    assert any(v["layers"] for v in committed.values())
    monkeypatch.setattr(materialize, "_copy_expert", real)
    with pytest.raises(OutputExistsError, match="--resume"):
        shard_checkpoint(ckpt, cache_plan, out, layout=layout, progress=False)
    with pytest.raises(ResumeMismatchError):
        shard_checkpoint(ckpt, cache_plan, out, layout=layout, progress=False, resume=True, max_shard_bytes=10**6)
    counted = {"n": 0}

    def counting(*a, **k):
        counted["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(materialize, "_copy_expert", counting)
    shard_checkpoint(ckpt, cache_plan, out, layout=layout, progress=False, resume=True)
    assert counted["n"] < 24              # committed layers were not read again
    assert file_hashes(out) == file_hashes(ref)
    assert verify_output(out, source=ckpt).ok


# ------------------------------------------------------------------ bad input
def test_plan_for_another_model(ckpt, tmp_path):
    ds = parse_devices("2xH100")
    for geo, what in ((geometry(experts=16), "another model"), (geometry(layer_ids=(2, 3, 4)), "another model"),
                      (geometry(expert_bytes=EXPERT_BYTES * 2), "bytes per")):
        plan = make_plan(geo, ds, np.ones((3, geo.experts)), redundant=2)
        with pytest.raises(UsageError, match=what):
            shard_checkpoint(ckpt, plan, tmp_path / "x", progress=False)
    plan = make_plan(geometry(), ds, loads(), redundant=2, format_id="gguf-mxfp4")
    with pytest.raises(UsageError, match="format"):
        shard_checkpoint(ckpt, plan, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def test_bad_ranks_layout_and_options(ckpt, placement_plan, cache_plan, tmp_path):
    with pytest.raises(UsageError, match="rank 2 does not exist"):
        shard_checkpoint(ckpt, placement_plan, tmp_path / "x", ranks=[0, 2], progress=False)
    with pytest.raises(UsageError, match="cache plans"):
        shard_checkpoint(ckpt, placement_plan, tmp_path / "x", layout="moet", progress=False)
    with pytest.raises(UsageError, match="layout"):
        shard_checkpoint(ckpt, placement_plan, tmp_path / "x", layout="gguf", progress=False)
    with pytest.raises(UsageError, match="zero_mode"):
        shard_checkpoint(ckpt, cache_plan, tmp_path / "x", layout="moet", zero_mode="x", progress=False)
    assert not (tmp_path / "x").exists()


def test_not_mxfp4_for_moet(kimi_k2_tiny, tmp_path):
    with open_checkpoint(kimi_k2_tiny) as c:
        with pytest.raises(UnsupportedError, match="moet"):
            read_source(c, moet=True)


def test_disk_space_preflight(ckpt, cache_plan, tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    with pytest.raises(DiskSpaceError, match="needs"):
        shard_checkpoint(ckpt, cache_plan, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def test_full_disk_with_an_earlier_run_in_dst(ckpt, cache_plan, tmp_path, monkeypatch):
    """A DST holding an earlier run is reported as that (pass --resume), whatever the free space."""
    shard_checkpoint(ckpt, cache_plan, tmp_path / "x", progress=False)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    with pytest.raises(OutputExistsError, match="--resume"):
        shard_checkpoint(ckpt, cache_plan, tmp_path / "x", progress=False)


def test_dst_not_empty(ckpt, placement_plan, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "other.txt").write_text("hi")
    with pytest.raises(OutputExistsError, match="not empty"):
        shard_checkpoint(ckpt, placement_plan, tmp_path / "x", progress=False)


def test_rank_work_order(ckpt, cache_plan):
    src = read_source(ckpt)
    works = rank_work(src, cache_plan)
    assert [w.layers for w in works] == [(1, 2), (3,)]
    assert sorted(works[0].pack) == [(layer, e) for layer in (1, 2) for e in range(8)]


# ------------------------------------------------------------------ verify finds damage
def test_verify_finds_damage(ckpt, cache_plan, tmp_path, k3_tiny):
    out = tmp_path / "out"
    shard_checkpoint(ckpt, cache_plan, out, progress=False)
    assert verify_output(out).ok
    pack = out / "rank-00001" / "experts.pack"
    data = bytearray(pack.read_bytes())
    data[5000] ^= 1                          # inside the first record
    pack.write_bytes(bytes(data))
    (out / "rank-00000" / "stray.bin").write_bytes(b"x")
    (out / "rank-00001" / "rank.json").unlink()
    rep = verify_output(out)
    assert not rep.ok
    text = "\n".join(rep.problems)
    assert "rank-00001/experts.pack: sha256 differs" in text
    assert "rank-00001/experts.pack: record (layer 3" in text
    assert "rank-00000/stray.bin: not listed" in text
    assert "rank-00001/rank.json: missing" in text


def test_verify_against_another_source(ckpt, cache_plan, tmp_path):
    from k3ckpt.fixtures import make_fixture

    other = make_fixture("k3-tiny", tmp_path / "other", seed=7)
    out = tmp_path / "out"
    with open_checkpoint(other) as c2:
        shard_checkpoint(c2, cache_plan, out, layout="moet", progress=False)
    assert verify_output(out).ok                  # consistent with its own manifests
    rep = verify_output(out, source=ckpt)         # but not with this source
    text = "\n".join(rep.problems)
    assert "bytes differ from the source" in text
    assert "does not decode to the source's values" in text


# ------------------------------------------------------------------ k3ckpt pack golden vectors
def test_expert_pack_golden(tmp_path):
    """docs/formats/expert-pack.md, "Worked example": two layers x two experts of 5000 B."""
    parts = (RecordPart("gate", "packed", "U8", (2, 2000), 0, 4000),
             RecordPart("gate", "scale", "U8", (2, 500), 4000, 1000))
    recs = []
    for i, (layer, e) in enumerate(((1, 1), (1, 0), (2, 0), (2, 1))):
        body = bytes([i + 1]) * 5000
        recs.append(PackRecord(layer, e, i * 8192, 5000, hashlib.sha256(body).hexdigest()))
    pack = ExpertPack("experts.pack", 0, "mxfp4-pack-quantized", 5000, 8192, 4 * 8192, parts,
                      ("m.{layer}.e.{expert}.w1.weight_packed", "m.{layer}.e.{expert}.w1.weight_scale"), tuple(recs))
    d = pack.to_dict()
    assert d["layers"] == [{"layer": 1, "offset": 0, "count": 2}, {"layer": 2, "offset": 16384, "count": 2}]
    assert d["records"][1] == [1, 0, 8192, 5000, hashlib.sha256(b"\x02" * 5000).hexdigest()]
    assert ExpertPack.from_dict(json.loads(json.dumps(d))) == pack
    assert pack.record(2, 0).offset == 16384 and pack.tensor_names(2, 1) == ["m.2.e.1.w1.weight_packed",
                                                                              "m.2.e.1.w1.weight_scale"]
    bad = dict(d, records=[d["records"][1], d["records"][0]] + d["records"][2:])
    with pytest.raises(Exception, match="record 0"):
        ExpertPack.from_dict(bad)
    h = [r[4] for r in d["records"]]
    swapped = dict(d, records=[[2, 0, 0, 5000, h[0]], [1, 0, 8192, 5000, h[1]], [1, 1, 16384, 5000, h[2]],
                               [2, 1, 24576, 5000, h[3]]])
    with pytest.raises(InvalidFileError, match="grouped by layer"):
        ExpertPack.from_dict(swapped)
    with pytest.raises(InvalidFileError, match="layers"):
        ExpertPack.from_dict(dict(d, layers=d["layers"][:1]))
    with pytest.raises(InvalidFileError, match="malformed"):
        ExpertPack.from_dict(dict(d, parts=[{}]))
    # the pack file itself: records of bytes 1, 2, 3, 4, each padded with zeros to 8192
    builder = PackBuilder(tmp_path, "experts.pack", pack.file_size, None, "k")
    for i, r in enumerate(pack.records):
        builder.pwrite(r.offset, bytes([i + 1]) * 5000)
    data = builder.finish().read_bytes()
    assert hashlib.sha256(data).hexdigest() == GOLDEN_PACK_SHA256
    assert data[5000:8192] == bytes(3192) and data[8192:8193] == b"\x02"
    with pytest.raises(UsageError):
        pack.record(3, 0)


def test_moet_tensor_parallel_packs(ckpt, cache_plan, tmp_path):
    from k3ckpt.shard.moet_pack import split_slot
    from k3ckpt.formats.moet_w2 import pack_codes
    from k3ckpt.shard.moet_pack import expected_codes_from_mxfp4

    out = tmp_path / "out"
    shard_checkpoint(ckpt, cache_plan, out, layout="moet", ckpt_id="tiny-id", tp=2, progress=False)
    g = SlotGeometry.for_expert(256, 256, tp=2)
    assert (g.n13, g.k13, g.n2, g.k2) == (256, 256, 256, 128)
    ident = PackIdentity("tiny-id", "auto", "base", 5, 8, g.slot_bytes, g.stride)
    names = sorted(p.name for p in (out / "moet-store").iterdir())
    assert names == sorted(f"{ident.stem(t, 2, (p, 2))}{ext}" for t in (0, 1) for p in (0, 1)
                           for ext in (".json", ".pack"))
    # TP rank 1 of stage 1, layer 3 (key 0), expert 5: gate/up rows 128..255, down columns 128..255
    data = (out / "moet-store" / f"{ident.stem(1, 2, (1, 2))}.pack").read_bytes()
    row = split_slot(g, data[ident.row_offset(0, 5): ident.row_offset(0, 5) + g.stride])
    n = expert_names(3, 5)
    arr = {x: ckpt.read_raw(x) for x in n}
    assert np.array_equal(row["codes13"][:128], pack_codes(expected_codes_from_mxfp4(arr[n[0]][128:])))
    assert np.array_equal(row["sc13"][128:], arr[n[3]][128:])
    assert np.array_equal(row["codes2"], pack_codes(expected_codes_from_mxfp4(arr[n[4]][:, 64:])))
    assert np.array_equal(row["sc2"], arr[n[5]][:, 4:])
    info = json.loads((out / "rank-00001" / "rank.json").read_bytes())
    assert info["moet"]["tp"] == 2 and [p["tp_rank"] for p in info["moet"]["packs"]] == [0, 1]
    rep = verify_output(out, source=ckpt)
    assert rep.ok, rep.problems
    assert rep.records_checked == 2 * 24
    with pytest.raises(UsageError, match="tp"):
        shard_checkpoint(ckpt, cache_plan, tmp_path / "x", tp=2, progress=False)           # k3ckpt layout
    with pytest.raises(UnsupportedError, match="moet"):
        shard_checkpoint(ckpt, cache_plan, tmp_path / "x", layout="moet", tp=8, progress=False)  # 32-wide shares
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_real_k3_work_from_virtual(virtual_k3):
    """The full-size K3 (headers only): a plan's ranks, their files and the bytes the preflight counts."""
    from k3ckpt.shard.materialize import check_plan, estimate_bytes

    with open_checkpoint(virtual_k3) as c:
        src = read_source(c)
        assert (src.layers, src.experts, src.expert_bytes) == (tuple(range(1, 93)), 896, 17_547_264)
        assert (src.intermediate, src.hidden, src.num_hidden_layers, src.moet_slot_bytes()) == (3072, 3584, 93,
                                                                                                 9_289_728)
        rng = np.random.default_rng(0)
        ds = parse_devices("2xRTX-5090", nvme="4x14@8TB", host_dram="512GB")
        geo = MoEGeometry.k3()
        plan = make_plan(MoEGeometry(**{**geo.__dict__, "dense_bytes": 0}), ds, rng.lognormal(0, 1, (92, 896)),
                         mode="cache")
        for layout in ("k3ckpt", "moet"):
            check_plan(src, plan, layout)
        works = rank_work(src, plan)
        assert [(w.layers[0], w.layers[-1]) for w in works] == [(1, 46), (47, 92)]
        assert [len(w.pack) for w in works] == [46 * 896, 46 * 896]
        dense = sum(src.nbytes(n) for w in works for n in w.dense)
        assert dense == sum(src.nbytes(n) for n in src.dense)          # each dense tensor on exactly one stage
        hot = sum(len(w.experts) for w in works) * 17_547_264
        assert estimate_bytes(src, works, "moet") == dense + hot + 2 * (1 << 20) + 92 * 896 * 9_289_728
        assert estimate_bytes(src, works, "k3ckpt") == dense + hot + 2 * (1 << 20) + 92 * 896 * 17_547_264
