"""``k3ckpt shard`` and ``k3ckpt verify`` on the command line (in process: main(argv))."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k3ckpt.cli.main import main
from k3ckpt.placement.devices import parse_devices
from k3ckpt.placement.spec import MoEGeometry
from k3ckpt.placement.planner import make_plan

ROOT = str(Path(__file__).resolve().parents[1])
EXPERT_BYTES = 3 * (256 * 128 + 256 * 8)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    loads = np.random.default_rng(0).lognormal(0, 1, (3, 8))
    geo = MoEGeometry(3, 8, 2, EXPERT_BYTES, 10**6, (1, 2, 3), "k3-tiny")
    (d / "placement.json").write_text(make_plan(geo, parse_devices("2xH100"), loads, redundant=2).to_json())
    ds = parse_devices("2xRTX-5090", nvme="1x7", host_dram="1MB")
    geo_c = MoEGeometry(3, 8, 2, EXPERT_BYTES, 2 * (ds.device.hbm_bytes - 4 * EXPERT_BYTES), (1, 2, 3), "k3-tiny")
    (d / "cache.json").write_text(make_plan(geo_c, ds, loads).to_json())
    other = MoEGeometry(3, 16, 2, EXPERT_BYTES, 10**6, (1, 2, 3), "other")
    (d / "other.json").write_text(make_plan(other, parse_devices("2xH100"), np.ones((3, 16))).to_json())
    return d


def test_shard_then_verify(k3_tiny, plans, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["shard", str(k3_tiny), str(out), "--plan", str(plans / "cache.json"), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "cache plan, layout k3ckpt, 2 rank(s)" in text and "rank-00000/experts.pack" in text
    assert main(["verify", str(out), "--source", str(k3_tiny)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ok: ") and "24 pack record(s)" in text and "against the source" in text
    # damage: verify fails with exit status 1 and names the file
    pack = out / "rank-00000" / "experts.pack"
    data = bytearray(pack.read_bytes())
    data[100] ^= 0xFF
    pack.write_bytes(bytes(data))
    assert main(["verify", str(out), "--json"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["ok"] is False and any("rank-00000/experts.pack" in p for p in report["problems"])


def test_shard_moet_json_and_resume_flag(k3_tiny, plans, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["shard", str(k3_tiny), str(out), "--plan", str(plans / "cache.json"), "--layout", "moet",
            "--ckpt-id", "tiny", "--json", "-q"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["layout"] == "moet" and all(s["pack"].startswith("moet-store/base.v2.") for s in r["ranks"])
    # a second run into the same folder: refused, and the message says what to do
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    r2 = json.loads(capsys.readouterr().out)
    assert r2["files_resumed"] == len(r["files"]) and r2["files"] == r["files"]


def test_shard_errors_are_one_line(k3_tiny, plans, tmp_path, capsys):
    cases = [
        (["--plan", str(plans / "other.json")], "another model", "UsageError"),
        (["--plan", str(plans / "placement.json"), "--layout", "moet"], "cache plans", "UsageError"),
        (["--plan", str(plans / "placement.json"), "--ranks", "0,5"], "rank 5 does not exist", "UsageError"),
        (["--plan", str(plans / "placement.json"), "--ranks", "x"], "--ranks", "UsageError"),
        (["--plan", str(tmp_path / "missing.json")], "no such plan file", "NotFoundError"),
    ]
    for extra, what, kind in cases:
        assert main(["shard", str(k3_tiny), str(tmp_path / "o"), *extra, "-q"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and what in err and f"[{kind}]" not in err, err
    assert not (tmp_path / "o").exists()
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "no such output folder" in capsys.readouterr().err


def test_moet_layout_on_a_requant_output_names_the_real_reason(k3_tiny, plans, tmp_path, capsys):
    """A moet-w2 output has 2-bit experts; the runtime's packs come from the MXFP4
    checkpoint (was: "needs gate scale U8 [256, 4] in every expert")."""
    w2 = tmp_path / "w2"
    assert main(["requant", str(k3_tiny), str(w2), "--format", "moet-w2", "--workers", "1", "-q"]) == 0
    capsys.readouterr()
    assert main(["shard", str(w2), str(tmp_path / "o"), "--plan", str(plans / "cache.json"), "--layout", "moet",
                 "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "k3ckpt requant output (moet-w2 experts): pass the MXFP4 checkpoint it was made from as SRC" in err
    assert "gate scale" not in err and not (tmp_path / "o").exists()


def test_shard_dry_run_writes_nothing_and_matches_the_run(k3_tiny, plans, tmp_path, capsys, monkeypatch):
    dry, out = tmp_path / "dry", tmp_path / "out"
    args = ["--plan", str(plans / "cache.json"), "-q"]
    assert main(["shard", str(k3_tiny), str(dry), *args, "--dry-run", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert not dry.exists() and d["dry_run"] is True and d["fits"] is True
    assert [r["folder"] for r in d["ranks"]] == ["rank-00000", "rank-00001"]
    assert main(["shard", str(k3_tiny), str(out), *args, "--json"]) == 0
    real = json.loads(capsys.readouterr().out)
    on_disk = sorted(p for p in out.rglob("*") if p.is_file())
    assert d["files"] == len(on_disk)
    for r, s in zip(d["ranks"], real["ranks"], strict=True):
        assert (r["tensors"], r["experts"], r["pack_records"]) == (s["tensors"], s["experts"], s["pack_records"])
        assert r["shards"] == len(list((out / r["folder"]).glob("*.safetensors")))
        assert r["pack_bytes"] == (out / r["folder"] / "experts.pack").stat().st_size
    data = sum(r["tensor_bytes"] + r["pack_bytes"] for r in d["ranks"])
    assert data <= real["bytes_written"] <= d["total_bytes"]   # headers and JSON within the per-rank slack
    # the text form, and a disk too small: exit 2, still nothing written
    assert main(["shard", str(k3_tiny), str(dry), *args, "--dry-run"]) == 0
    assert "nothing written (--dry-run)" in capsys.readouterr().out
    import k3ckpt.shard.dryrun as dr

    monkeypatch.setattr(dr, "_free", lambda _dst: 1000)
    assert main(["shard", str(k3_tiny), str(dry), *args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"output needs {d['total_bytes']:,} bytes but only 1,000 are free" in err and not dry.exists()
    # the checks of a real run: a placement plan has no moet packs
    assert main(["shard", str(k3_tiny), str(dry), "--plan", str(plans / "placement.json"), "--layout", "moet",
                 "--dry-run"]) == 2
    assert "cache plans" in capsys.readouterr().err and not dry.exists()


def test_shard_sizes_need_a_unit(k3_tiny, plans, tmp_path, capsys):
    assert main(["shard", str(k3_tiny), str(tmp_path / "o"), "--plan", str(plans / "placement.json"),
                 "--max-shard-size", "5000000", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-shard-size: '5000000' has no unit; give a unit, e.g. 5000000GB" in err
    assert not (tmp_path / "o").exists()


def test_placement_ranks_option(k3_tiny, plans, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["shard", str(k3_tiny), str(out), "--plan", str(plans / "placement.json"), "--ranks", "1",
                 "--max-shard-size", "1MB", "-q"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["k3ckpt-manifest.json", "plan.json", "rank-00001"]
    shards = sorted(p.name for p in (out / "rank-00001").glob("*.safetensors"))
    assert len(shards) > 1   # 1 MB shards
    capsys.readouterr()
    assert main(["verify", str(out), "--source", str(k3_tiny)]) == 0


def test_help_stays_light():
    env = {**os.environ, "PYTHONPATH": ROOT}
    code = ("import sys; from k3ckpt.cli.main import main; main(['shard', '--help']); main(['verify', '--help']);"
            "print('HEAVY' if {'numba', 'huggingface_hub', 'numpy'} & set(sys.modules) else 'LIGHT')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert "--layout" in out and "--source" in out and out.strip().endswith("LIGHT")


def test_plans_from_the_planner(k3_tiny, tmp_path, capsys):
    """Plans made by ``k3ckpt plan`` (library side) from the checkpoint itself shard as they are:
    a moet-w2 cache plan with layout moet; the same plan is refused for layout k3ckpt (other bytes)."""
    from k3ckpt import api

    plan = api.plan(k3_tiny, "2xRTX-5090", format="moet-w2", mode="cache")
    (tmp_path / "plan.json").write_text(plan.to_json())
    base = ["shard", str(k3_tiny), "--plan", str(tmp_path / "plan.json"), "-q"]
    assert main(base[:2] + [str(tmp_path / "m")] + base[2:] + ["--layout", "moet"]) == 0
    assert main(["verify", str(tmp_path / "m"), "--source", str(k3_tiny)]) == 0
    capsys.readouterr()
    assert main(base[:2] + [str(tmp_path / "k")] + base[2:]) == 2
    assert "'moet-w2'" in capsys.readouterr().err
