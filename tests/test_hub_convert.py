"""Download-and-convert from the loopback Hub: same bytes as a local run, each shard downloaded
once, the --max-disk budget, resume after a kill at several points, and the fault paths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

from k3ckpt.errors import DiskSpaceError, RemoteError
from k3ckpt.hub import HubClient, RetryPolicy
from k3ckpt.hub import stage as stage_mod
from k3ckpt.hub.convert import requant_from_hub, shard_from_hub
from k3ckpt.hub.staged import STAGING_DIR, allocated_bytes
from k3ckpt.io.manifest import RunManifest
from k3ckpt.io.header import read_header
from k3ckpt.io.reader import open_checkpoint
from k3ckpt.requant.pipeline import requant_checkpoint

FAST = RetryPolicy(max_retries=3, base_wait=0.01, max_wait=0.02)
REPO = "moonshotai/Kimi-K3-tiny"
OPTS = dict(workers=1, progress=False, max_shard_bytes=400_000)
SIDE = ("generation_config.json", "tiktoken.model", "tokenizer_config.json")


class Killed(BaseException):
    """Stands for SIGKILL: nothing in k3ckpt catches it."""


@pytest.fixture(scope="module")
def local_out(k3_tiny, tmp_path_factory):
    """The reference: the same requant from the local folder."""
    dst = tmp_path_factory.mktemp("local") / "out"
    with open_checkpoint(k3_tiny) as c:
        requant_checkpoint(c, dst, **OPTS)
    return dst


@pytest.fixture
def served(hub, k3_tiny):
    repo = hub.add_repo(REPO, k3_tiny)
    return repo, HubClient(hub.endpoint, token=False, retry=FAST)


def shard_bytes(src: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in src.glob("*.safetensors")}


def assert_same_output(out: Path, ref: Path) -> None:
    weights = sorted(p.name for p in ref.glob("*.safetensors"))
    assert weights and sorted(p.name for p in out.glob("*.safetensors")) == weights
    for n in weights + ["model.safetensors.index.json", "config.json", *SIDE]:
        assert (out / n).read_bytes() == (ref / n).read_bytes(), n
    a, b = json.loads((out / "requant_report.json").read_text()), json.loads((ref / "requant_report.json").read_text())
    a.pop("meta"), b.pop("meta")
    assert a == b                                   # same results; only the source label differs
    assert not (out / STAGING_DIR).exists()


def test_requant_from_hub_matches_local_and_downloads_each_shard_once(served, local_out, k3_tiny, tmp_path):
    repo, client = served
    dst = tmp_path / "out"
    run = requant_from_hub(f"hf://{REPO}", dst, client=client, **OPTS)
    assert_same_output(dst, local_out)
    sizes = shard_bytes(Path(k3_tiny))
    assert run.stage.downloads == len(sizes) and run.stage.refetches == 0
    assert run.stage.bytes_downloaded == sum(sizes.values())
    assert run.commit == repo.commit() and run.source == f"hf://{REPO}@{repo.commit()}"
    assert set(run.side_files) == set(SIDE)
    m = RunManifest.load(dst)
    assert m.source["commit"] == repo.commit() and m.source["repo_id"] == REPO
    assert all(m.done(n) for n in SIDE)
    meta = json.loads((dst / "requant_report.json").read_text())["meta"]
    assert meta["source"] == run.source and meta["source_commit"] == repo.commit()


def test_budget_preflight_and_peak(served, local_out, k3_tiny, hub, tmp_path):
    _, client = served
    sizes = shard_bytes(Path(k3_tiny))
    with pytest.raises(DiskSpaceError) as e:
        requant_from_hub(f"hf://{REPO}", tmp_path / "small", client=client, max_disk=3_000_000, **OPTS)
    msg = str(e.value)
    assert "3,000,000" in msg and f"{max(sizes.values()):,}" in msg and "model-00002-of-000007" in msg
    assert not (tmp_path / "small").exists()        # refused before anything was written or downloaded
    assert sum(r.sent for r in hub.requests("resolve")) < 300_000   # header ranges only

    # a budget of one largest shard over the output estimate: within it, same bytes
    budget = run_budget = 10_000_000
    dst = tmp_path / "tight"
    run = requant_from_hub(f"hf://{REPO}", dst, client=client, max_disk=run_budget, **OPTS)
    assert run.preflight.need <= budget and run.stage.peak_disk <= budget
    assert run.stage.downloads >= len(sizes)
    assert_same_output(dst, local_out)
    assert allocated_bytes(dst) <= budget


def test_budget_too_small_for_two_shards_evicts_and_stays_within(served, local_out, tmp_path):
    _, client = served
    dst = tmp_path / "one"
    probe = requant_from_hub(f"hf://{REPO}", tmp_path / "probe", client=client, **OPTS)
    budget = probe.preflight.need + 4096             # room for the output and exactly one shard
    run = requant_from_hub(f"hf://{REPO}", dst, client=client, max_disk=budget, **OPTS)
    assert run.stage.peak_disk <= budget
    assert_same_output(dst, local_out)


def _kill_download(monkeypatch, after_calls: int):
    monkeypatch.setattr(stage_mod, "CHUNK", 256 << 10)
    real = HubClient.read_range
    calls = [0]

    def read_range(self, url, offset, out, **kw):
        if out.nbytes >= (256 << 10) or offset > 0:  # shard downloads, not header reads
            calls[0] += 1
            if calls[0] == after_calls:
                raise Killed()
        return real(self, url, offset, out, **kw)

    monkeypatch.setattr(HubClient, "read_range", read_range)


def _kill_convert(monkeypatch, after_calls: int):
    from k3ckpt.requant import worker

    real, calls = worker.compute, [0]

    def compute(*a, **kw):
        calls[0] += 1
        if calls[0] == after_calls:
            raise Killed()
        return real(*a, **kw)

    monkeypatch.setattr(worker, "compute", compute)


def _kill_side_files(monkeypatch, after_calls: int):
    from k3ckpt.hub import remote

    real, calls = remote._download, [0]

    def download(client, repo, commit, f, **kw):
        calls[0] += 1
        if f.path.endswith(SIDE[1]):
            raise Killed()
        return real(client, repo, commit, f, **kw)

    monkeypatch.setattr(remote, "_download", download)


@pytest.mark.parametrize("where,after", [("download", 12), ("download", 1), ("convert", 30), ("side-files", 1)])
def test_killed_run_resumes_to_identical_bytes(served, local_out, k3_tiny, tmp_path, monkeypatch, where, after):
    _, client = served
    dst = tmp_path / "out"
    with monkeypatch.context() as mp:
        {"download": _kill_download, "convert": _kill_convert, "side-files": _kill_side_files}[where](mp, after)
        with pytest.raises(Killed):
            requant_from_hub(f"hf://{REPO}", dst, client=client, **OPTS)
    staged_before = allocated_bytes(dst / STAGING_DIR)
    run = requant_from_hub(f"hf://{REPO}", dst, client=client, resume=True, **OPTS)
    assert_same_output(dst, local_out)
    total = sum(shard_bytes(Path(k3_tiny)).values())
    if where == "download":   # what the killed run had verified or partly fetched is not fetched again
        assert (staged_before > 0) == (after > 1)
        assert run.stage.bytes_downloaded <= total - staged_before + (256 << 10)
    if where == "side-files":  # every output shard was final: nothing is downloaded again
        assert run.result.resumed_shards and run.stage.bytes_downloaded == 0


def test_resume_reopens_the_pinned_commit(served, local_out, k3_tiny, hub, tmp_path, monkeypatch):
    repo, client = served
    first = repo.commit()
    dst = tmp_path / "out"
    with monkeypatch.context() as mp:
        _kill_convert(mp, 20)
        with pytest.raises(Killed):
            requant_from_hub(f"hf://{REPO}", dst, client=client, **OPTS)
    moved = tmp_path / "moved"                      # main moves on to a different checkpoint
    shutil.copytree(k3_tiny, moved)
    (moved / "generation_config.json").write_text("{}")
    repo.add_revision("main", moved, commit="b" * 40)
    run = requant_from_hub(f"hf://{REPO}", dst, client=client, resume=True, **OPTS)
    assert run.commit == first
    assert_same_output(dst, local_out)


def test_corrupt_shard_is_never_converted(served, local_out, k3_tiny, hub, tmp_path):
    _, client = served
    sizes = shard_bytes(Path(k3_tiny))
    third = sorted(sizes)[2]

    def download(r):  # the shard's download (one range: it is under 16 MiB), not its header read
        return r.file == third and r.range == f"bytes=0-{sizes[third] - 1}"

    hub.corrupt(times=None, match=download)
    dst = tmp_path / "out"
    with pytest.raises(RemoteError, match="do not match"):
        requant_from_hub(f"hf://{REPO}", dst, client=client, **OPTS)
    assert not (dst / STAGING_DIR / third).exists()
    # nothing from the third shard reached the output: final output shards hold only tensors
    # of the first two source shards (output names are the source's)
    with open_checkpoint(k3_tiny) as src:
        early = {n for n in src.tensors if src.tensors[n].shard < third}
    finals = [n for n in RunManifest.load(dst).records if n.endswith(".safetensors")]
    assert finals
    for name in finals:   # one shard's header (opening one file of a numbered set is refused as incomplete)
        assert set(read_header(dst / name).tensors) <= early
    hub.clear_faults()
    hub.corrupt(times=1, match=download)            # one bad answer: re-downloaded and verified
    run = requant_from_hub(f"hf://{REPO}", dst, client=client, resume=True, **OPTS)
    assert run.stage.refetches == 0
    assert_same_output(dst, local_out)


def test_server_errors_are_retried(served, local_out, k3_tiny, hub, tmp_path):
    _, client = served
    sizes = shard_bytes(Path(k3_tiny))

    def download(r):
        return r.file in sizes and r.range == f"bytes=0-{sizes[r.file] - 1}"

    faults = [hub.fail(500, times=2, match=download), hub.fail(429, times=1, retry_after=0, match=download),
              hub.fail(503, times=1, match="api-tree"), hub.drop_after(100_000, times=1, match=download)]
    run = requant_from_hub(f"hf://{REPO}", tmp_path / "out", client=client, **OPTS)
    assert [f.fired for f in faults] == [2, 1, 1, 1] and run.stage.refetches == 0
    assert_same_output(tmp_path / "out", local_out)


def test_offline_is_a_clear_error(served, hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    _, client = served
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.reset_log()
    with pytest.raises(RemoteError, match="HF_HUB_OFFLINE"):
        requant_from_hub(f"hf://{REPO}", tmp_path / "out", client=client, **OPTS)
    assert hub.log == [] and not (tmp_path / "out").exists()


def test_shard_from_hub_matches_local(served, k3_tiny, tmp_path, monkeypatch):
    from k3ckpt.placement.devices import parse_devices
    from k3ckpt.shard.materialize import shard_checkpoint
    from k3ckpt.placement.spec import MoEGeometry
    from k3ckpt.placement.planner import make_plan

    _, client = served
    expert_bytes = 3 * (256 * 128 + 256 * 8)
    geo = MoEGeometry(3, 8, 2, expert_bytes, 10**6, (1, 2, 3), "k3-tiny")
    plan = make_plan(geo, parse_devices("2xH100"), np.random.default_rng(0).lognormal(0, 1, (3, 8)), redundant=3)
    with open_checkpoint(k3_tiny) as c:
        ref = shard_checkpoint(c, plan, tmp_path / "local", progress=False)
    with monkeypatch.context() as mp:                # killed mid-download, then resumed
        _kill_download(mp, 14)
        with pytest.raises(Killed):
            shard_from_hub(f"hf://{REPO}", plan, tmp_path / "hub", client=client, max_disk=20_000_000,
                           progress=False)
    run = shard_from_hub(f"hf://{REPO}", plan, tmp_path / "hub", client=client, max_disk=20_000_000, progress=False,
                         resume=True)
    assert run.result.files == ref.files and run.stage.downloads <= len(shard_bytes(Path(k3_tiny)))
    assert run.stage.refetches == 0 and run.stage.peak_disk <= 20_000_000
    for n in ref.files:
        if n != "k3ckpt-manifest.json":
            assert (tmp_path / "hub" / n).read_bytes() == (tmp_path / "local" / n).read_bytes(), n
    assert RunManifest.load(tmp_path / "hub").source["commit"] == run.commit
    assert not (tmp_path / "hub" / STAGING_DIR).exists()


def test_staged_checkpoint_reads_like_local_and_releases_behind(hub, tmp_path):
    from hubemu.ckpts import write_sharded

    from k3ckpt.hub.staged import open_staged

    src = tmp_path / "toy"
    write_sharded(src, 4, bulk=128 << 10)
    hub.add_repo("org/toy", src)
    client = HubClient(hub.endpoint, token=False, retry=FAST)
    dst = tmp_path / "dst"
    with open_checkpoint(src) as local, open_staged("hf://org/toy", dst, client=client) as ck:
        assert not dst.exists()                     # nothing staged before the first read
        order = list(ck.shards)
        for name, e in ck.tensors.items():
            assert ck.read_bytes(name) == local.read_bytes(name)
            i = order.index(e.shard)
            assert ck.staging.stats().staged == tuple(order[max(0, i - 1):i + 1])   # window of 2
            assert sorted(p.name for p in (dst / STAGING_DIR).iterdir()) == sorted(order[max(0, i - 1):i + 1])
        first = next(iter(ck.tensors))
        assert ck.read_bytes(first) == local.read_bytes(first)    # behind the window: fetched again
        st = ck.staging.stats()
        assert st.downloads == 5 and st.refetches == 1
        ck.finish()
    assert not dst.exists() or not any(dst.iterdir())

    one = tmp_path / "one"                           # a single-file checkpoint: hf://ORG/NAME/FILE
    one.mkdir()
    shutil.copy(src / sorted(p.name for p in src.glob("*.safetensors"))[1], one / "model.safetensors")
    hub.add_repo("org/one", one)
    with open_checkpoint(one / "model.safetensors") as local, \
            open_staged("hf://org/one/model.safetensors", tmp_path / "dst1", client=client) as ck:
        assert ck.shards == ["model.safetensors"]
        for name in ck.tensors:
            assert ck.read_bytes(name) == local.read_bytes(name)
        ck.finish()

    keep = tmp_path / "keep"
    with open_staged("hf://org/toy", tmp_path / "dst2", client=client, staging=keep, keep_source=True) as ck:
        pf = ck.staging.preflight(1000)
        every = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        assert 0 <= pf.need - (pf.output_bytes + every) < 4096    # rounded up to a filesystem block
        for name in ck.tensors:
            ck.read_bytes(name)
        ck.finish()
    assert sorted(p.name for p in keep.iterdir()) == sorted(p.name for p in src.glob("*.safetensors"))
    for p in keep.iterdir():
        assert p.read_bytes() == (src / p.name).read_bytes()


def test_resume_within_the_tightest_budget(served, local_out, tmp_path, monkeypatch):
    from k3ckpt.hub.staged import open_staged
    from k3ckpt.requant.plan import plan_requant

    _, client = served
    dst = tmp_path / "out"
    with open_staged(f"hf://{REPO}", dst, client=client) as ck:
        budget = ck.staging.preflight(plan_requant(ck).total_bytes).need
    for after in (12, 20):                            # killed twice, mid-download, each time leaving a partial
        with monkeypatch.context() as mp:
            _kill_download(mp, after)
            with pytest.raises(Killed):
                requant_from_hub(f"hf://{REPO}", dst, client=client, max_disk=budget, resume=True, **OPTS)
        assert allocated_bytes(dst) <= budget
    run = requant_from_hub(f"hf://{REPO}", dst, client=client, max_disk=budget, resume=True, **OPTS)
    assert run.stage.peak_disk <= budget
    assert_same_output(dst, local_out)


def test_incomplete_hub_checkpoint_is_refused_before_any_download(hub, k3_tiny, tmp_path):
    """A repo whose layer 2 lost its routed experts: refused from the headers, nothing staged."""
    from test_incomplete import _without_layer2_experts

    from k3ckpt.errors import InvalidFileError

    src = _without_layer2_experts(k3_tiny, tmp_path / "src")
    hub.add_repo("org/broken", src)
    client = HubClient(hub.endpoint, token=False, retry=FAST)
    with pytest.raises(InvalidFileError, match="incomplete checkpoint: MoE layer"):
        requant_from_hub("hf://org/broken", tmp_path / "out", client=client, **OPTS)
    assert not (tmp_path / "out" / STAGING_DIR).exists() or not any((tmp_path / "out" / STAGING_DIR).iterdir())
