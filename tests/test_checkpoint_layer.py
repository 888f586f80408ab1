"""The checkpoint layer: every checkpoint declares its origin (local, or a Hub repo pinned
to a commit), and provenance for manifests and reports comes from it alone."""

from __future__ import annotations

import pytest
from hubemu.ckpts import write_sharded
from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

from k3ckpt.checkpoint.identity import source_identity
from k3ckpt.checkpoint.side_files import copy_side_files, is_weight_file
from k3ckpt.hub import open_hub_checkpoint
from k3ckpt.hub.staged import open_staged
from k3ckpt.io import open_checkpoint
from k3ckpt.io.origin import Origin

CONFIG = {"model_type": "toy", "num_hidden_layers": 3}


def test_origin_kinds():
    local = Origin.local("/models/x")
    assert local.is_local() and local.identity() == {} and local.label() == "/models/x"
    pinned = Origin.hub("org/m", "a" * 40, revision="main", subfolder="bf16")
    assert not pinned.is_local()
    assert pinned.identity() == {"repo_id": "org/m", "commit": "a" * 40}
    assert pinned.label() == f"hf://org/m@{'a' * 40}/bf16"
    with pytest.raises(ValueError, match="commit"):
        Origin.hub("org/m", "")
    with pytest.raises(ValueError, match="kind"):
        Origin("s3")


def test_local_checkpoint_declares_its_folder(tmp_path):
    write_sharded(tmp_path / "toy", 2, config=CONFIG)
    with open_checkpoint(tmp_path / "toy") as ckpt:
        assert ckpt.origin == Origin.local(tmp_path / "toy") and ckpt.hub is None
        ident = source_identity(ckpt)
    assert set(ident) == {"shards", "tensors", "config_sha256"}
    assert ident["tensors"] > 0 and len(ident["shards"]) == 2


def test_hub_checkpoint_is_pinned_to_its_commit(hub, tmp_path):
    write_sharded(tmp_path / "toy", 2, config=CONFIG)
    repo = hub.add_repo("org/toy", tmp_path / "toy")
    commit = repo.commit("main")
    with open_hub_checkpoint("hf://org/toy@main", endpoint=hub.endpoint, token=False) as remote, \
            open_checkpoint(tmp_path / "toy") as local:
        assert remote.origin == Origin.hub("org/toy", commit, revision="main")
        assert remote.hub.commit == commit   # the live handle is still there for the hub code
        # the same bytes, plus the pin: a resumed run must reopen exactly this commit
        assert source_identity(remote) == {**source_identity(local), "repo_id": "org/toy", "commit": commit}


def test_staged_checkpoint_keeps_the_origin(hub, tmp_path):
    write_sharded(tmp_path / "toy", 2, config=CONFIG)
    commit = hub.add_repo("org/toy", tmp_path / "toy").commit("main")
    with open_staged("hf://org/toy", tmp_path / "dst", endpoint=hub.endpoint, token=False) as ckpt:
        assert ckpt.origin.commit == commit and not ckpt.origin.is_local()


def test_side_files_skip_weights_and_hidden(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    for name in ("tokenizer.json", "config.json", "model.safetensors", "model.safetensors.index.json", ".hidden"):
        (src / name).write_text(name)
    assert copy_side_files(src, dst, skip=is_weight_file) == ["tokenizer.json"]
    assert sorted(p.name for p in dst.iterdir()) == ["tokenizer.json"]
    assert copy_side_files(None, dst, skip=is_weight_file) == []
