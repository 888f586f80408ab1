"""--push-to-hub against the loopback Hub: files arrive intact with a model card, a rerun uploads
nothing, a push killed mid-way finishes on the rerun uploading only what is missing."""

from __future__ import annotations

import json

import pytest
import yaml
from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

from k3ckpt.errors import RemoteError, UsageError
from k3ckpt.hub import HubClient, RetryPolicy
from k3ckpt.hub.card import CARD_NAME
from k3ckpt.hub.convert import requant_from_hub
from k3ckpt.hub.push import push_output

FAST = RetryPolicy(max_retries=3, base_wait=0.01, max_wait=0.02)
# huggingface_hub's LFS PUT passes a file object as data=, which httpx2 deprecates (not ours to fix)
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=:DeprecationWarning")
SRC = "moonshotai/Kimi-K3-tiny"


class Killed(BaseException):
    pass


@pytest.fixture
def output(hub, k3_tiny, tmp_path):
    """A finished download-and-convert of the tiny K3, and a client with a (fake) write token."""
    repo = hub.add_repo(SRC, k3_tiny)
    client = HubClient(hub.endpoint, token="hf_test", retry=FAST)
    dst = tmp_path / "out"
    requant_from_hub(f"hf://{SRC}", dst, client=client, workers=1, progress=False, max_shard_bytes=400_000)
    return dst, client, repo


def remote_files(hub, repo_id, branch="main"):
    tree = hub.repos[repo_id].resolve(branch)
    return {p: f.local.read_bytes() for p, f in tree.files.items()}


def local_files(dst):
    return {p.name: p.read_bytes() for p in dst.iterdir() if p.is_file() and not p.name.startswith(".")}


def test_push_uploads_everything_with_a_card(output, hub):
    dst, client, src = output
    r = push_output(dst, "me/K3-tiny-w2", client=client, commit_bytes=3_000_000)
    assert r.commits >= 3 and not r.skipped and r.commit == hub.repos["me/K3-tiny-w2"].commit()
    assert remote_files(hub, "me/K3-tiny-w2") == local_files(dst)
    assert hub.requests("lfs-put") and all(q.auth for q in hub.requests("api-commit"))
    commits = hub.requests("api-commit")
    assert len(commits) == r.commits
    card = (dst / CARD_NAME).read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["base_model"] == SRC and meta["base_model_relation"] == "quantized"
    assert "moet-w2" in meta["tags"] and meta["library_name"] == "k3ckpt"
    assert src.commit() in card and "docs/formats/moet-w2.md" in card
    assert "| all | 72 |" in card and "(requant_report.svg)" in card
    assert hub.requests("api-validate-yaml")[-1].status == 200
    again = push_output(dst, "me/K3-tiny-w2", client=client)
    assert again.uploaded == () and again.commits == 0 and again.commit == r.commit
    assert len(hub.requests("api-commit")) == len(commits)


def test_push_killed_midway_finishes_uploading_only_what_is_missing(output, hub, monkeypatch):
    from huggingface_hub import HfApi

    dst, client, _ = output
    real, calls = HfApi.create_commit, [0]

    def create_commit(self, *a, **kw):  # killed before the 3rd commit starts
        calls[0] += 1
        if calls[0] == 3:
            raise Killed()
        return real(self, *a, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(HfApi, "create_commit", create_commit)
        with pytest.raises(Killed):
            push_output(dst, "me/K3-tiny-w2", client=client, commit_bytes=1_500_000)
    first = set(remote_files(hub, "me/K3-tiny-w2"))
    assert first and CARD_NAME not in first          # the card and index go last
    # killed again, after the 4th commit's LFS uploads but before its commit landed
    seen = [0]

    def fourth(req):
        seen[0] += 1
        return seen[0] == 2

    hub.fail(422, times=1, match=lambda r: r.kind == "api-commit" and fourth(r))
    with pytest.raises(RemoteError, match="422"):
        push_output(dst, "me/K3-tiny-w2", client=client, commit_bytes=1_500_000)
    second = set(remote_files(hub, "me/K3-tiny-w2"))
    assert first < second
    puts_before = len(hub.requests("lfs-put"))
    r = push_output(dst, "me/K3-tiny-w2", client=client, commit_bytes=1_500_000)
    assert set(r.skipped) == second and set(r.uploaded) == set(local_files(dst)) - second
    assert remote_files(hub, "me/K3-tiny-w2") == local_files(dst)
    # the failed commit's LFS objects were already on the server: not sent again
    sent_again = len(hub.requests("lfs-put")) - puts_before
    assert sent_again < len([n for n in r.uploaded if n.endswith(".safetensors")])


def test_push_to_a_private_branch_and_faults(output, hub):
    dst, client, _ = output
    hub.fail(500, times=1, match="lfs-put")
    hub.fail(503, times=1, match="api-commit")
    r = push_output(dst, "me/K3-tiny-w2", client=client, private=True, revision="w2")
    repo = hub.repos["me/K3-tiny-w2"]
    assert repo.private and r.revision == "w2" and set(repo.refs) == {"main", "w2"}
    assert remote_files(hub, "me/K3-tiny-w2", "w2") == local_files(dst)
    assert remote_files(hub, "me/K3-tiny-w2", "main") == {}


def test_push_refuses_unfinished_or_bad_input(output, tmp_path):
    dst, client, _ = output
    with pytest.raises(UsageError, match="ORG/NAME"):
        push_output(dst, "hf://me/x", client=client)
    m = json.loads((dst / "k3ckpt-manifest.json").read_text())
    m["state"] = "running"
    (dst / "k3ckpt-manifest.json").write_text(json.dumps(m))
    with pytest.raises(UsageError, match="not finished"):
        push_output(dst, "me/x", client=client)
