"""Staging hub shards for conversion: verified downloads, resume after a kill, a disk budget."""

from __future__ import annotations

import hashlib

import pytest
from hubemu.ckpts import write_sharded
from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

from k3ckpt.errors import DiskSpaceError, RemoteError
from k3ckpt.hub import HubClient, RetryPolicy
from k3ckpt.hub.remote import resolve_checkpoint
from k3ckpt.hub.stage import ShardStager

FAST = RetryPolicy(max_retries=3, base_wait=0.01, max_wait=0.02)


@pytest.fixture
def repo(hub, tmp_path):
    d = tmp_path / "src"
    write_sharded(d, 3, bulk=256 << 10)
    hub.add_repo("org/toy", d)
    client = HubClient(hub.endpoint, token=False, retry=FAST)
    files, _, _ = resolve_checkpoint("hf://org/toy", client)
    return d, files, client


def _sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_fetch_verifies_and_release_deletes(hub, repo, tmp_path):
    d, files, client = repo
    st = ShardStager(files, client, tmp_path / "stage")
    name = sorted(files.shards)[0]
    s = st.fetch(name)
    assert s.path.read_bytes() == (d / name).read_bytes() and s.sha256 == _sha(d / name)
    assert st.fetch(name) is s                      # staged once
    st.release(name)
    assert not s.path.exists()
    keep = ShardStager(files, client, tmp_path / "keep", keep=True)
    keep.release(keep.fetch(name).name)
    assert (tmp_path / "keep" / name).is_file()


def test_corrupt_bytes_are_never_used(hub, repo, tmp_path):
    _, files, client = repo
    name = sorted(files.shards)[0]
    hub.corrupt(times=1)                            # one bad response: the re-download verifies
    st = ShardStager(files, client, tmp_path / "s1")
    assert st.fetch(name).sha256 == files.shards[name].sha256
    hub.corrupt(times=None)                         # always bad: a clear error, nothing left behind
    st2 = ShardStager(files, client, tmp_path / "s2")
    with pytest.raises(RemoteError, match="do not match"):
        st2.fetch(name)
    assert not any((tmp_path / "s2").iterdir())


def test_dropped_connection_resumes(hub, repo, tmp_path):
    d, files, client = repo
    name = sorted(files.shards)[1]
    hub.drop_after(50_000, times=2)
    st = ShardStager(files, client, tmp_path / "s")
    assert st.fetch(name).path.read_bytes() == (d / name).read_bytes()
    assert client.stats.retries >= 2


def test_killed_download_continues_from_partial(hub, repo, tmp_path):
    d, files, client = repo
    name = sorted(files.shards)[2]
    stage = tmp_path / "s"
    stage.mkdir()
    partial = stage / f".{name}.partial"
    partial.write_bytes((d / name).read_bytes()[:100_000])   # what a killed run leaves
    hub.reset_log()
    st = ShardStager(files, client, stage)
    assert st.fetch(name).path.read_bytes() == (d / name).read_bytes()
    assert st.bytes_downloaded == files.shards[name].size - 100_000
    # a partial with wrong bytes fails verification once, then downloads whole
    partial2 = stage / f".{sorted(files.shards)[0]}.partial"
    partial2.write_bytes(b"\0" * 1000)
    st.fetch(sorted(files.shards)[0])


def test_budget_refuses_before_downloading(hub, repo, tmp_path):
    _, files, client = repo
    names = sorted(files.shards)
    one = max(files.shards[n].size for n in names)
    st = ShardStager(files, client, tmp_path / "s", max_bytes=one + 10)
    st.fetch(names[0])
    hub.reset_log()
    with pytest.raises(DiskSpaceError, match="budget"):
        st.fetch(names[1])
    assert not hub.requests("resolve")
    st.release(names[0])
    st.fetch(names[1])
