"""The emulator's write side: what ``HfApi.create_repo`` / ``create_branch`` / ``create_commit``
(huggingface_hub 2.4.0, ``HF_HUB_DISABLE_XET=1``) ask for.

* POST /api/repos/create   ``{"name", "organization", "visibility"?}`` -> ``{"url"}``; 409 if it exists
* POST /api/models/{repo}/branch/{branch}   a branch from the default one; 409 if it exists
* POST /api/models/{repo}/preupload/{rev}   ``{"files": [{path, sample, size}]}`` ->
  ``uploadMode`` "lfs" for LFS-like files (same rule as served repos), "regular" otherwise
* POST /{repo}.git/info/lfs/objects/batch   basic transfer: an ``upload`` (and ``verify``) action
  per object the store lacks, no action for one it holds (the client then skips it)
* PUT  /lfs-upload/{oid}   the object's bytes; refused (400) unless they hash to ``oid``
* POST /lfs-verify   ``{"oid", "size"}``
* POST /api/validate-yaml   ``{"content"}``: a README's front matter must parse as a YAML mapping
  (400 + ``errors`` otherwise)
* POST /api/models/{repo}/commit/{rev}   NDJSON ``header`` / ``file`` (base64) / ``lfsFile`` /
  ``deletedFile`` lines -> a new commit of the branch

A pushed repo's branch is a folder under the emulator's store, rescanned after each commit,
so the read side (model info, tree, resolve) serves what was pushed.  Request kinds for
faults and logs: api-create, api-branch, api-preupload, api-commit, lfs-batch, lfs-put,
lfs-verify.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path, PurePosixPath
from urllib.parse import unquote

from .repos import LFS_MIN_BYTES, LFS_SUFFIXES, Repo


def _lfs_like(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES


def _safe(path: str) -> bool:
    p = PurePosixPath(path)
    return bool(path) and not p.is_absolute() and ".." not in p.parts and "\\" not in path and "" not in path.split("/")


def route(h, method: str, raw: list[str]) -> str | None:
    """The upload request kind of this path, or None when it is not an upload endpoint."""
    if method == "POST" and raw[:3] == ["api", "repos", "create"]:
        return "api-create"
    if method == "POST" and raw == ["api", "validate-yaml"]:
        return "api-validate-yaml"
    if method == "POST" and len(raw) >= 6 and raw[:2] == ["api", "models"]:
        return {"branch": "api-branch", "preupload": "api-preupload", "commit": "api-commit"}.get(raw[4])
    if method == "POST" and len(raw) == 6 and raw[1].endswith(".git") and raw[2:] == ["info", "lfs", "objects",
                                                                                     "batch"]:
        return "lfs-batch"
    if method == "PUT" and len(raw) == 2 and raw[0] == "lfs-upload":
        return "lfs-put"
    if method == "POST" and raw == ["lfs-verify"]:
        return "lfs-verify"
    return None


def handle(h, kind: str, raw: list[str], body: bytes, req) -> None:
    """Answer one upload request (``h`` is the emulator's request handler)."""
    emu = h.emu
    if h._injected_failure(req):
        return
    if kind == "api-create":
        d = json.loads(body or b"{}")
        repo_id = f"{d.get('organization')}/{d.get('name')}" if d.get("organization") else f"user/{d.get('name')}"
        url = f"{emu.endpoint}/{repo_id}"
        if repo_id in emu.repos:
            h._json(req, 409, {"error": "You already created this model repo", "url": url})
            return
        folder = emu.store() / repo_id / "main"
        folder.mkdir(parents=True)
        repo = emu.add_repo(repo_id, folder)
        repo.private = d.get("visibility") == "private" or bool(d.get("private"))
        h._json(req, 200, {"url": url, "name": repo_id, "id": repo_id})
        return
    if kind == "api-validate-yaml":
        why = _front_matter_problem(json.loads(body or b"{}").get("content", ""))
        h._json(req, 400 if why else 200, {"errors": [{"message": why}] if why else [], "warnings": []})
        return
    if kind == "lfs-put":
        oid = raw[1]
        if hashlib.sha256(body).hexdigest() != oid:
            h._json(req, 400, {"error": "object does not hash to its oid"})
            return
        path = emu.store() / "lfs" / oid
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(body)
        tmp.replace(path)
        h._json(req, 200, {})
        return
    if kind == "lfs-verify":
        d = json.loads(body or b"{}")
        ok = (emu.store() / "lfs" / str(d.get("oid"))).is_file()
        h._json(req, 200 if ok else 404, {} if ok else {"error": "object not found"})
        return
    if kind == "lfs-batch":
        d = json.loads(body or b"{}")
        objects = []
        for o in d.get("objects", []):
            entry = {"oid": o["oid"], "size": int(o["size"])}
            if not (emu.store() / "lfs" / o["oid"]).is_file():
                entry["actions"] = {"upload": {"href": f"{emu.endpoint}/lfs-upload/{o['oid']}"},
                                    "verify": {"href": f"{emu.endpoint}/lfs-verify"}}
            objects.append(entry)
        h._json(req, 200, {"transfer": "basic", "objects": objects})
        return
    repo_id, rev = f"{raw[2]}/{raw[3]}", unquote(raw[5])
    repo: Repo | None = emu.repos.get(repo_id)
    if repo is None:
        h._error(req, "RepoNotFound", "Repository not found")
        return
    if kind == "api-branch":
        if rev in repo.refs:
            h._json(req, 409, {"error": f"Reference already exists: refs/heads/{rev}"})
            return
        src = repo.resolve(None)
        folder = emu.store() / repo_id / f"branch-{len(repo.refs)}"
        shutil.copytree(src.root, folder)
        repo.add_revision(rev, folder, commit=_next_commit(repo, src.commit, rev.encode()))
        h._json(req, 200, {})
        return
    tree = repo.resolve(rev)
    if tree is None or rev not in repo.refs:
        h._error(req, "RevisionNotFound", f"Invalid rev id: {rev}")
        return
    if kind == "api-preupload":
        d = json.loads(body or b"{}")
        files = [{"path": f["path"], "uploadMode": "lfs" if _lfs_like(f["path"], int(f["size"])) else "regular",
                  "shouldIgnore": False} for f in d.get("files", [])]
        h._json(req, 200, {"files": files})
        return
    # api-commit
    lines = [json.loads(ln) for ln in body.splitlines() if ln.strip()]
    folder = tree.root
    for ln in lines:
        key, v = ln.get("key"), ln.get("value", {})
        if key == "header":
            continue
        path = v.get("path", "")
        if not _safe(path):
            h._json(req, 400, {"error": f"bad path {path!r}"})
            return
        dst = folder / path
        if key == "file":
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(base64.b64decode(v["content"]))
        elif key == "lfsFile":
            obj = emu.store() / "lfs" / v["oid"]
            if not obj.is_file():
                h._json(req, 422, {"error": f"LFS object {v['oid']} of {path} was never uploaded"})
                return
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(obj, dst)
        elif key == "deletedFile":
            dst.unlink(missing_ok=True)
    commit = _next_commit(repo, tree.commit, body)
    repo.add_revision(rev, folder, commit=commit)
    h._json(req, 200, {"commitOid": commit, "commitUrl": f"{emu.endpoint}/{repo_id}/commit/{commit}",
                       "pullRequestUrl": None})


def _front_matter_problem(content: str) -> str | None:
    if not content.startswith("---\n"):
        return None  # no metadata block: the Hub only warns
    end = content.find("\n---\n", 4)
    if end < 0:
        return "front matter has no closing ---"
    import yaml

    try:
        meta = yaml.safe_load(content[4:end])
    except yaml.YAMLError as e:
        return f"front matter is not YAML: {e}"
    return None if isinstance(meta, dict) else "front matter is not a mapping"


def _next_commit(repo: Repo, parent: str, body: bytes) -> str:
    return hashlib.sha1(f"{repo.repo_id}:{parent}:".encode() + hashlib.sha256(body).digest()).hexdigest()


def read_body(h) -> bytes:
    """The request body: ``Content-Length`` bytes, or a chunked body decoded."""
    if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += h.rfile.read(size)
            h.rfile.readline()
    length = int(h.headers.get("Content-Length") or 0)
    return h.rfile.read(length) if length else b""


def make_store(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
