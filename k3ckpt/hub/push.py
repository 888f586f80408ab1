"""``--push-to-hub ORG/NAME``: upload a finished output folder, resumably.

Only huggingface_hub's upload API is used: ``HfApi.create_repo`` (exist_ok),
``create_branch`` for ``--revision``, ``list_repo_tree`` to see what the
branch already holds, and ``create_commit`` with ``CommitOperationAdd``
(huggingface_hub picks Xet or LFS + PUT for large files, base64 for small).

Resumable whatever the transfer: files are committed in batches (weight
shards first, the model card, index and manifest last, so a repo is only
loadable once it is complete), and before uploading, each local file is
compared with the branch (LFS sha256 for large files, git blob sha1 for
small ones); matching files are skipped.  A run killed mid-push and started
again uploads only what the branch does not hold yet (and LFS objects the
server already has are not sent again either).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .card import CARD_NAME, model_card
from .options import check_push_repo

COMMIT_BYTES = 50_000_000_000     # at most this much per commit (a few K3 output shards)
COMMIT_FILES = 50
_LAST = (CARD_NAME, "model.safetensors.index.json", "k3ckpt-manifest.json")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class PushResult:
    repo_id: str
    revision: str
    url: str
    commit: str | None                # the branch head after the push
    uploaded: tuple[str, ...]
    skipped: tuple[str, ...]          # already on the branch with the same content
    bytes_uploaded: int
    commits: int

    def to_dict(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "revision": self.revision, "url": self.url, "commit": self.commit,
                "uploaded": list(self.uploaded), "skipped": list(self.skipped),
                "bytes_uploaded": self.bytes_uploaded, "commits": self.commits}

    def summary(self) -> str:
        return (f"pushed to {self.url} ({self.revision}): {len(self.uploaded)} file(s) uploaded in "
                f"{self.commits} commit(s), {len(self.skipped)} already there; head {self.commit}")


def _local_files(folder: Path) -> list[str]:
    """Files to push, relative posix paths; hidden files and folders (staging, temporaries) are not."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = Path(dirpath).relative_to(folder)
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            if not fn.startswith(".") and p.is_file() and not p.is_symlink():
                out.append((rel / fn).as_posix())
    return out


def _digests(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, one read."""
    sha, blob = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            blob.update(chunk)
    return sha.hexdigest(), blob.hexdigest()


def _same(path: Path, remote) -> bool:
    if remote is None or int(remote.size) != path.stat().st_size:
        return False
    sha256, sha1 = _digests(path)
    if remote.lfs is not None:
        return remote.lfs.sha256 == sha256
    return remote.blob_id == sha1


def _batches(names: list[str], folder: Path, commit_bytes: int) -> list[list[str]]:
    first = [n for n in names if n not in _LAST]
    last = [n for n in _LAST if n in names]
    out: list[list[str]] = []
    size = 0
    for n in first:
        b = (folder / n).stat().st_size
        if not out or len(out[-1]) >= COMMIT_FILES or (out[-1] and size + b > commit_bytes):
            out.append([])
            size = 0
        out[-1].append(n)
        size += b
    if last:
        out.append(last)
    return out


def push_output(folder: str | os.PathLike, repo_id: str, *, private: bool = False, revision: str | None = None,
                endpoint: str | None = None, token: str | bool | None = None, client=None,
                commit_bytes: int = COMMIT_BYTES) -> PushResult:
    """Upload the finished k3ckpt output in ``folder`` to model repo ``repo_id`` (created if missing)
    on branch ``revision`` (default ``main``, created from it otherwise), with a generated model card."""
    from ..io.manifest import RunManifest
    from ..io.writer import atomic_write_bytes
    from .client import HubClient

    check_push_repo(repo_id)
    folder = Path(folder)
    manifest = RunManifest.load(folder)
    if manifest.state != "complete":
        raise UsageError("the run in this folder is not finished: complete it (rerun with --resume) before "
                         "pushing", file=str(folder))
    card = model_card(folder, repo_id).encode("utf-8")
    if not (folder / CARD_NAME).is_file() or (folder / CARD_NAME).read_bytes() != card:
        atomic_write_bytes(folder / CARD_NAME, card)
    if not manifest.verify(CARD_NAME):
        manifest.record(CARD_NAME)

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    client = client or HubClient(endpoint, token)
    quiet = are_progress_bars_disabled()
    disable_progress_bars()  # library code never prints; huggingface_hub's upload bars stay off
    try:
        return _push(folder, repo_id, client, private=private, revision=revision, commit_bytes=commit_bytes)
    finally:
        if not quiet:
            enable_progress_bars()


def _push(folder: Path, repo_id: str, client, *, private: bool, revision: str | None,
          commit_bytes: int) -> PushResult:
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.hf_api import RepoFile

    api, branch = client.api, revision or "main"

    def call(thunk, what: str):
        return client.call(thunk, file=f"hf://{repo_id}@{branch} ({what})", repo_id=repo_id, revision=branch)

    url = str(call(lambda: api.create_repo(repo_id, private=private, exist_ok=True), "create repo"))
    if branch != "main":
        call(lambda: api.create_branch(repo_id, branch=branch, exist_ok=True), "create branch")
    remote = {e.path: e for e in call(lambda: list(api.list_repo_tree(repo_id, revision=branch, recursive=True)),
                                      "list files") if isinstance(e, RepoFile)}
    names = _local_files(folder)
    todo = [n for n in names if not _same(folder / n, remote.get(n))]
    skipped = tuple(n for n in names if n not in todo)
    head, commits, sent = None, 0, 0
    batches = _batches(todo, folder, commit_bytes)
    for i, batch in enumerate(batches, 1):
        ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(folder / n)) for n in batch]
        info = call(lambda: api.create_commit(repo_id, operations=ops, revision=branch,
                                              commit_message=f"k3ckpt push {i}/{len(batches)}: {len(batch)} file(s)"),
                    f"commit {i}/{len(batches)}")
        head = info.oid
        commits += 1
        sent += sum((folder / n).stat().st_size for n in batch)
    if head is None:  # nothing was missing: report the branch head as it is
        head = call(lambda: api.model_info(repo_id, revision=branch), "head").sha
    return PushResult(repo_id, branch, url, head, tuple(todo), skipped, sent, commits)
