"""``plan`` and ``shard --dry-run`` on the full-size virtual K3 (92 MoE layers x 896
experts, 497,220 tensors as headers over sparse files): both finish and give K3's own
figures.  Planning is linear in the tensors and experts (a shard rank once rescanned all
82,432 experts: O(ranks x experts)).  Slow: ``-m slow`` runs them (``.ci/run`` does)."""

from __future__ import annotations

import json

import pytest

from k3ckpt.cli.main import main
from k3ckpt.placement.spec import Plan

pytestmark = pytest.mark.slow

EXPERT = 17_547_264            # one MXFP4 expert: gate, up, down packed + scales
STRIDE = -(-EXPERT // 4096) * 4096
TP4_SLOT = 2_322_432           # the runtime's TP4 slot for K3 (a 4 KiB multiple)
DENSE = 113_509_540_864


@pytest.fixture(scope="module")
def plans(virtual_k3, tmp_path_factory):
    d = tmp_path_factory.mktemp("k3plans")
    # the README's few-GPU command, verbatim but for the paths
    assert main(["plan", str(virtual_k3), "--devices", "2xRTX-5090", "--nvme", "2x14@4TB", "--dense", "host",
                 "-o", str(d / "box.json")]) == 0
    assert main(["plan", str(virtual_k3), "--devices", "64xGB200", "-o", str(d / "gb200.json")]) == 0
    return d


def test_plan_on_the_virtual_k3(plans, capsys):
    capsys.readouterr()
    box = Plan.from_json((plans / "box.json").read_text())
    assert box.mode == "cache" and box.model.moe_layers == 92 and box.model.experts == 896
    assert box.model.expert_bytes == EXPERT and box.model.model_id == "Kimi K3"
    c, r = box.cache, box.cache_report
    assert c.pp_partition == (47, 46) and c.layer_bounds.tolist() == [0, 46, 92]   # vLLM's stages of 93 layers
    assert box.devices.host_dram_bytes == 256 * 10**9 - DENSE and box.devices.reserved_bytes == 3_200_000_000
    assert c.hbm_slots.tolist() == [1641, 1641]   # (32 GB - 10 %) // 17.55 MB
    assert r.binding == "dense-stream" and r.tokens_per_s == pytest.approx(64e9 * 0.8 / DENSE)
    fastest = max((p for p in r.policies if p.policy not in ("belady", "belady-bypass")),
                  key=lambda p: p.tokens_per_s)
    assert r.best_policy == fastest.policy == c.policy
    gb = Plan.from_json((plans / "gb200.json").read_text())
    assert gb.mode == "placement" and gb.placement_report.total_slots == 1008
    assert gb.placement_report.max_gpu_memory_bytes == DENSE + 18_600_000_000 + 16 * 92 * EXPERT   # 157.94 GB


def _dry(virtual_k3, plan, dst, *extra):
    rc = main(["shard", str(virtual_k3), str(dst), "--plan", str(plan), "--dry-run", "--json", *extra])
    return rc


def test_shard_dry_run_on_the_virtual_k3(virtual_k3, plans, tmp_path, capsys):
    capsys.readouterr()
    dst = tmp_path / "out"
    rc = _dry(virtual_k3, plans / "box.json", dst)
    d = json.loads(capsys.readouterr().out)
    assert rc in (0, 2) and rc == (0 if d["fits"] else 2)   # 1.6 TB: the machine's disk decides
    assert not dst.exists() and [r["pack_records"] for r in d["ranks"]] == [46 * 896, 46 * 896]
    assert [r["pack_bytes"] for r in d["ranks"]] == [46 * 896 * STRIDE] * 2
    assert [r["experts"] for r in d["ranks"]] == [1641, 1641]   # the HBM tier, as safetensors
    assert d["total_bytes"] > 2 * 46 * 896 * STRIDE + DENSE
    rc = _dry(virtual_k3, plans / "box.json", dst, "--layout", "moet", "--tp", "4")
    m = json.loads(capsys.readouterr().out)
    assert not dst.exists() and [len(r["packs"]) for r in m["ranks"]] == [4, 4]
    assert [r["pack_bytes"] for r in m["ranks"]] == [4 * 46 * 896 * TP4_SLOT] * 2
    assert m["ranks"][1]["packs"][0].endswith(".rank0of4.pp1of2.pack")
    rc = _dry(virtual_k3, plans / "gb200.json", dst)
    g = json.loads(capsys.readouterr().out)
    assert not dst.exists() and len(g["ranks"]) == 64
    assert sum(r["experts"] for r in g["ranks"]) == 1008 * 92   # every slot's expert, no colocated replica
    assert min(r["tensors"] for r in g["ranks"]) > 15 * 92 * 6
