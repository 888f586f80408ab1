"""hf:// checkpoints against the loopback Hub: same view as local, range reads,
bytes fetched, revision pinning, subfolders, path tricks, tokens, offline mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hubemu.ckpts import INDEX, write_index, write_sharded, write_single
from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

from k3ckpt.errors import InvalidFileError, NotFoundError, RemoteError, UnsafePathError
from k3ckpt.hub import HubClient, open_hub_checkpoint
from k3ckpt.io import open_checkpoint, read_header
from k3ckpt.io.reader import check_shard_name

CONFIG = {"model_type": "toy", "num_hidden_layers": 3}


def _open(emu, url, **kw):
    return open_hub_checkpoint(url, endpoint=emu.endpoint, token=False, **kw)


def _same_view(remote, local) -> None:
    assert remote.shards == local.shards
    assert remote.config == local.config
    assert remote.index_metadata == local.index_metadata
    assert list(remote.tensors) == list(local.tensors)
    for name, e in local.tensors.items():
        assert remote.tensors[name] == e  # info (dtype, shape, offsets), shard and absolute offset
    assert {s: h.file_size for s, h in remote.headers.items()} == {s: h.file_size for s, h in local.headers.items()}


@pytest.fixture
def toy(tmp_path):
    d = tmp_path / "toy"
    tensors = write_sharded(d, 3, config=CONFIG)
    return d, tensors


def test_remote_lists_what_local_lists(hub, toy):
    d, _ = toy
    repo = hub.add_repo("org/toy", d)
    with _open(hub, "hf://org/toy") as remote, open_checkpoint(d) as local:
        _same_view(remote, local)
        assert remote.hub.commit == repo.commit("main")
        facts = remote.hub.facts()
        assert facts["repo_id"] == "org/toy" and facts["commit"] == repo.commit("main")
        assert facts["revision"] is None and facts["endpoint"] == hub.endpoint and facts["offline"] is False
        assert facts["repo_checkpoint_bytes"] == sum(p.stat().st_size for p in d.iterdir())
        json.dumps(facts)


def test_range_reads_equal_local_bytes(hub, toy):
    d, tensors = toy
    hub.add_repo("org/toy", d)
    with _open(hub, "hf://org/toy") as remote, open_checkpoint(d) as local:
        before = remote.hub.bytes_fetched
        asked = 0
        for name in tensors:
            assert remote.read_bytes(name) == local.read_bytes(name)
            np.testing.assert_array_equal(remote.read_raw(name), local.read_raw(name))
            asked += 2 * local.entry(name).nbytes
        big = next(n for n in tensors if n.endswith(".blocks"))
        np.testing.assert_array_equal(remote.read_rows(big, 5, 17), local.read_rows(big, 5, 17))
        assert remote.read_bytes(big, 1000, 1003) == local.read_bytes(big, 1000, 1003)
        assert b"".join(remote.iter_chunks(big, 7777)) == local.read_bytes(big)
        asked += 12 * 64 + 3 + local.entry(big).nbytes
        # exactly the requested bytes, no read-ahead
        assert remote.hub.bytes_fetched - before == asked
        assert all(r.status == 206 and r.range for r in hub.requests("resolve") if r.file.endswith(".safetensors"))


def test_open_fetches_index_and_headers_only(hub, toy):
    d, _ = toy
    hub.add_repo("org/toy", d)
    with _open(hub, "hf://org/toy") as remote:
        fetched = remote.hub.bytes_fetched
    heads = {p.name: 8 + read_header(p).header_size for p in d.glob("*.safetensors")}
    sizes = {p.name: p.stat().st_size for p in d.glob("*.safetensors")}
    small = (d / INDEX).stat().st_size + (d / "config.json").stat().st_size
    # per shard: the header, plus what the first read's guess (from the index) overshoots
    assert small + sum(heads.values()) <= fetched <= small + sum(2 * h + 8192 for h in heads.values())
    assert fetched < sum(sizes.values()) // 10
    shard_reqs = [r for r in hub.requests("resolve") if r.file in heads]
    assert {r.file for r in shard_reqs} == set(heads)
    for r in shard_reqs:
        assert r.method == "GET" and r.status == 206
        start, end = (int(x) for x in r.range.removeprefix("bytes=").split("-"))
        assert end < 2 * heads[r.file] + 8192  # never into the bulk of the data
    # client and server agree on the file bytes that moved
    file_bytes = sum(r.sent for r in hub.requests("resolve"))
    assert file_bytes == fetched
    assert sum(r.sent for r in hub.log) < fetched + 16_000  # + the API's small JSON answers


def test_revision_pinned_to_commit(hub, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_sharded(a, 2, seed=0)
    tb = write_sharded(b, 2, seed=10)
    repo = hub.add_repo("org/pin", a, revisions={"v2": b})
    sha_b = repo.commit("v2")
    with _open(hub, "hf://org/pin@v2") as ck:
        assert ck.hub.commit == sha_b and ck.hub.facts()["revision"] == "v2"
        assert set(ck.tensors) == set(tb)
        # every file request named the commit, never the branch
        assert all(f"/resolve/{sha_b}/" in r.path for r in hub.requests("resolve"))
        # the branch moves on; reads keep coming from the pinned commit
        repo.refs["v2"] = repo.commit("main")
        name = next(iter(tb))
        assert ck.read_bytes(name) == tb[name].tobytes()
    with _open(hub, f"hf://org/pin@{sha_b}") as ck:
        assert ck.hub.commit == sha_b


def test_bad_revision_and_repo(hub, toy):
    d, _ = toy
    hub.add_repo("org/toy", d)
    with pytest.raises(NotFoundError, match="has no revision 'nope'"):
        _open(hub, "hf://org/toy@nope")
    with pytest.raises(NotFoundError, match=r"no model repo 'org/missing'.*HF_TOKEN"):
        _open(hub, "hf://org/missing")
    with pytest.raises(NotFoundError, match="no such file or folder"):
        _open(hub, "hf://org/toy/not-here")


def test_subfolder(hub, tmp_path):
    root = tmp_path / "repo"
    sub = root / "ckpt" / "bf16"
    write_sharded(sub, 2, config=CONFIG)
    (root / "README.md").write_text("hello")
    write_single(root / "ckpt" / "other.safetensors")
    hub.add_repo("org/sub", root)
    with _open(hub, "hf://org/sub/ckpt/bf16") as remote, open_checkpoint(sub) as local:
        _same_view(remote, local)
        assert remote.hub.facts()["subfolder"] == "ckpt/bf16"
    # a folder without an index: its *.safetensors files, like a local folder
    with _open(hub, "hf://org/sub/ckpt") as remote, open_checkpoint(root / "ckpt") as local:
        assert remote.shards == ["other.safetensors"]
        _same_view(remote, local)


def test_single_file(hub, tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    t = write_single(root / "model.safetensors")
    (root / "config.json").write_text(json.dumps(CONFIG))
    write_sharded(root / "unrelated", 2)
    hub.add_repo("org/one", root)
    with _open(hub, "hf://org/one/model.safetensors") as remote, \
            open_checkpoint(root / "model.safetensors") as local:
        _same_view(remote, local)
        assert remote.config == CONFIG
        name = next(iter(t))
        assert remote.read_bytes(name) == t[name].tobytes()
    with pytest.raises(NotFoundError):
        _open(hub, "hf://org/one/missing.safetensors")


def test_index_may_name_shards_in_subfolders(hub, tmp_path):
    d = tmp_path / "nested"
    (d / "part").mkdir(parents=True)
    t0 = write_single(d / "part" / "a.safetensors", seed=0)
    t1 = write_single(d / "b.safetensors", seed=1)
    write_index(d, {**{n: "part/a.safetensors" for n in t0}, **{n: "b.safetensors" for n in t1}})
    hub.add_repo("org/nested", d)
    with _open(hub, "hf://org/nested") as remote, open_checkpoint(d) as local:
        _same_view(remote, local)
    assert hub.requests("api-paths-info")  # sizes of nested shards asked for exactly


@pytest.mark.parametrize("bad", ["../evil.safetensors", "/abs.safetensors", "a/./b.safetensors",
                                 "a\\b.safetensors", "", "x//y.safetensors"])
def test_path_tricks_in_remote_index_refused(hub, tmp_path, bad):
    d = tmp_path / "tricky"
    d.mkdir()
    t = write_single(d / "ok.safetensors")
    wm = {n: "ok.safetensors" for n in t}
    wm["trick"] = bad
    write_index(d, wm)
    hub.add_repo("org/tricky", d)
    with pytest.raises((UnsafePathError, InvalidFileError)) as ei:
        _open(hub, "hf://org/tricky")
    with pytest.raises(type(ei.value)):  # the reader's own rule gives the same verdict
        check_shard_name(bad, source="x")
    assert "hf://org/tricky@" in str(ei.value)
    assert not [r for r in hub.requests("resolve") if r.file and r.file.endswith(".safetensors")]


def test_index_naming_a_missing_shard(hub, tmp_path):
    d = tmp_path / "gap"
    d.mkdir()
    t = write_single(d / "a.safetensors")
    write_index(d, {**{n: "a.safetensors" for n in t}, "lost": "b.safetensors"})
    hub.add_repo("org/gap", d)
    with pytest.raises(NotFoundError, match="'b.safetensors'"):
        _open(hub, "hf://org/gap")


def test_hostile_header_named_by_url_and_not_downloaded(hub, tmp_path):
    d = tmp_path / "hostile"
    d.mkdir()
    (d / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}" + bytes(1_000_000))
    hub.add_repo("org/hostile", d)
    with pytest.raises(InvalidFileError, match=r"hf://org/hostile@[0-9a-f]{40}/model.safetensors.*exceeds"):
        _open(hub, "hf://org/hostile")
    assert hub.bytes_served < 100_000  # one first read, then the length field is refused

    e = tmp_path / "badjson"
    e.mkdir()
    (e / "model.safetensors").write_bytes((9).to_bytes(8, "little") + b'{"a": 1} ')
    hub.add_repo("org/badjson", e)
    with pytest.raises(InvalidFileError, match=r"^hf://org/badjson@[0-9a-f]{40}/model.safetensors: "):
        _open(hub, "hf://org/badjson")


def test_listing_size_must_match_the_served_file(hub, tmp_path, monkeypatch):
    d = tmp_path / "grown"
    d.mkdir()
    write_single(d / "model.safetensors")
    entry = hub.add_repo("org/grown", d).resolve("main").files["model.safetensors"]
    listed = entry.tree_entry()
    listed["size"] -= 1  # the tree listing now disagrees with the bytes served
    monkeypatch.setattr(entry, "tree_entry", lambda: listed)
    with pytest.raises(RemoteError, match=r"100,488 bytes on the server, the listing said 100,487"):
        _open(hub, "hf://org/grown")


def test_token_sent_only_when_given(hub, toy, monkeypatch):
    d, _ = toy
    hub.add_repo("org/toy", d)
    with _open(hub, "hf://org/toy"):
        pass
    assert hub.log and not any(r.auth for r in hub.log)
    hub.reset_log()
    with open_hub_checkpoint("hf://org/toy", endpoint=hub.endpoint, token="hf_test_token") as ck:
        ck.read_bytes(next(iter(ck.tensors)))
    assert hub.log and all(r.auth for r in hub.log)
    hub.reset_log()
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")  # huggingface_hub's own lookup, as users set it
    with open_hub_checkpoint("hf://org/toy", endpoint=hub.endpoint):
        pass
    assert hub.log and all(r.auth for r in hub.log)


def test_index_and_config_come_from_the_hf_cache(hub, toy, hub_env):
    d, _ = toy
    hub.add_repo("org/toy", d)
    with _open(hub, "hf://org/toy") as first:
        assert first.hub.bytes_fetched > (d / INDEX).stat().st_size
        sha = first.hub.commit
    assert list((hub_env / "hub" / "models--org--toy" / "snapshots" / sha).glob("*.json"))
    hub.reset_log()
    with _open(hub, f"hf://org/toy@{sha}") as again:
        # only headers move again: index and config are cached under HF_HOME
        heads = sum(8 + read_header(p).header_size for p in d.glob("*.safetensors"))
        assert heads <= again.hub.bytes_fetched < heads + 3 * (4096 + heads)
        assert not [r for r in hub.requests("resolve") if r.file in (INDEX, "config.json") and r.method == "GET"]


def test_offline_nothing_cached(hub, toy, monkeypatch):
    from huggingface_hub import constants

    d, _ = toy
    hub.add_repo("org/toy", d)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RemoteError, match=r"hf://org/toy: not in the local Hugging Face cache"):
        _open(hub, "hf://org/toy")
    assert hub.log == []


def test_offline_uses_a_complete_cached_snapshot(hub, toy, monkeypatch):
    from huggingface_hub import constants, snapshot_download

    d, tensors = toy
    repo = hub.add_repo("org/toy", d)
    snapshot_download("org/toy", endpoint=hub.endpoint, token=False)
    hub.reset_log()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with _open(hub, "hf://org/toy") as ck, open_checkpoint(d) as local:
        _same_view(ck, local)
        name = next(iter(tensors))
        assert ck.read_bytes(name) == tensors[name].tobytes()
        facts = ck.hub.facts()
        assert facts["offline"] is True and facts["commit"] == repo.commit() and facts["bytes_fetched"] == 0
    assert hub.log == []


def test_offline_partial_cache_is_refused(hub, toy, monkeypatch):
    from huggingface_hub import constants, hf_hub_download

    d, _ = toy
    repo = hub.add_repo("org/toy", d)
    for f in (INDEX, "config.json"):  # headers were never cached: only index + config are there
        hf_hub_download("org/toy", f, revision=repo.commit(), endpoint=hub.endpoint, token=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RemoteError, match="HF_HUB_OFFLINE"):
        _open(hub, f"hf://org/toy@{repo.commit()}")


def test_client_can_be_shared_and_counts_everything(hub, toy):
    d, tensors = toy
    hub.add_repo("org/toy", d)
    client = HubClient(hub.endpoint, token=False)
    with open_hub_checkpoint("hf://org/toy", client=client) as a:
        a.read_bytes(next(iter(tensors)))
    with open_hub_checkpoint("hf://org/toy", client=client):
        pass
    assert client.stats.bytes_fetched == sum(r.sent for r in hub.requests("resolve"))


def test_hf_endpoint_env_in_a_subprocess(hub, toy):
    d, tensors = toy
    hub.add_repo("org/toy", d)
    name = next(iter(tensors))
    code = ("import json, sys; from k3ckpt.hub import open_hub_checkpoint\n"
            "ck = open_hub_checkpoint(sys.argv[1])\n"
            "print(json.dumps({'commit': ck.hub.commit, 'endpoint': ck.hub.endpoint,"
            " 'data': ck.read_bytes(sys.argv[2]).hex()}))\n")
    env = dict(os.environ, HF_ENDPOINT=hub.endpoint, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code, "hf://org/toy", name], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["endpoint"] == hub.endpoint
    assert bytes.fromhex(got["data"]) == tensors[name].tobytes()
    assert hub.requests("api-model")


def test_small_bulk_repo_reads_whole_tiny_shards_in_one_request(hub, tmp_path):
    # shards smaller than the first-read guess come in one request each, never past their end
    d = tmp_path / "tiny"
    write_sharded(d, 2, bulk=64)
    hub.add_repo("org/tiny", d)
    with _open(hub, "hf://org/tiny") as ck:
        assert ck.hub.stats.range_requests == 2
    sizes = {p.name: p.stat().st_size for p in d.glob("*.safetensors")}
    for r in hub.requests("resolve"):
        if r.file in sizes:
            assert r.range == f"bytes=0-{sizes[r.file] - 1}"


def test_redirect_to_a_storage_origin(hub_env, toy):
    # the real Hub answers LFS files with a 302 to another host: ranges must follow it,
    # and the token must not travel to that host
    from hubemu import HubEmulator

    d, tensors = toy
    with HubEmulator(cdn=True) as emu:
        emu.add_repo("org/toy", d)
        with open_hub_checkpoint("hf://org/toy", endpoint=emu.endpoint, token="hf_secret") as ck, \
                open_checkpoint(d) as local:
            _same_view(ck, local)
            for name in tensors:
                assert ck.read_bytes(name) == local.read_bytes(name)
            assert ck.hub.bytes_fetched == sum(r.sent for r in emu.log if r.kind in ("cdn", "resolve"))
        cdn = emu.requests("cdn")
        assert cdn and all(r.status == 206 and not r.auth for r in cdn)
        assert all(r.status == 302 and r.auth for r in emu.requests("resolve") if r.file.endswith(".safetensors"))


@pytest.mark.parametrize("index", [[], {"weight_map": []}, {"weight_map": {"t": ["x"]}}, {"weight_map": {"t": 3}}])
def test_malformed_remote_index(hub, tmp_path, index):
    d = tmp_path / "badindex"
    d.mkdir()
    write_single(d / "a.safetensors")
    (d / INDEX).write_text(json.dumps(index))
    hub.add_repo("org/badindex", d)
    with pytest.raises(InvalidFileError, match=rf"hf://org/badindex@[0-9a-f]{{40}}/{INDEX}: "):
        _open(hub, "hf://org/badindex")
