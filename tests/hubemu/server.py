"""A loopback Hugging Face Hub: enough of the HTTP API for huggingface_hub 2.4.0.

Stdlib ``ThreadingHTTPServer`` on 127.0.0.1, port 0.  Implements (HUB.md sec. 3):

* GET  /api/models/{ns}/{name}[/revision/{rev}][?blobs=true]   model info with ``sha``
* GET  /api/models/{ns}/{name}/tree/{rev}[/{path}]?recursive=&expand=   (paged by ``page_size``)
* POST /api/models/{ns}/{name}/paths-info/{rev}   form ``paths=...``
* HEAD/GET /{ns}/{name}/resolve/{rev}/{path}   X-Repo-Commit, ETag, Content-Length,
  X-Linked-Etag/-Size for LFS-like files; ``Range`` -> 206/416; bodies sent
  with ``sendfile`` from the (possibly sparse) local file, never read whole
* errors: 404 + X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound
* ``cdn=True``: LFS-like files answer /resolve with 302 to a second loopback
  origin (``/cdn/...``, kind ``cdn``), as the Hub does with its storage hosts

Never emits xet headers.  Every request is logged (``Req``) with the body
bytes actually sent, so tests can assert what a client fetched.  Faults are
queued with ``fail`` (status, optional Retry-After), ``drop_after`` (close the
connection after n body bytes), ``corrupt`` (flip served bytes, same ETag),
``ignore_range`` (200 + whole body for a ranged GET);
``offline = True`` closes every connection without an answer.

Uploads (repo create, branch, preupload, LFS batch + PUT, commit) are answered by
``upload.py``; pushed repos live in a temporary store removed by ``stop()``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, quote, unquote, urlsplit

from . import upload
from .repos import Repo

_SEND_CHUNK = 8 << 20


@dataclass
class Req:
    """One request as the emulator saw it."""

    method: str
    path: str
    kind: str                 # api-model | api-tree | api-paths-info | resolve | cdn | other | upload kinds
    status: int = 0
    range: str | None = None
    sent: int = 0             # body bytes written to the socket
    auth: bool = False        # an Authorization header came with it
    file: str | None = None   # repo path, for resolve requests
    seq: int = 0              # arrival order (a handler logs its request only once it has answered)


@dataclass
class Fault:
    """A queued misbehaviour for requests matching ``match`` (kind or callable)."""

    action: str                               # fail | drop | corrupt | norange
    match: str | Callable[[Req], bool] | None
    times: int | None                         # None: forever
    status: int = 500
    retry_after: int | None = None
    nbytes: int = 0
    fired: int = 0

    def matches(self, req: Req) -> bool:
        if self.match is None:
            return True
        if callable(self.match):
            return bool(self.match(req))
        return self.match == req.kind or (req.file is not None and self.match == req.file)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, emu: HubEmulator, *, is_cdn: bool = False):
        self.emu = emu
        self.is_cdn = is_cdn
        super().__init__(("127.0.0.1", 0), _Handler)


class HubEmulator:
    """Serve repos from local folders on a loopback port.  Use as a context manager."""

    def __init__(self, *, page_size: int = 1000, cdn: bool = False):
        self.repos: dict[str, Repo] = {}
        self.page_size = page_size
        self.cdn = cdn            # LFS files: 302 from /resolve to a second origin, as the real Hub does
        self.offline = False
        self.log: list[Req] = []
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._server: _Server | None = None
        self._cdn: _Server | None = None
        self._store: Path | None = None

    def store(self) -> Path:
        """Where pushed repos and LFS objects are kept (a temporary folder, made on first use)."""
        with self._lock:
            if self._store is None:
                self._store = Path(tempfile.mkdtemp(prefix="hubemu-store-"))
            return self._store

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> str:
        self._server = _Server(self)
        servers = [self._server]
        if self.cdn:
            self._cdn = _Server(self, is_cdn=True)
            servers.append(self._cdn)
        for srv in servers:
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-emulator",
                             daemon=True).start()
        return self.endpoint

    def stop(self) -> None:
        for srv in (self._server, self._cdn):
            if srv is not None:
                srv.shutdown()
                srv.server_close()
        self._server = self._cdn = None
        if self._store is not None:
            shutil.rmtree(self._store, ignore_errors=True)
            self._store = None

    def __enter__(self) -> HubEmulator:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "emulator not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def cdn_endpoint(self) -> str:
        assert self._cdn is not None, "emulator not started with cdn=True"
        host, port = self._cdn.server_address[:2]
        return f"http://{host}:{port}"

    # -- content ---------------------------------------------------------------

    def add_repo(self, repo_id: str, folder: str | os.PathLike, *,
                 revisions: dict[str, str | os.PathLike] | None = None) -> Repo:
        """Serve ``folder`` as ``repo_id`` at branch ``main`` (plus other named revisions)."""
        repo = Repo(repo_id)
        repo.add_revision("main", Path(folder))
        for name, f in (revisions or {}).items():
            repo.add_revision(name, Path(f))
        self.repos[repo_id] = repo
        return repo

    # -- accounting ------------------------------------------------------------

    def requests(self, kind: str | None = None) -> list[Req]:
        """Logged requests (of ``kind``) in the order they arrived."""
        with self._lock:
            return sorted((r for r in self.log if kind is None or r.kind == kind), key=lambda r: r.seq)

    def settled_requests(self, kind: str, at_least: int, *, wait: float = 5.0) -> list[Req]:
        """``requests(kind)`` once at least ``at_least`` are logged (or ``wait`` seconds
        passed): a handler logs its request after the client may already have given up
        on the connection, so a count read at once can miss the last one."""
        deadline = time.monotonic() + wait
        while len(got := self.requests(kind)) < at_least and time.monotonic() < deadline:
            time.sleep(0.01)
        return got

    @property
    def bytes_served(self) -> int:
        with self._lock:
            return sum(r.sent for r in self.log)

    def reset_log(self) -> None:
        with self._lock:
            self.log.clear()

    # -- faults ----------------------------------------------------------------

    def fail(self, status: int = 500, *, times: int | None = 1, match=None, retry_after: int | None = None) -> Fault:
        return self._add(Fault("fail", match, times, status=status, retry_after=retry_after))

    def drop_after(self, nbytes: int, *, times: int | None = 1, match="resolve") -> Fault:
        return self._add(Fault("drop", match, times, nbytes=nbytes))

    def corrupt(self, *, times: int | None = None, match="resolve") -> Fault:
        return self._add(Fault("corrupt", match, times))

    def ignore_range(self, *, times: int | None = None, match="resolve") -> Fault:
        """Answer ranged GETs with 200 and the whole file, as a plain static server would."""
        return self._add(Fault("norange", match, times))

    def _add(self, f: Fault) -> Fault:
        with self._lock:
            self.faults.append(f)
        return f

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()

    def _take_fault(self, req: Req, actions: tuple[str, ...]) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.action in actions and f.matches(req):
                    f.fired += 1
                    if f.times is not None:
                        f.times -= 1
                        if f.times <= 0:
                            self.faults.remove(f)
                    return f
        return None

    def _record(self, req: Req) -> None:
        with self._lock:
            self.log.append(req)

    def _arrived(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq


def _parse_range(value: str | None, size: int) -> tuple[int, int] | None | str:
    """``(start, end)`` inclusive, None (serve everything), or "unsatisfiable"."""
    if not value or not value.startswith("bytes=") or "," in value:
        return None
    a, dash, b = value[6:].strip().partition("-")
    if not dash:
        return None
    try:
        if a == "":
            n = int(b)
            if n <= 0:
                return "unsatisfiable"
            return max(0, size - n), size - 1
        start = int(a)
        end = size - 1 if b == "" else min(int(b), size - 1)
    except ValueError:
        return None
    if start >= size or end < start:
        return "unsatisfiable"
    return start, end


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    @property
    def emu(self) -> HubEmulator:
        return self.server.emu

    def handle_one_request(self) -> None:
        if self.emu.offline:
            self.close_connection = True
            return
        super().handle_one_request()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # -- plumbing ----------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        raw = url.path.split("/")[1:]
        req = Req(method, self.path, "other", auth=self.headers.get("Authorization") is not None,
                  range=self.headers.get("Range"), seq=self.emu._arrived())
        body = upload.read_body(self)
        try:
            up = None if self.server.is_cdn else upload.route(self, method, raw)
            if up is not None:
                req.kind = up
                upload.handle(self, up, raw, body, req)
            elif self.server.is_cdn:
                if len(raw) >= 5 and raw[0] == "cdn" and method in ("GET", "HEAD"):
                    req.kind = "cdn"
                    req.file = unquote("/".join(raw[4:]))
                    self._resolve(method, f"{raw[1]}/{raw[2]}", raw[3], req.file, req)
                else:
                    self._json(req, 404, {"error": "Not Found"})
            elif len(raw) >= 4 and raw[0] == "api" and raw[1] == "models":
                self._api(method, raw, parse_qs(url.query), body, req)
            elif len(raw) >= 5 and raw[2] == "resolve" and method in ("GET", "HEAD"):
                req.kind = "resolve"
                req.file = unquote("/".join(raw[4:]))
                self._resolve(method, f"{raw[0]}/{raw[1]}", unquote(raw[3]), req.file, req)
            else:
                self._json(req, 404, {"error": "Not Found"})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            self.emu._record(req)

    def _send_head(self, req: Req, status: int, headers: dict[str, str]) -> None:
        req.status = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _json(self, req: Req, status: int, obj, headers: dict[str, str] | None = None, *, head: bool = False) -> None:
        data = json.dumps(obj).encode()
        h = {"Content-Type": "application/json; charset=utf-8", "Content-Length": str(len(data))}
        h.update(headers or {})
        self._send_head(req, status, h)
        if not head:
            self.wfile.write(data)
            req.sent += len(data)

    def _error(self, req: Req, code: str, message: str, *, commit: str | None = None, head: bool = False) -> None:
        h = {"X-Error-Code": code, "X-Error-Message": message}
        if commit is not None:
            h["X-Repo-Commit"] = commit
        self._json(req, 404, {"error": message}, h, head=head)

    def _injected_failure(self, req: Req, head: bool = False) -> bool:
        f = self.emu._take_fault(req, ("fail",))
        if f is None:
            return False
        h = {} if f.retry_after is None else {"Retry-After": str(f.retry_after)}
        self._json(req, f.status, {"error": f"injected {f.status}"}, h, head=head)
        return True

    def _lookup(self, req: Req, repo_id: str, rev: str | None, head: bool = False):
        repo = self.emu.repos.get(repo_id)
        if repo is None:
            self._error(req, "RepoNotFound", "Repository not found", head=head)
            return None
        tree = repo.resolve(rev)
        if tree is None:
            self._error(req, "RevisionNotFound", "Invalid rev id: " + str(rev), head=head)
            return None
        return repo, tree

    # -- /api/models ---------------------------------------------------------------

    def _api(self, method: str, raw: list[str], query: dict, body: bytes, req: Req) -> None:
        repo_id = f"{raw[2]}/{raw[3]}"
        rest = raw[4:]
        if method == "GET" and (not rest or (len(rest) == 2 and rest[0] == "revision")):
            req.kind = "api-model"
            if self._injected_failure(req):
                return
            found = self._lookup(req, repo_id, unquote(rest[1]) if rest else None)
            if found:
                repo, tree = found
                blobs = query.get("blobs", ["false"])[0].lower() == "true"
                self._json(req, 200, {
                    "_id": tree.commit[:24], "id": repo_id, "modelId": repo_id, "author": raw[2],
                    "sha": tree.commit, "private": repo.private, "disabled": False, "gated": False,
                    "downloads": 0, "likes": 0, "tags": [], "library_name": None,
                    "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
                    "siblings": [f.sibling(blobs) for _, f in sorted(tree.files.items())],
                })
        elif method == "GET" and len(rest) >= 2 and rest[0] == "tree":
            req.kind = "api-tree"
            if self._injected_failure(req):
                return
            found = self._lookup(req, repo_id, unquote(rest[1]))
            if found:
                repo, tree = found
                path = unquote("/".join(rest[2:])).strip("/")
                if not tree.is_dir(path):
                    self._error(req, "EntryNotFound", f"{path} does not exist on {rest[1]}", commit=tree.commit)
                    return
                entries = tree.children(path, query.get("recursive", ["false"])[0].lower() == "true")
                cursor = int(query.get("cursor", ["0"])[0])
                page = entries[cursor:cursor + self.emu.page_size]
                headers = {}
                if cursor + self.emu.page_size < len(entries):
                    q = {k: v[0] for k, v in query.items()}
                    q["cursor"] = str(cursor + self.emu.page_size)
                    qs = "&".join(f"{k}={quote(v)}" for k, v in q.items())
                    base = self.emu.endpoint + urlsplit(self.path).path
                    headers["Link"] = f'<{base}?{qs}>; rel="next"'
                self._json(req, 200, page, headers)
        elif method == "POST" and len(rest) == 2 and rest[0] == "paths-info":
            req.kind = "api-paths-info"
            if self._injected_failure(req):
                return
            found = self._lookup(req, repo_id, unquote(rest[1]))
            if found:
                repo, tree = found
                form = parse_qs(body.decode("utf-8"))
                out = [e for p in form.get("paths", []) if (e := tree.entry(p.strip("/"))) is not None]
                self._json(req, 200, out)
        else:
            self._json(req, 404, {"error": "Not Found"})

    # -- /{repo}/resolve/{rev}/{path} ----------------------------------------------------

    def _resolve(self, method: str, repo_id: str, rev: str, path: str, req: Req) -> None:
        head = method == "HEAD"
        if self._injected_failure(req, head=head):
            return
        found = self._lookup(req, repo_id, rev, head=head)
        if not found:
            return
        repo, tree = found
        f = tree.files.get(path)
        if f is None:
            self._error(req, "EntryNotFound", f"{path} does not exist on {rev}", commit=tree.commit, head=head)
            return
        h = {"X-Repo-Commit": tree.commit, "ETag": f'"{f.etag}"', "Accept-Ranges": "bytes",
             "Content-Type": "application/octet-stream"}
        if f.lfs:
            h["X-Linked-Etag"] = f'"{f.sha256}"'
            h["X-Linked-Size"] = str(f.size)
            if self.emu.cdn and not self.server.is_cdn:
                # the Hub answers LFS files with a redirect to a storage origin, metadata on the 302
                h["Location"] = f"{self.emu.cdn_endpoint}/cdn/{repo_id}/{tree.commit}/{quote(path)}"
                h["Content-Length"] = "0"
                self._send_head(req, 302, h)
                return
        rng = _parse_range(self.headers.get("Range"), f.size)
        if rng is not None and not head and self.emu._take_fault(req, ("norange",)):
            rng = None
        if rng == "unsatisfiable":
            h.update({"Content-Range": f"bytes */{f.size}", "Content-Length": "0"})
            self._send_head(req, 416, h)
            return
        start, end = (0, f.size - 1) if rng is None else rng
        count = max(0, end - start + 1)
        if rng is not None:
            h["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        h["Content-Length"] = str(count)
        self._send_head(req, 206 if rng is not None else 200, h)
        if head:
            return
        fault = self.emu._take_fault(req, ("drop", "corrupt"))
        self._send_body(f.local, start, count, req, fault)

    def _send_body(self, local: Path, start: int, count: int, req: Req, fault: Fault | None) -> None:
        limit = count
        if fault is not None and fault.action == "drop":
            limit = min(count, fault.nbytes)
        with open(local, "rb") as fh:
            pos, left = start, limit
            while left > 0:
                if fault is not None and fault.action == "corrupt":
                    chunk = bytearray(os.pread(fh.fileno(), min(left, _SEND_CHUNK), pos))
                    for i in range(0, len(chunk), 4096):
                        chunk[i] ^= 0xFF
                    self.wfile.write(chunk)
                    k = len(chunk)
                else:
                    k = self.connection.sendfile(fh, pos, min(left, _SEND_CHUNK))
                if k <= 0:
                    break
                req.sent += k
                pos += k
                left -= k
        if limit < count:  # injected drop: the client sees the body end early
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
