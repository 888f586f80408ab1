"""The loopback Hub against huggingface_hub's own clients (the emulator contract,
HUB.md sec. 3), and k3ckpt's remote headers against huggingface_hub's independent
safetensors metadata parser."""

from __future__ import annotations

import hashlib

import pytest
from hubemu.ckpts import INDEX, write_sharded
from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

from k3ckpt.hub import open_hub_checkpoint


@pytest.fixture
def repo(hub, tmp_path):
    d = tmp_path / "repo"
    write_sharded(d / "ckpt", 3, config={"model_type": "toy"})
    (d / "README.md").write_text("# toy\n")
    r = hub.add_repo("org/toy", d)
    return d, r


def _api(hub):
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.endpoint, token=False)


def test_model_info_and_listings(hub, repo):
    from huggingface_hub.hf_api import RepoFile, RepoFolder

    d, r = repo
    api = _api(hub)
    info = api.model_info("org/toy", files_metadata=True)
    assert info.sha == r.commit() and len(info.sha) == 40
    by_name = {s.rfilename: s for s in info.siblings}
    shard = "ckpt/model-00001-of-00003.safetensors"
    data = (d / shard).read_bytes()
    assert by_name[shard].size == len(data)
    assert by_name[shard].lfs.sha256 == hashlib.sha256(data).hexdigest()  # real hash for small files
    readme = (d / "README.md").read_bytes()
    assert by_name["README.md"].blob_id == hashlib.sha1(b"blob %d\0" % len(readme) + readme).hexdigest()

    hub.page_size = 2  # force pagination through Link headers
    tree = list(api.list_repo_tree("org/toy", recursive=True))
    assert {e.path for e in tree if isinstance(e, RepoFile)} == {p.relative_to(d).as_posix()
                                                                 for p in d.rglob("*") if p.is_file()}
    assert any(isinstance(e, RepoFolder) and e.path == "ckpt" for e in tree)
    assert len(hub.requests("api-tree")) > 2
    top = list(api.list_repo_tree("org/toy"))
    assert {e.path for e in top} == {"README.md", "ckpt"}

    found = api.get_paths_info("org/toy", ["ckpt", "README.md", "nope"])
    assert {type(e).__name__ for e in found} == {"RepoFile", "RepoFolder"} and len(found) == 2


def test_downloads_and_errors(hub, repo, tmp_path):
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    d, r = repo
    p = hf_hub_download("org/toy", f"ckpt/{INDEX}", endpoint=hub.endpoint, token=False)
    assert open(p, "rb").read() == (d / "ckpt" / INDEX).read_bytes()
    assert r.commit() in p  # cached under snapshots/<commit>
    snap = snapshot_download("org/toy", endpoint=hub.endpoint, token=False, local_dir=tmp_path / "local")
    for f in d.rglob("*.safetensors"):
        assert (tmp_path / "local" / f.relative_to(d)).read_bytes() == f.read_bytes()
    assert snap
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("org/toy", "missing.bin", endpoint=hub.endpoint, token=False)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("org/toy", "README.md", revision="nope", endpoint=hub.endpoint, token=False)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/none", "README.md", endpoint=hub.endpoint, token=False)


def test_ranges(hub, repo):
    from huggingface_hub import HfFileSystem, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    d, r = repo
    name = "ckpt/model-00002-of-00003.safetensors"
    data = (d / name).read_bytes()
    url = hf_hub_url("org/toy", name, endpoint=hub.endpoint)
    s, h = get_session(), build_hf_headers(token=False)
    for rng, want in [("bytes=10-19", data[10:20]), ("bytes=-7", data[-7:]), (f"bytes={len(data) - 3}-", data[-3:]),
                      (f"bytes=5-{len(data) + 100}", data[5:])]:
        resp = s.get(url, headers={**h, "Range": rng})
        assert resp.status_code == 206 and resp.content == want, rng
        assert resp.headers["X-Repo-Commit"] == r.commit()
    resp = s.get(url, headers={**h, "Range": f"bytes={len(data)}-"})
    assert resp.status_code == 416 and resp.headers["Content-Range"] == f"bytes */{len(data)}"
    head = s.head(url, headers=h)
    assert head.headers["ETag"].strip('"') == hashlib.sha256(data).hexdigest()
    assert int(head.headers["X-Linked-Size"]) == len(data) and not any("xet" in k.lower() for k in head.headers)
    fs = HfFileSystem(endpoint=hub.endpoint, token=False, skip_instance_cache=True)
    assert fs.cat_file(f"org/toy/{name}", start=100, end=164) == data[100:164]
    assert hub.bytes_served >= 64


def test_remote_headers_match_huggingface_hub_parser(hub, repo):
    # huggingface_hub's safetensors metadata parser is an independent reading of the same headers
    d, r = repo
    api = _api(hub)
    with open_hub_checkpoint("hf://org/toy/ckpt", endpoint=hub.endpoint, token=False) as ck:
        for shard in ck.shards:
            meta = api.parse_safetensors_file_metadata("org/toy", f"ckpt/{shard}", revision=r.commit())
            mine = ck.headers[shard]
            assert meta.metadata == mine.metadata
            assert set(meta.tensors) == set(mine.tensors)
            for n, t in meta.tensors.items():
                info = mine.tensors[n]
                assert (t.dtype, tuple(t.shape), tuple(t.data_offsets)) == (info.dtype, info.shape,
                                                                           (info.start, info.end))
