"""Planning experts of different sizes: a ``--target-bpw`` requant output (MXFP4 and
moet-w2 experts side by side), as stored or through its requant report."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from k3ckpt import api
from k3ckpt.placement import inputs as planning
from k3ckpt.api import open_source
from k3ckpt.cli.main import main
from k3ckpt.errors import UnsupportedError, UsageError
from k3ckpt.placement import from_checkpoint as gfc
from k3ckpt.placement.cache import hot_order, rank_keys, simulate
from k3ckpt.placement.devices import parse_devices
from k3ckpt.placement.spec import MoEGeometry, Plan

from test_planning import header_sums


@pytest.fixture(scope="module")
def mixed(k3_tiny, tmp_path_factory):
    """(source, mixed output) of a --target-bpw run that keeps some experts in MXFP4."""
    dst = tmp_path_factory.mktemp("mixed") / "out"
    api.requant(k3_tiny, dst, target_bpw=3.0, workers=1, progress=False)
    return k3_tiny, dst


def _expected_table(path) -> tuple[tuple[int, ...], np.ndarray]:
    with open_source(path) as ck:
        per, _, _ = header_sums(ck)
    layers = tuple(sorted({layer for layer, _ in per}))
    experts = 1 + max(e for _, e in per)
    table = np.zeros((len(layers), experts), dtype=np.int64)
    for (layer, e), nb in per.items():
        table[layers.index(layer), e] = nb
    return layers, table


def test_mixed_output_is_planned_as_stored(mixed):
    _, out = mixed
    layers, want = _expected_table(out)
    assert want.min() < want.max()   # the run did mix formats
    with open_source(out) as ck:
        rep = gfc.moe_geometry_report(ck)
        with pytest.raises(UnsupportedError, match="--format stored"):
            gfc.moe_geometry_report(ck, format_id="mxfp4-pack-quantized")
    g = rep.geometry
    assert rep.format_id == "stored" and rep.bytes_from == "headers" and g.mixed
    assert g.layer_ids == layers and np.array_equal(g.bytes_table(), want)
    assert g.expert_bytes == want.max() and g.all_expert_bytes == want.sum()
    assert g.expert_layer_bytes == want.max(axis=1).sum()
    assert f"{want.min():,}-{want.max():,} B per expert" in rep.notes[0]


def test_report_gives_the_outputs_sizes_for_its_source(mixed, tmp_path):
    src, out = mixed
    _, want = _expected_table(out)
    with open_source(src) as ck:
        rep = gfc.moe_geometry_report(ck, requant_report=out)        # the folder holding the report
        assert rep.format_id == "stored" and rep.bytes_from == "requant report"
        assert np.array_equal(rep.geometry.bytes_table(), want)
        with pytest.raises(UsageError, match="cannot be combined"):
            gfc.moe_geometry_report(ck, format_id="moet-w2", requant_report=out)
    with open_source(out) as ck:   # on the output itself the report changes nothing
        assert np.array_equal(gfc.moe_geometry(ck, requant_report=out / "requant_report.json").bytes_table(), want)
    # a report that names weights the checkpoint lacks: refused
    other = api.make_fixture("kimi-k2-tiny", tmp_path / "k2")
    with open_source(other) as ck, pytest.raises(UsageError, match="does not have"):
        gfc.moe_geometry_report(ck, requant_report=out)


def test_geometry_table_checks_and_json_round_trip():
    g = MoEGeometry(2, 3, 1, 30, 0, (1, 2))
    assert dataclasses.replace(g, per_expert_bytes=[[30] * 3] * 2).per_expert_bytes is None   # one size: plain
    m = dataclasses.replace(g, per_expert_bytes=[[10, 20, 30], [30, 30, 30]])
    assert m.mixed and m.expert_layer_bytes == 60 and m.all_expert_bytes == 150
    assert MoEGeometry.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert "per_expert_bytes" not in g.to_dict()
    for bad, what in (([[10, 20, 30]], r"\[2\]\[3\]"), ([[10, 20, 0], [30, 30, 30]], "positive"),
                      ([[10, 20, 25], [25, 25, 25]], "largest")):
        with pytest.raises(UsageError, match=what):
            dataclasses.replace(g, per_expert_bytes=bad)


def _k3_mixed(share_mxfp4: float, seed: int = 0) -> MoEGeometry:
    k3 = MoEGeometry.k3()
    table = np.where(np.random.default_rng(seed).random((92, 896)) < share_mxfp4, 17_547_264, 9_289_728)
    return dataclasses.replace(k3, per_expert_bytes=table)


def test_cache_tiers_hold_the_hottest_experts_that_fit():
    geo = _k3_mixed(0.3)
    devices = parse_devices("2xRTX-5090", nvme="2x14", host_dram="512GB")
    p = api.plan(geo, devices, dense="host", synthetic_trace_tokens=64)
    assert p.mode == "cache" and p.format_id == "stored"
    table = geo.bytes_table().ravel()
    c = p.cache
    hbm = devices.device.hbm_bytes
    host = int(p.devices.host_dram_bytes * 0.8) // p.devices.gpus_per_node   # make_plan's host_fraction, per rank
    for r in range(2):
        a, b = int(c.layer_bounds[r]), int(c.layer_bounds[r + 1])
        loads, _, held = planning._synthetic(92, 896, 16, 1, planning.SYNTHETIC_TOKENS, 64, False)
        hottest = hot_order(loads, a, b)[::-1]
        n1, n2 = int(c.hbm_slots[r]), int(c.host_slots[r])
        used = np.cumsum(table[hottest])
        assert used[n1 - 1] <= hbm < used[n1]
        assert used[n1 + n2 - 1] - used[n1 - 1] <= host < used[n1 + n2] - used[n1 - 1]
        rows = c.preload[c.preload[:, 0] == r]
        assert sorted((rows[:, 2] * 896 + rows[:, 3]).tolist()) == sorted(hottest[: n1 + n2].tolist())
    # bytes per token: the misses' own sizes (reference simulators, recomputed here)
    row = p.cache_report.policy("lru")
    nvme = 0.0
    for r in range(2):
        a, b = int(c.layer_bounds[r]), int(c.layer_bounds[r + 1])
        keys = rank_keys(held, a, b, 896)
        order = hot_order(loads, a, b)
        n1, n2 = int(c.hbm_slots[r]), int(c.host_slots[r])
        hit1 = simulate("lru", keys, n1, order, 92 * 896, reference=True)
        miss = keys[~hit1]
        hit2 = simulate("lru", miss, n2, order[: order.size - n1], 92 * 896, reference=True)
        nvme += table[miss[~hit2]].sum() / held.shape[0]
    assert row.nvme_bytes_per_token == pytest.approx(nvme, rel=1e-12)


def test_cache_without_trace_weights_each_expert_by_its_size():
    """Loads only: the static set's missed bytes are each expert's reads x its size."""
    geo = MoEGeometry(2, 8, 2, 40, 0, (1, 2), per_expert_bytes=[[10, 20, 30, 40] * 2, [40, 30, 20, 10] * 2])
    loads = np.array([[8, 7, 6, 5, 4, 3, 2, 1], [1, 2, 3, 4, 5, 6, 7, 8]], dtype=float) * 10
    devices = parse_devices("1xRTX-5090", nvme="1x7", reserved_kv=32 * 10**9 - 70)   # 70 B of HBM
    from k3ckpt.placement.planner import make_plan

    p = make_plan(geo, devices, loads, mode="cache", host_fraction=0.0)
    n1 = int(p.cache.hbm_slots[0])
    hot = hot_order(loads, 0, 2)[::-1]
    sizes = geo.bytes_table().ravel()[hot]
    assert np.cumsum(sizes)[n1 - 1] <= 70 < np.cumsum(sizes)[n1]
    tokens = loads[0].sum() / 2                          # each layer sums to tokens x top-2
    reads = loads.ravel()[hot] / tokens                  # reads per token of each key
    s = p.cache_report.policy("static")
    assert s.nvme_bytes_per_token == pytest.approx(float((reads * sizes)[n1:].sum()))


def test_placement_sizes_slots_for_each_layers_largest_expert():
    geo = _k3_mixed(0.05)
    p = api.plan(geo, "64xGB200", synthetic_trace_tokens=0)
    r = p.placement_report
    reserved = p.devices.reserved_bytes   # the default 10 % of HBM
    assert reserved == 18_600_000_000
    assert r.max_gpu_memory_bytes == geo.dense_bytes + reserved + r.max_slots_per_gpu * geo.expert_layer_bytes
    assert geo.expert_layer_bytes == geo.bytes_table().max(axis=1).sum()
    back = Plan.from_json(p.to_json())
    assert back.model == geo and back.format_id == "stored"


def test_cli_plans_a_mixed_output_and_a_report(mixed, tmp_path, capsys):
    src, out = mixed

    def run(*args):
        rc = main(["plan", *map(str, args)])
        got = capsys.readouterr()
        return rc, got.out, got.err

    rc, text, _ = run(out, "--devices", "2xH100", "--json", "-o", tmp_path / "a.json")
    assert rc == 0
    summary = json.loads(text)
    _, want = _expected_table(out)
    assert summary["format_id"] == "stored" and summary["model"]["per_expert_bytes_summary"]["total"] == want.sum()
    rc, text, _ = run(src, "--devices", "2xH100", "--requant-report", out, "-o", tmp_path / "b.json")
    assert rc == 0 and "as stored" in text
    pa = Plan.from_json((tmp_path / "a.json").read_text())
    pb = Plan.from_json((tmp_path / "b.json").read_text())
    assert np.array_equal(pa.model.bytes_table(), pb.model.bytes_table())
    rc, _, err = run(out, "--devices", "2xH100", "--format", "mxfp4-pack-quantized")
    assert rc != 0 and "--format stored" in err and "Traceback" not in err


def test_shard_checks_expert_sizes_against_the_plan(k3_tiny, mixed):
    from k3ckpt.shard.materialize import check_plan
    from k3ckpt.shard.source import read_source

    p = api.plan(k3_tiny, "2xH100", format="stored")
    assert p.format_id == "stored" and not p.model.mixed
    with open_source(k3_tiny) as ck:
        src = read_source(ck)
        check_plan(src, p, "k3ckpt")
        table = p.model.bytes_table()
        table[0, 0] -= 4096
        mixed_plan = dataclasses.replace(p, model=dataclasses.replace(p.model, per_expert_bytes=table))
        with pytest.raises(UsageError, match="plan this checkpoint with --format stored"):
            check_plan(src, mixed_plan, "k3ckpt")
    with open_source(mixed[1]) as ck:   # the mixed output with its source's plan (one size)
        src = read_source(ck)
        assert src.mixed and src.storage == "moet-w2+mxfp4-pack-quantized"
        with pytest.raises(UsageError, match="plan this checkpoint with --format stored"):
            check_plan(src, p, "k3ckpt")
        check_plan(src, api.plan(ck, "2xH100"), "k3ckpt")
        with pytest.raises(UnsupportedError, match="layout 'moet' builds the runtime's NVMe packs from the MXFP4"):
            read_source(ck, moet=True)


@pytest.mark.parametrize("mode", ["placement", "cache"])
def test_shard_a_mixed_output(mixed, tmp_path, mode):
    """Every expert as stored; a cache rank writes one pack per record layout, each in plan order."""
    from k3ckpt.io.reader import open_checkpoint
    from k3ckpt.shard.materialize import rank_work, shard_checkpoint
    from k3ckpt.shard.packs import ExpertPack
    from k3ckpt.shard.source import read_source
    from k3ckpt.shard.verify import verify_output

    _, out = mixed
    devices = "2xH100" if mode == "placement" else parse_devices("2xRTX-5090", nvme="1x7")
    with open_checkpoint(out) as ck:
        p = api.plan(ck, devices, mode=mode)
        res = shard_checkpoint(ck, p, tmp_path / "sh", progress=False)
        rep = verify_output(tmp_path / "sh", source=ck)
        assert rep.ok, rep.problems
        if mode == "placement":
            return
        src = read_source(ck)
        for work in rank_work(src, p):
            folder = tmp_path / "sh" / work.folder
            info = json.loads((folder / "rank.json").read_text())
            names = [x["pack"] for x in info["packs"]]
            assert names[0] == "experts.pack" and len(names) > 1
            assert next(r for r in res.ranks if r.rank == work.rank).more_packs == len(names) - 1
            seen = []
            for n in names:
                pack = ExpertPack.load(folder / (n + ".json"))
                keys = [(r.layer, r.expert) for r in pack.records]
                assert keys == [k for k in work.pack if k in set(keys)]   # plan order within the pack
                assert {src.expert_size(k) for k in keys} == {pack.record_bytes}
                seen += keys
            assert sorted(seen) == sorted(work.pack)                       # every expert exactly once
        assert rep.records_checked == sum(len(w.pack) for w in rank_work(src, p))
    assert res.mode == mode


def test_shard_a_mixed_output_resumes_to_the_same_bytes(mixed, tmp_path, monkeypatch):
    import hashlib

    from k3ckpt.io.reader import open_checkpoint
    from k3ckpt.shard import materialize

    def hashes(root):
        return {q.relative_to(root).as_posix(): hashlib.sha256(q.read_bytes()).hexdigest()
                for q in sorted(root.rglob("*")) if q.is_file() and q.name != "k3ckpt-manifest.json"}

    class Boom(Exception):
        pass

    real = materialize._copy_expert
    calls = {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 13:          # partway into the second MoE layer
            raise Boom()
        return real(*a, **k)

    with open_checkpoint(mixed[1]) as ck:
        p = api.plan(ck, parse_devices("2xRTX-5090", nvme="1x7"), mode="cache")
        materialize.shard_checkpoint(ck, p, tmp_path / "ref", progress=False)
        monkeypatch.setattr(materialize, "_copy_expert", dying)
        with pytest.raises(Boom):
            materialize.shard_checkpoint(ck, p, tmp_path / "out", progress=False)
        monkeypatch.setattr(materialize, "_copy_expert", real)
        materialize.shard_checkpoint(ck, p, tmp_path / "out", progress=False, resume=True)
    assert hashes(tmp_path / "out") == hashes(tmp_path / "ref")
