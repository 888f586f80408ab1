"""--ray: a real Ray cluster on this machine (ray.cluster_utils: a head and a second node process,
one CPU each); what it writes is byte for byte what a local run writes, a killed worker's task is
retried without changing a byte, and a cluster that cannot be reached is one line."""

from __future__ import annotations

import json
import os

import pytest

if os.environ.get("K3CKPT_REQUIRE_RAY"):   # CI: these tests must run, never skip
    import ray
else:
    ray = pytest.importorskip("ray", reason="the ray extra (pip install 'k3ckpt[ray]'); CI installs it")

from ray.cluster_utils import Cluster  # noqa: E402

from k3ckpt import api  # noqa: E402
from k3ckpt.cli.main import main  # noqa: E402
from k3ckpt.errors import UsageError  # noqa: E402
from k3ckpt.raypool import KILL_ONCE_ENV  # noqa: E402

LOOPBACK = {"num_cpus": 1}   # ray.cluster_utils: every node a local process


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={**LOOPBACK, "include_dashboard": False})
    c.add_node(**LOOPBACK)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def joined(cluster):
    """This process joined to the cluster (fresh per test: a test may join with its own env)."""
    ray.shutdown()
    yield cluster.address
    ray.shutdown()


def _same_files(a, b, names):
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


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


def test_a_killed_worker_is_retried_and_the_bytes_do_not_change(k3_tiny, cluster, tmp_path):
    marker = tmp_path / "killed-once"
    ray.shutdown()
    ray.init(address=cluster.address, runtime_env={"env_vars": {KILL_ONCE_ENV: str(marker)}},
             log_to_driver=False)
    try:
        remote = api.requant(k3_tiny, tmp_path / "ray", format="moet-w2", ray=cluster.address)
    finally:
        ray.shutdown()
    assert marker.exists()                        # a worker did die after writing its outputs
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
