"""--ray: a real Ray cluster on this machine (ray.cluster_utils: a head and a second node process,
one CPU each); what requant, gguf (also from the loopback Hub) and shard write is byte for byte
what a local run writes, a killed worker's task is retried without changing a byte, a driver
stopped partway resumes with --ray to a clean run's bytes, and a cluster that cannot be reached
is one line."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

if os.environ.get("K3CKPT_REQUIRE_RAY"):   # CI: these tests must run, never skip
    import ray
else:
    ray = pytest.importorskip("ray", reason="the ray extra (pip install 'k3ckpt[ray]'); CI installs it")

from hubemu.fixtures import hub, hub_env  # noqa: E402,F401  (pytest fixtures)
from ray.cluster_utils import Cluster  # noqa: E402

from k3ckpt import api  # noqa: E402
from k3ckpt.cli.main import main  # noqa: E402
from k3ckpt.errors import UsageError  # noqa: E402
from k3ckpt.io.manifest import RunManifest  # noqa: E402
from k3ckpt.placement.devices import parse_devices  # noqa: E402
from k3ckpt.placement.planner import make_plan  # noqa: E402
from k3ckpt.raypool import KILL_ONCE_ENV  # noqa: E402
from split_kill import Killed, kill_after_split  # noqa: E402
from test_shard_materialize import EXPERT_BYTES, file_hashes, geometry, loads  # noqa: E402

LOOPBACK = {"num_cpus": 1}   # ray.cluster_utils: every node a local process
K3_REPO = "moonshotai/Kimi-K3-tiny"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={**LOOPBACK, "include_dashboard": False})
    c.add_node(**LOOPBACK)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def cache_plan():
    """tests/test_shard_materialize.py's cache plan of k3-tiny: HBM experts in safetensors, a host
    tier and NVMe packs, on 2 ranks (MoE layers 1-2 | 3)."""
    ds = parse_devices("2xRTX-5090", nvme="1x7", host_dram="1MB")
    return make_plan(geometry(dense_bytes=2 * (ds.device.hbm_bytes - 4 * EXPERT_BYTES)), ds, loads(),
                     pp_partition=[3, 1])


@pytest.fixture
def joined(cluster):
    """This process joined to the cluster (fresh per test: a test may join with its own env)."""
    ray.shutdown()
    yield cluster.address
    ray.shutdown()


def _attach(cluster, **env):
    ray.shutdown()
    ray.init(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=False)
    yield cluster.address
    ray.shutdown()


@pytest.fixture
def attached(cluster):
    """This process already in the cluster when the test starts (``connect`` then has nothing to
    reach: the Hub tests' socket guard allows loopback only, and the head listens on this
    machine's address)."""
    yield from _attach(cluster)


@pytest.fixture
def killing(cluster, tmp_path):
    """In the cluster with the raypool hook set: the first task to finish kills its worker after
    its work and before it answers, once; yields the file that says it happened."""
    marker = tmp_path / "killed-once"
    for _ in _attach(cluster, **{KILL_ONCE_ENV: str(marker)}):
        yield marker


def _same_files(a, b, names):
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def _digests(paths) -> dict[str, str]:
    return {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


@pytest.fixture
def hub_k3(hub, k3_tiny, monkeypatch):
    """k3-tiny on the loopback Hub, which every HubClient of this process talks to; its hf:// URL."""
    from k3ckpt.hub import HubClient, RetryPolicy

    hub.add_repo(K3_REPO, k3_tiny)
    real = HubClient.__init__
    fast = RetryPolicy(max_retries=3, base_wait=0.01, max_wait=0.02)

    def init(self, endpoint=None, token=None, **kw):
        real(self, endpoint or hub.endpoint, False if token is None else token, **{"retry": fast, **kw})

    monkeypatch.setattr(HubClient, "__init__", init)
    return f"hf://{K3_REPO}"


def test_requant_on_ray_is_the_local_run(k3_tiny, joined, tmp_path):
    local = api.requant(k3_tiny, tmp_path / "local", format="gguf-iq2_xs", workers=2)
    remote = api.requant(k3_tiny, tmp_path / "ray", format="gguf-iq2_xs", ray=joined)
    assert remote.shards == local.shards and _same_files(tmp_path / "local", tmp_path / "ray", local.shards)
    assert [r.to_dict() for r in remote.results] == [r.to_dict() for r in local.results]
    nodes = remote.cluster["nodes"]
    assert remote.cluster["workers"] == 2 and len(nodes) == 2          # both nodes took tasks
    assert sum(n["tasks"] for n in nodes) == len(remote.plan.weights)
    assert sum(n["source_bytes"] for n in nodes) == remote.plan.in_bytes
    assert remote.to_dict()["ray"] == remote.cluster
    report = json.loads((tmp_path / "ray" / "requant_report.json").read_text())
    assert report["tensors"] == json.loads((tmp_path / "local" / "requant_report.json").read_text())["tensors"]


def test_gguf_on_ray_is_the_local_run(k3_tiny, joined, tmp_path):
    local = api.gguf(k3_tiny, tmp_path / "local.gguf", expert_type="iq2_xs", split_max_size=None, workers=1)
    remote = api.gguf(k3_tiny, tmp_path / "ray.gguf", expert_type="iq2_xs", split_max_size=None, ray=joined)
    assert remote.paths[0].read_bytes() == local.paths[0].read_bytes()
    assert sum(n["tasks"] for n in remote.cluster["nodes"]) > 0
    rows = lambda p: json.loads((p / "requant_report.json").read_text())["tensors"]  # noqa: E731
    assert rows(remote.report) == rows(local.report)


def test_a_killed_worker_is_retried_and_the_bytes_do_not_change(k3_tiny, killing, cluster, tmp_path):
    remote = api.requant(k3_tiny, tmp_path / "ray", format="moet-w2", ray=cluster.address)
    assert killing.exists()                       # a worker did die after writing its outputs
    local = api.requant(k3_tiny, tmp_path / "local", format="moet-w2", workers=1)
    assert _same_files(tmp_path / "local", tmp_path / "ray", local.shards)
    assert [r.to_dict() for r in remote.results] == [r.to_dict() for r in local.results]


def test_an_unreachable_cluster_is_one_line(k3_tiny, tmp_path, capsys):
    ray.shutdown()
    with pytest.raises(UsageError, match="cannot reach a Ray cluster at 127.0.0.1:9"):
        api.requant(k3_tiny, tmp_path / "out", ray="127.0.0.1:9")
    assert not (tmp_path / "out").exists()
    rc = main(["requant", str(k3_tiny), str(tmp_path / "out"), "--ray", "127.0.0.1:9", "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "cannot reach a Ray cluster" in err
    with pytest.raises(UsageError, match="HOST:PORT"):
        api.requant(k3_tiny, tmp_path / "out", ray="no-port")


def test_without_ray_installed_the_flag_says_what_to_install(k3_tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "ray", None)
    with pytest.raises(UsageError, match=r"pip install 'k3ckpt\[ray\]'"):
        api.requant(k3_tiny, tmp_path / "out", ray="auto")
    assert os.environ.get(KILL_ONCE_ENV) is None


def test_gguf_from_the_hub_on_ray_is_the_local_hub_run(attached, hub_k3, tmp_path, monkeypatch):
    from k3ckpt.raypool import RayPool

    sent, real = [], RayPool.submit

    def submit(self, fn, *args, **kw):   # gguf.pool.run_task(planned, expert, entries, arrays, ...)
        sent.append((args[2], sorted(args[3] or ())))
        return real(self, fn, *args, **kw)

    monkeypatch.setattr(RayPool, "submit", submit)
    local = api.gguf(hub_k3, tmp_path / "local" / "k3.gguf", expert_type="iq2_xs", split_max_size="2MB", workers=1)
    remote = api.gguf(hub_k3, tmp_path / "ray" / "k3.gguf", expert_type="iq2_xs", split_max_size="2MB", ray=attached)
    # the weights went as Ray objects, not as paths into the driver's staging folder
    assert sent and all(entries is None and arrays for entries, arrays in sent)
    assert len(local.paths) > 1 and _digests(remote.paths) == _digests(local.paths)
    nodes = remote.cluster["nodes"]
    assert sum(n["tasks"] for n in nodes) == 3 * 3 * 8            # every routed expert went to the cluster
    assert remote.hub["downloads"] == local.hub["downloads"]      # staged once each, as without Ray
    assert not (tmp_path / "ray" / ".k3ckpt-staging").exists()
    rows = lambda r: json.loads((r.report / "requant_report.json").read_text())["tensors"]  # noqa: E731
    assert rows(remote) == rows(local)


def _stop_after_records(mp, n: int, suffix: str = "") -> list[str]:
    """The driver stops as SIGKILL would once its manifest has recorded ``n`` files ending in
    ``suffix``; returns the names recorded (filled as the run goes)."""
    real, seen = RunManifest.record, []

    def record(self, name, **kw):
        got = real(self, name, **kw)
        if name.endswith(suffix):
            seen.append(name)
            if len(seen) == n:
                raise Killed()
        return got

    mp.setattr(RunManifest, "record", record)
    return seen


def test_requant_on_ray_resumes_after_the_driver_stops(k3_tiny, joined, tmp_path, monkeypatch):
    local = api.requant(k3_tiny, tmp_path / "clean", format="gguf-iq2_xs", max_shard_size="1MB", workers=1)
    assert len(local.shards) > 3
    out = tmp_path / "ray"
    with monkeypatch.context() as mp:
        seen = _stop_after_records(mp, 2, ".safetensors")
        with pytest.raises(Killed):
            api.requant(k3_tiny, out, format="gguf-iq2_xs", max_shard_size="1MB", ray=joined)
    r = api.requant(k3_tiny, out, format="gguf-iq2_xs", max_shard_size="1MB", ray=joined, resume=True)
    assert set(r.resumed_shards) == set(seen) and r.shards == local.shards
    assert _same_files(tmp_path / "clean", out, local.shards)
    assert [x.to_dict() for x in r.results] == [x.to_dict() for x in local.results]


def test_gguf_on_ray_resumes_after_the_driver_stops(k3_tiny, joined, tmp_path, monkeypatch):
    clean = _digests(api.gguf(k3_tiny, tmp_path / "clean" / "k3.gguf", split_max_size="2MB", workers=1).paths)
    out = tmp_path / "ray" / "k3.gguf"
    with monkeypatch.context() as mp:
        kill_after_split(mp, 2)       # the driver stops as SIGKILL would once 2 files are final
        with pytest.raises(Killed):
            api.gguf(k3_tiny, out, split_max_size="2MB", ray=joined)
    kept = sorted(clean)[:2]          # the second holds experts of layers 1 and 2
    assert _digests(p for p in out.parent.iterdir() if p.suffix == ".gguf" and not p.name.startswith(".")) == \
        {n: clean[n] for n in kept}
    r = api.gguf(k3_tiny, out, split_max_size="2MB", ray=joined, resume=True)
    assert r.resumed == tuple(kept) and _digests(r.paths) == clean
    assert 0 < sum(n["tasks"] for n in r.cluster["nodes"]) < 3 * 3 * 8    # the kept files' experts not again


SHARD = "400KB"   # k3-tiny's ranks in several safetensors shards each: several shard tasks a rank


def _shard_tasks(result) -> int:
    """Tasks a fresh --ray shard run of ``cache_plan`` hands out: one per safetensors shard, one per
    pack layer (MoE layers 1, 2 and 3; one pack per rank, TP 1)."""
    return sum(f.endswith(".safetensors") for f in result.files) + 3


@pytest.mark.parametrize("layout", ["k3ckpt", "moet"])
def test_shard_on_ray_is_the_local_run(k3_tiny, cache_plan, joined, tmp_path, layout):
    local = api.shard(k3_tiny, tmp_path / "local", plan=cache_plan, layout=layout, max_shard_size=SHARD)
    remote = api.shard(k3_tiny, tmp_path / "ray", plan=cache_plan, layout=layout, max_shard_size=SHARD, ray=joined)
    assert file_hashes(tmp_path / "ray") == file_hashes(tmp_path / "local")
    assert RunManifest.load(tmp_path / "ray").records == RunManifest.load(tmp_path / "local").records
    assert remote.files == local.files and remote.ranks == local.ranks
    nodes = remote.cluster["nodes"]
    assert remote.cluster["workers"] == 2 and len(nodes) == 2          # both nodes took tasks
    assert sum(n["tasks"] for n in nodes) == _shard_tasks(remote) > 3
    assert remote.to_dict()["ray"] == remote.cluster and "ray" not in local.to_dict()
    assert api.verify(tmp_path / "ray", source=k3_tiny).ok


def test_shard_command_on_ray(k3_tiny, cache_plan, joined, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    api.save_plan(cache_plan, plan)
    args = [str(k3_tiny), "--plan", str(plan), "--max-shard-size", SHARD, "--ray", joined, "-q"]
    assert main(["shard", args[0], str(tmp_path / "a"), *args[1:], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ray"]["address"] == joined and sum(n["tasks"] for n in out["ray"]["nodes"]) > 3
    assert main(["shard", args[0], str(tmp_path / "b"), *args[1:]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"ray {joined}: ") and " task(s) on 2 node(s), 2 CPU(s)" in line for line in lines)
    assert file_hashes(tmp_path / "a") == file_hashes(tmp_path / "b")


def test_shard_on_ray_retries_a_killed_worker(k3_tiny, cache_plan, killing, cluster, tmp_path):
    remote = api.shard(k3_tiny, tmp_path / "ray", plan=cache_plan, max_shard_size=SHARD, ray=cluster.address)
    assert killing.exists()                       # a worker did die after writing its file or layer
    api.shard(k3_tiny, tmp_path / "local", plan=cache_plan, max_shard_size=SHARD)
    assert file_hashes(tmp_path / "ray") == file_hashes(tmp_path / "local")
    assert sum(n["tasks"] for n in remote.cluster["nodes"]) == _shard_tasks(remote)   # counted once


def test_shard_on_ray_resumes_after_the_driver_stops(k3_tiny, cache_plan, joined, tmp_path, monkeypatch):
    api.shard(k3_tiny, tmp_path / "clean", plan=cache_plan, max_shard_size=SHARD)
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        _stop_after_records(mp, 3)
        with pytest.raises(Killed):
            api.shard(k3_tiny, out, plan=cache_plan, max_shard_size=SHARD, ray=joined)
    assert RunManifest.load(out).state == "running" and len(RunManifest.load(out).records) == 3
    r = api.shard(k3_tiny, out, plan=cache_plan, max_shard_size=SHARD, ray=joined, resume=True)
    assert r.files_resumed == 3 and file_hashes(out) == file_hashes(tmp_path / "clean")
    assert sum(n["tasks"] for n in r.cluster["nodes"]) < _shard_tasks(r)     # the kept files not again


def test_shard_on_ray_refuses_what_it_cannot_do(k3_tiny, cache_plan, hub_k3, tmp_path, capsys):
    ray.shutdown()
    plan = tmp_path / "plan.json"
    api.save_plan(cache_plan, plan)
    rc = main(["shard", str(k3_tiny), str(tmp_path / "out"), "--plan", str(plan), "--ray", "127.0.0.1:9", "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "cannot reach a Ray cluster at 127.0.0.1:9" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(UsageError, match="hf:// source is staged on this machine only"):
        api.shard(hub_k3, tmp_path / "out", plan=cache_plan, ray="127.0.0.1:9")
    dry = api.shard(k3_tiny, tmp_path / "out", plan=cache_plan, ray="127.0.0.1:9", dry_run=True)
    assert dry.files > 0 and not ray.is_initialized() and not (tmp_path / "out").exists()
