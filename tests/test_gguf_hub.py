"""`k3ckpt gguf hf://...` against the loopback Hub: the local run's bytes, shards staged as the
GGUF order needs them and released after their last tensor, the --max-disk budget checked before
any download, resume after a kill, and the staging folder gone at the end."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

from k3ckpt import api
from k3ckpt.errors import DiskSpaceError
from k3ckpt.gguf import manifest as M
from k3ckpt.gguf.convert import plan_gguf, write_gguf
from k3ckpt.hub import HubClient, RetryPolicy
from k3ckpt.hub.convert import gguf_from_hub
from k3ckpt.hub.staged import STAGING_DIR
from k3ckpt.io.reader import open_checkpoint
from split_kill import Killed, kill_after_split

FAST = RetryPolicy(max_retries=3, base_wait=0.01, max_wait=0.02)
K3, K2 = "moonshotai/Kimi-K3-tiny", "moonshotai/Kimi-K2-tiny"
SPLIT = 2_000_000


def digests(paths) -> dict[str, str]:
    return {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


@pytest.fixture(scope="module")
def local_k3(k3_tiny, tmp_path_factory):
    with open_checkpoint(k3_tiny) as c:
        r = write_gguf(c, tmp_path_factory.mktemp("local") / "k3.gguf", split_max_bytes=SPLIT)
    return digests(r.paths)


@pytest.fixture
def work(tmp_path):
    """Where a test writes (its tmp_path also holds the isolated HF_HOME)."""
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


@pytest.fixture
def repos(hub, k3_tiny, kimi_k2_tiny):
    return {K3: hub.add_repo(K3, k3_tiny), K2: hub.add_repo(K2, kimi_k2_tiny)}


@pytest.fixture
def client(hub, repos, monkeypatch):
    real = HubClient.__init__

    def init(self, endpoint=None, token=None, **kw):     # api.gguf makes its own client: the loopback Hub's
        real(self, endpoint or hub.endpoint, False if token is None else token, **{"retry": FAST, **kw})

    monkeypatch.setattr(HubClient, "__init__", init)
    return HubClient(hub.endpoint, token=False, retry=FAST)


def read_shards(src) -> set[str]:
    """The source shards the GGUF plan reads (k3-tiny's vision tower has a shard of its own)."""
    with open_checkpoint(src) as c:
        _, planned, _ = plan_gguf(c)
        return {c.tensors[s].shard for p in planned for s in p.recipe.sources}


def shard_sizes(src) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in Path(src).glob("*.safetensors")}


@pytest.mark.parametrize("workers", [1, 2])
def test_k3_from_the_hub_is_the_local_file(client, local_k3, k3_tiny, work, workers):
    out = work / "k3.gguf"
    run = gguf_from_hub(f"hf://{K3}", out, client=client, workers=workers, split_max_bytes=SPLIT)
    assert digests(run.result.paths) == local_k3
    assert not (work / STAGING_DIR).exists()
    used, sizes = read_shards(k3_tiny), shard_sizes(k3_tiny)
    assert len(used) < len(sizes)                       # a shard nothing reads is never downloaded
    assert run.stage.downloads == len(used) and run.stage.refetches == 0
    assert run.stage.bytes_downloaded == sum(sizes[s] for s in used)
    assert {"tiktoken.model", "tokenizer_config.json", "config.json"} <= set(run.side_files)
    m = M.GGUFManifest.load(work / "k3.k3ckpt-manifest.json")
    assert m.source_commit == run.commit and m.source["repo_id"] == K3 and m.state == "complete"
    assert sorted(p.name for p in work.iterdir()) == sorted([*local_k3, "k3.k3ckpt-manifest.json",
                                                             "k3.k3ckpt-results", "k3-report"])
    from k3ckpt.requant.report import load_report

    report = load_report(run.result.report)
    assert (report.meta.source, report.meta.source_commit) == (f"hf://{K3}", run.commit)
    assert len(report.tensors) == 3 * 3 * 8


def test_k2_from_the_hub_is_the_local_file(client, kimi_k2_tiny, work):
    with open_checkpoint(kimi_k2_tiny) as c:
        ref = write_gguf(c, work / "local" / "k2.gguf", expert_type="bf16")
    run = gguf_from_hub(f"hf://{K2}", work / "hub" / "k2.gguf", client=client, workers=2, expert_type="bf16")
    assert digests(run.result.paths) == digests(ref.paths)
    assert run.stage.refetches == 0 and not (work / "hub" / STAGING_DIR).exists()


def test_shards_go_as_soon_as_no_later_tensor_reads_them(client, local_k3, k3_tiny, work, monkeypatch):
    """Staged shards at each moment are those a written-or-pending tensor reads: never one behind
    its last reader; the output embedding's shard stays until the output tensors at the end."""
    from k3ckpt.hub.staged import ShardWindow

    with open_checkpoint(k3_tiny) as c:
        _, planned, _ = plan_gguf(c)
        last = {}
        for i, p in enumerate(planned):
            for s in p.recipe.sources:
                last[c.tensors[s].shard] = i
    real, seen = ShardWindow.release, []

    def release(self, shard):
        seen.append(shard)
        real(self, shard)

    monkeypatch.setattr(ShardWindow, "release", release)
    run = gguf_from_hub(f"hf://{K3}", work / "k3.gguf", client=client, workers=1, split_max_bytes=SPLIT)
    assert digests(run.result.paths) == local_k3
    assert seen == sorted(last, key=last.__getitem__)    # each once, in order of last use
    assert run.stage.staged == ()


def test_budget_checked_before_any_download(client, hub, k3_tiny, work):
    sizes = shard_sizes(k3_tiny)
    two = sorted(sizes.values())[-2:]
    hub.reset_log()
    with pytest.raises(DiskSpaceError) as e:
        gguf_from_hub(f"hf://{K3}", work / "k3.gguf", client=client, max_disk=5_000_000, split_max_bytes=SPLIT)
    msg = str(e.value)
    assert "--max-disk 5,000,000 bytes cannot work" in msg and f"({two[1]:,} bytes)" in msg and "\n" not in msg
    shards = [r for r in hub.requests("resolve") if r.file in sizes and r.range and r.range.startswith("bytes=0-")
              and r.sent == sizes[r.file]]
    assert shards == []                                 # headers and side files only
    assert not (work / "k3.k3ckpt-manifest.json").exists()
    assert not any(p.suffix == ".gguf" for p in work.rglob("*"))


def test_within_the_budget_peak_disk_is_bounded(client, local_k3, work):
    probe = api.gguf(f"hf://{K3}", work / "probe" / "k3.gguf", split_max_size=SPLIT, dry_run=True,
                     max_disk=10**12)
    need = probe.budget["need"]
    assert probe.budget["ok"] and probe.dry_run and not (work / "probe").exists()
    run = gguf_from_hub(f"hf://{K3}", work / "k3.gguf", client=client, max_disk=need, workers=2,
                        split_max_bytes=SPLIT)
    assert digests(run.result.paths) == local_k3 and run.result.budget["need"] == need
    assert 0 < run.stage.peak_disk <= need
    with pytest.raises(DiskSpaceError):
        gguf_from_hub(f"hf://{K3}", work / "again.gguf", client=client, max_disk=need - 4096,
                      split_max_bytes=SPLIT)


def test_dry_run_downloads_no_shard(client, hub, k3_tiny, work):
    hub.reset_log()
    r = api.gguf(f"hf://{K3}", work / "k3.gguf", split_max_size=SPLIT, dry_run=True, max_disk="1GB")
    with open_checkpoint(k3_tiny) as c:
        local = write_gguf(c, work / "local.gguf", split_max_bytes=SPLIT, dry_run=True)
    assert (r.bytes_written, r.tensors, r.bytes_by_type) == (local.bytes_written, local.tensors, local.bytes_by_type)
    assert r.estimated_seconds > 0 and r.budget["ok"] and r.budget["max_disk"] == 10**9
    assert r.hub["commit"] and r.hub["downloads"] == 0
    sizes = shard_sizes(k3_tiny)
    assert sum(q.sent for q in hub.requests("resolve") if q.file in sizes) < 200_000     # header ranges only
    assert list(work.iterdir()) == []


def test_killed_then_resumed_to_the_same_bytes(client, repos, local_k3, k3_tiny, work, monkeypatch):
    out = work / "k3.gguf"
    with monkeypatch.context() as mp:
        kill_after_split(mp, 2)
        with pytest.raises(Killed):
            gguf_from_hub(f"hf://{K3}", out, client=client, workers=2, split_max_bytes=SPLIT)
    first = json.loads((work / "k3.k3ckpt-manifest.json").read_text())["source"]["commit"]
    assert (work / STAGING_DIR).is_dir()            # staged shards stay for the resumed run
    moved = work / "moved"                          # meanwhile main moves on
    shutil.copytree(k3_tiny, moved)
    (moved / "generation_config.json").write_text("{}")
    repos[K3].add_revision("main", moved, commit="b" * 40)
    run = gguf_from_hub(f"hf://{K3}", out, client=client, workers=2, split_max_bytes=SPLIT, resume=True)
    assert run.commit == first and len(run.result.resumed) == 2
    assert digests(run.result.paths) == local_k3
    assert not (work / STAGING_DIR).exists()


def test_keep_source_keeps_the_staged_checkpoint(client, local_k3, k3_tiny, work):
    keep = work / "src"
    r = api.gguf(f"hf://{K3}", work / "k3.gguf", split_max_size=SPLIT, staging=keep, keep_source=True,
                 workers=1)
    assert digests(r.paths) == local_k3 and r.hub["side_files"]
    kept = sorted(p.name for p in keep.iterdir())
    assert kept == sorted(read_shards(k3_tiny) | set(r.hub["side_files"]))
    for name in kept:
        assert (keep / name).read_bytes() == (Path(k3_tiny) / name).read_bytes()


def test_the_command_from_the_hub(hub, client, local_k3, work):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "k3ckpt", "gguf", *map(str, args)], capture_output=True,
                              text=True, env=env, timeout=600)

    dry = cli("--hub", K3, work / "k3.gguf", "--split-max-size", "2MB", "--dry-run", "--max-disk", "1GB")
    assert dry.returncode == 0, dry.stderr
    assert "--max-disk 1,000,000,000 bytes works" in dry.stdout and "estimated about" in dry.stdout
    p = cli(f"hf://{K3}", work / "k3.gguf", "--split-max-size", "2MB", "--workers", "2", "-q")
    assert p.returncode == 0, p.stderr
    assert f"source hf://{K3}@" in p.stdout and "(0 more than once)" in p.stdout
    assert digests(sorted(work.glob("*.gguf"))) == local_k3 and not (work / STAGING_DIR).exists()
    small = cli(f"hf://{K3}", work / "k3b.gguf", "--max-disk", "1MB")
    assert small.returncode == 2 and "cannot work" in small.stderr and len(small.stderr.strip().splitlines()) == 1
