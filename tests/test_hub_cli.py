"""``k3ckpt inspect hf://...`` in a subprocess, pointed at the loopback Hub by HF_ENDPOINT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

ROOT = str(Path(__file__).resolve().parents[1])


def run(hub, *args, **env):
    full = {**os.environ, "HF_ENDPOINT": hub.endpoint, "PYTHONPATH": ROOT, **env}
    return subprocess.run([sys.executable, "-m", "k3ckpt", *map(str, args)], capture_output=True, text=True,
                          env=full, timeout=300)


def test_inspect_hf_url_reports_like_local(hub, k3_tiny):
    repo = hub.add_repo("moonshotai/Kimi-K3-tiny", k3_tiny)
    remote = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny", "--json")
    assert remote.returncode == 0, remote.stderr
    local = run(hub, "inspect", k3_tiny, "--json")
    assert local.returncode == 0, local.stderr
    r, lo = json.loads(remote.stdout), json.loads(local.stdout)
    facts = r["extra"]["hub"]
    assert facts["commit"] == repo.commit() and facts["endpoint"] == hub.endpoint
    assert 0 < facts["bytes_fetched"] < sum(p.stat().st_size for p in Path(k3_tiny).iterdir()) / 4
    for k in ("source", "extra"):
        r.pop(k), lo.pop(k)
    assert r == lo
    text = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny")
    assert text.returncode == 0 and "fetched" in text.stdout


def test_hub_flag_takes_a_bare_repo_id(hub, k3_tiny):
    hub.add_repo("moonshotai/Kimi-K3-tiny", k3_tiny)
    url = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny", "--json")
    bare = run(hub, "inspect", "--hub", "moonshotai/Kimi-K3-tiny", "--json")
    assert url.returncode == 0 and bare.returncode == 0, bare.stderr
    a, b = json.loads(url.stdout), json.loads(bare.stdout)
    a["extra"]["hub"].pop("bytes_fetched"), b["extra"]["hub"].pop("bytes_fetched")
    assert a == b
    bad = run(hub, "inspect", "--hub", "/abs/path")
    assert bad.returncode == 2 and "ORG/NAME" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    local = run(hub, "inspect", k3_tiny, "--json")    # without --hub a path stays a path
    assert local.returncode == 0 and json.loads(local.stdout)["source"] == str(k3_tiny)


def test_inspect_hf_url_errors_are_one_line(hub, k3_tiny):
    hub.add_repo("moonshotai/Kimi-K3-tiny", k3_tiny)
    bad = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny@nope")
    assert bad.returncode == 2
    assert "no revision 'nope'" in bad.stderr and "Error]" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    malformed = run(hub, "inspect", "hf://justone")
    assert malformed.returncode == 2 and "hf://ORG/NAME[@REVISION][/SUBFOLDER]" in malformed.stderr
    hub.reset_log()
    offline = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny", HF_HUB_OFFLINE="1")
    assert offline.returncode == 2 and "cache" in offline.stderr
    assert hub.log == []


def test_requant_cli_downloads_converts_within_budget_and_pushes(hub, k3_tiny, tmp_path):
    repo = hub.add_repo("moonshotai/Kimi-K3-tiny", k3_tiny)
    dst = tmp_path / "out"
    r = run(hub, "requant", "hf://moonshotai/Kimi-K3-tiny", dst, "--workers", "1", "--max-disk", "20MB",
            "--push-to-hub", "me/K3-tiny-w2", "--json", HF_TOKEN="hf_test")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    facts, pushed = out["hub"], out["pushed"]
    shards = sorted(Path(k3_tiny).glob("*.safetensors"))
    assert facts["commit"] == repo.commit() and facts["downloads"] == len(shards) and facts["refetches"] == 0
    assert facts["bytes_downloaded"] == sum(p.stat().st_size for p in shards)
    assert facts["peak_disk"] <= facts["max_disk"] == 20_000_000
    pushed_repo = hub.repos["me/K3-tiny-w2"]
    assert pushed["commit"] == pushed_repo.commit() and "README.md" in pushed_repo.resolve("main").files
    assert not (dst / ".k3ckpt-staging").exists()
    text = run(hub, "requant", "hf://moonshotai/Kimi-K3-tiny", tmp_path / "text", "--workers", "1", "-q")
    assert text.returncode == 0, text.stderr
    assert f"source hf://moonshotai/Kimi-K3-tiny@{repo.commit()}: {len(shards)} shard(s) staged (0 more than once)" in text.stdout


def test_requant_cli_hub_option_errors(hub, k3_tiny, tmp_path):
    hub.add_repo("moonshotai/Kimi-K3-tiny", k3_tiny)
    small = run(hub, "requant", "hf://moonshotai/Kimi-K3-tiny", tmp_path / "a", "--max-disk", "3MB")
    assert small.returncode == 2 and "largest source shard" in small.stderr
    assert len(small.stderr.strip().splitlines()) == 1 and not (tmp_path / "a").exists()
    local = run(hub, "requant", k3_tiny, tmp_path / "b", "--max-disk", "1TB")
    assert local.returncode == 2 and "only for an hf:// source" in local.stderr
    lonely = run(hub, "requant", k3_tiny, tmp_path / "c", "--private")
    assert lonely.returncode == 2 and "--push-to-hub" in lonely.stderr
    bad = run(hub, "requant", k3_tiny, tmp_path / "d", "--push-to-hub", "not a repo")
    assert bad.returncode == 2 and "--push-to-hub" in bad.stderr
    offline = run(hub, "requant", "hf://moonshotai/Kimi-K3-tiny", tmp_path / "e", HF_HUB_OFFLINE="1")
    assert offline.returncode == 2 and "HF_HUB_OFFLINE" in offline.stderr


def test_shard_cli_from_hub(hub, k3_tiny, tmp_path):
    import numpy as np

    from k3ckpt.placement.devices import parse_devices
    from k3ckpt.placement.spec import MoEGeometry
    from k3ckpt.placement.planner import make_plan

    hub.add_repo("moonshotai/Kimi-K3-tiny", k3_tiny)
    geo = MoEGeometry(3, 8, 2, 3 * (256 * 128 + 256 * 8), 10**6, (1, 2, 3), "k3-tiny")
    plan = make_plan(geo, parse_devices("2xH100"), np.random.default_rng(0).lognormal(0, 1, (3, 8)), redundant=3)
    (tmp_path / "plan.json").write_text(plan.to_json())
    r = run(hub, "shard", "hf://moonshotai/Kimi-K3-tiny", tmp_path / "out", "--plan", tmp_path / "plan.json",
            "--max-disk", "20MB", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["hub"]["downloads"] == len(list(Path(k3_tiny).glob("*.safetensors")))
    assert len(out["ranks"]) == 2 and not (tmp_path / "out" / ".k3ckpt-staging").exists()


def test_requant_cli_dry_run_checks_the_budget_without_downloading(hub, k3_tiny, tmp_path):
    hub.add_repo("moonshotai/Kimi-K3-tiny", k3_tiny)
    ok = run(hub, "requant", "hf://moonshotai/Kimi-K3-tiny", tmp_path / "a", "--dry-run", "--max-disk", "20MB")
    assert ok.returncode == 0, ok.stderr
    assert "--max-disk 20.00 MB works: a run needs" in ok.stdout
    small = run(hub, "requant", "hf://moonshotai/Kimi-K3-tiny", tmp_path / "a", "--dry-run", "--max-disk", "3MB",
                "--json")
    assert small.returncode == 0, small.stderr
    budget = json.loads(small.stdout)["max_disk"]
    assert budget["ok"] is False and budget["need"] > 3_000_000 == budget["max_disk"]
    assert not (tmp_path / "a").exists()
    assert sum(r.sent for r in hub.requests("resolve")) < 300_000     # headers only, twice


def test_revision_picks_the_source_and_push_revision_the_branch(hub, k3_tiny, tmp_path):
    repo = hub.add_repo("moonshotai/Kimi-K3-tiny", k3_tiny, revisions={"v2": k3_tiny})
    at = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny", "--revision", "v2", "--json")
    assert at.returncode == 0, at.stderr
    assert json.loads(at.stdout)["extra"]["hub"]["commit"] == repo.commit("v2")
    missing = run(hub, "inspect", "--hub", "moonshotai/Kimi-K3-tiny", "--revision", "nope")
    assert missing.returncode == 2 and "no revision 'nope'" in missing.stderr
    both = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny@main", "--revision", "v2")
    assert both.returncode == 2 and "give one" in both.stderr
    local = run(hub, "requant", k3_tiny, tmp_path / "a", "--revision", "v2")
    assert local.returncode == 2 and "local path" in local.stderr and not (tmp_path / "a").exists()
    r = run(hub, "requant", "hf://moonshotai/Kimi-K3-tiny", tmp_path / "b", "--revision", "v2", "--workers", "1",
            "--push-to-hub", "me/K3-tiny-w2", "--push-revision", "w2", "--json", HF_TOKEN="hf_test")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["hub"]["commit"] == repo.commit("v2")
    assert set(hub.repos["me/K3-tiny-w2"].refs) == {"main", "w2"}
