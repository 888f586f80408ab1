"""One Hub endpoint, talked to only through huggingface_hub's public API.

``HubClient`` bundles what every hub operation needs: the endpoint
(``endpoint=`` or ``HF_ENDPOINT``), the token (``token=`` or huggingface_hub's
own lookup: ``HF_TOKEN``, then the token file under ``HF_HOME``), an ``HfApi``
for metadata, bounded retries, the mapping of huggingface_hub / transport
errors onto k3ckpt's error kinds, and ``read_range`` -- positioned reads of a
file at a pinned commit by HTTP ``Range`` requests, made with
``hf_hub_url`` + ``build_hf_headers`` + ``http_stream_backoff`` (the same
calls ``HfFileSystem`` makes for a range, without its repo resolution and
read-ahead blocks, so we fetch exactly what was asked for and can count it).

huggingface_hub is imported here, never at ``k3ckpt.hub`` import time.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

try:  # huggingface_hub 2.x's HTTP library; only its exception classes are used here
    import httpx2
except ImportError:  # pragma: no cover - older huggingface_hub on httpx
    import httpx as httpx2
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    FileMetadataError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

from .. import __version__
from ..errors import K3ckptError, NotFoundError, RemoteError, TruncatedFileError, UsageError

T = TypeVar("T")

RETRY_STATUS = (408, 429, 500, 502, 503, 504)  # huggingface_hub's own retry set
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_MAX_RETRY_AFTER = 120.0  # obey a server's Retry-After, but never sleep longer than this per try


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: ``max_retries`` more tries after the first, waits
    ``base_wait * 2**k`` capped at ``max_wait`` (a 429's Retry-After wins when longer)."""

    max_retries: int = 5
    base_wait: float = 1.0
    max_wait: float = 8.0

    def __post_init__(self) -> None:
        if not (isinstance(self.max_retries, int) and self.max_retries >= 0):
            raise UsageError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        if not (self.base_wait >= 0 and self.max_wait >= 0):
            raise UsageError(f"retry waits must be >= 0, got {self.base_wait!r}, {self.max_wait!r}")

    def wait(self, attempt: int, retry_after: float | None = None) -> float:
        w = min(self.max_wait, self.base_wait * (2 ** max(0, attempt - 1)))
        if retry_after is not None:
            w = max(w, min(retry_after, _MAX_RETRY_AFTER))
        return w


class TransferStats:
    """Thread-safe counters of what was fetched (file content bytes only; the
    small JSON answers of the Hub API are not counted)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_fetched = 0
        self.range_requests = 0
        self.retries = 0

    def add(self, *, nbytes: int = 0, requests: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.bytes_fetched += nbytes
            self.range_requests += requests
            self.retries += retries


def _retry_after(headers: Any) -> float | None:
    v = headers.get("Retry-After") if headers is not None else None
    if v is not None and v.strip().isdigit():
        return float(v.strip())
    return None


def _retryable(e: BaseException) -> tuple[bool, float | None]:
    if isinstance(e, HfHubHTTPError) and e.response is not None and e.response.status_code in RETRY_STATUS:
        return True, _retry_after(e.response.headers)
    if isinstance(e, (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)):
        return True, None
    return False, None


def translate(e: BaseException, *, file: str, endpoint: str, repo_id: str, revision: str | None) -> K3ckptError:
    """A huggingface_hub or transport exception as the matching k3ckpt kind,
    with a message that says what to do."""
    rev = revision or "the default branch"
    if isinstance(e, K3ckptError):
        return e
    if isinstance(e, GatedRepoError):
        return RemoteError(f"{repo_id} is gated: accept its conditions on the Hub and set HF_TOKEN "
                           "(or pass a token)", file=file)
    if isinstance(e, RepositoryNotFoundError):
        return NotFoundError(f"no model repo {repo_id!r} at {endpoint} (if it is private or gated, set HF_TOKEN "
                             "or pass a token)", file=file)
    if isinstance(e, RevisionNotFoundError):
        return NotFoundError(f"repo {repo_id!r} has no revision {rev!r} (a branch, tag or 40-hex commit)", file=file)
    if isinstance(e, LocalEntryNotFoundError):  # before EntryNotFoundError: it is one
        return RemoteError(f"not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub was not "
                           f"asked (offline mode or no connection): {_first_line(e)}", file=file)
    if isinstance(e, EntryNotFoundError):
        return NotFoundError(f"no such file or folder in {repo_id} at {rev}", file=file)
    if isinstance(e, OfflineModeIsEnabled):
        return RemoteError("HF_HUB_OFFLINE is set, so the Hub cannot be asked; unset it or use a cached copy",
                           file=file)
    if isinstance(e, FileMetadataError):
        return RemoteError(f"{endpoint} does not answer like a Hugging Face Hub: {_first_line(e)}", file=file)
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return RemoteError(f"HTTP {status} from {endpoint}: {_first_line(e)}", file=file)
    if isinstance(e, httpx2.HTTPError):
        return RemoteError(f"cannot talk to {endpoint}: {type(e).__name__}: {e}", file=file)
    raise e  # not ours to translate: a bug elsewhere keeps its traceback


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(e).__name__


class HubClient:
    """Endpoint, token, retries and byte counting shared by one hub session."""

    def __init__(self, endpoint: str | None = None, token: str | bool | None = None, *,
                 retry: RetryPolicy | None = None, timeout: float | None = None):
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self.token = token
        self.retry = retry or RetryPolicy()
        self.timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT if timeout is None else timeout
        self.api = HfApi(endpoint=self.endpoint, token=token, library_name="k3ckpt", library_version=__version__)
        self.stats = TransferStats()
        self._sleep = time.sleep

    # -- metadata --------------------------------------------------------------

    def call(self, thunk: Callable[[], T], *, file: str, repo_id: str, revision: str | None) -> T:
        """``thunk()`` (a huggingface_hub call) with bounded retries on
        429/5xx/transport errors, errors translated to k3ckpt kinds naming ``file``."""
        attempt = 0
        while True:
            try:
                return thunk()
            except Exception as e:  # noqa: BLE001 - sorted by _retryable / translate
                again, after = _retryable(e)
                if not again or attempt >= self.retry.max_retries:
                    raise translate(e, file=file, endpoint=self.endpoint, repo_id=repo_id,
                                    revision=revision) from e
                attempt += 1
                self.stats.add(retries=1)
                self._sleep(self.retry.wait(attempt, after))

    def file_url(self, repo_id: str, path: str, commit: str) -> str:
        return hf_hub_url(repo_id, path, revision=commit, endpoint=self.endpoint)

    def headers(self) -> dict[str, str]:
        return build_hf_headers(token=self.token, library_name="k3ckpt", library_version=__version__)

    # -- ranges ----------------------------------------------------------------

    def read_range(self, url: str, offset: int, out: memoryview, *, size: int, label: str, repo_id: str,
                   commit: str) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of the file at
        ``url`` (``size`` bytes long), by ``Range`` requests.  A dropped
        connection resumes from the last byte received; everything is bounded
        by the retry policy.  Exactly the requested bytes are asked for."""
        n = out.nbytes
        done = [0]  # bytes of ``out`` filled so far; survives a dropped connection
        attempt = 0
        headers = self.headers()
        while done[0] < n:
            start, end = offset + done[0], offset + n - 1
            try:
                self._get_range(url, start, end, out, done, size=size, label=label, headers=headers)
                if done[0] < n:
                    raise httpx2.RemoteProtocolError(f"body ended after {done[0]:,} of {n:,} bytes")
            except (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError) as e:
                if attempt >= self.retry.max_retries:
                    raise RemoteError(f"range {offset:,}+{n:,} failed after {attempt + 1} tries: "
                                      f"{type(e).__name__}: {e}", file=label) from e
                attempt += 1
                self.stats.add(retries=1)
                self._sleep(self.retry.wait(attempt))
            except Exception as e:  # noqa: BLE001
                raise translate(e, file=label, endpoint=self.endpoint, repo_id=repo_id, revision=commit) from e

    def _get_range(self, url: str, start: int, end: int, out: memoryview, done: list[int], *, size: int,
                   label: str, headers: dict[str, str]) -> None:
        want = end - start + 1
        h = dict(headers, Range=f"bytes={start}-{end}")
        with http_stream_backoff("GET", url, headers=h, timeout=self.timeout,
                                 max_retries=self.retry.max_retries, base_wait_time=self.retry.base_wait,
                                 max_wait_time=self.retry.max_wait, retry_on_exceptions=()) as r:
            self.stats.add(requests=1)
            if r.status_code >= 400:
                r.read()
                hf_raise_for_status(r)
            if r.status_code != 206:
                # A 200 would stream the whole file: refuse instead of reading it.
                raise RemoteError(f"asked for bytes {start:,}-{end:,} and got HTTP {r.status_code} instead of "
                                  "206 Partial Content: the server does not serve ranges", file=label)
            m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", "").strip())
            if m is None or int(m.group(1)) != start or int(m.group(2)) != end:
                raise RemoteError(f"asked for bytes {start:,}-{end:,}, server sent Content-Range "
                                  f"{r.headers.get('Content-Range')!r}", file=label)
            if m.group(3) != "*" and int(m.group(3)) != size:
                raise RemoteError(f"file is {int(m.group(3)):,} bytes on the server, the listing said {size:,}",
                                  file=label)
            limit = done[0] + want
            for chunk in r.iter_bytes():
                k = len(chunk)
                self.stats.add(nbytes=k)
                if done[0] + k > limit:
                    raise RemoteError(f"server sent more than the {want:,} bytes asked for", file=label)
                out[done[0]:done[0] + k] = chunk
                done[0] += k


class HubFile:
    """A ``ByteSource`` over one file at a pinned commit.

    ``prefetch_header`` fetches the first ``8 + N`` bytes (the safetensors
    header) in at most two requests and keeps them, so the reader's strict
    parser reads them from memory; ``release_prefix`` drops them.
    """

    def __init__(self, client: HubClient, *, repo_id: str, commit: str, path: str, name: str, size: int,
                 label: str):
        self.client = client
        self.repo_id = repo_id
        self.commit = commit
        self.path = path          # from the repo root
        self.name = name          # relative to the checkpoint folder (the index's shard name)
        self.size = int(size)
        self.label = label        # hf://ORG/NAME@COMMIT/PATH, for messages
        self.url = client.file_url(repo_id, path, commit)
        self._prefix = b""

    def __repr__(self) -> str:
        return f"HubFile({self.label!r}, size={self.size:,})"

    def _check(self, offset: int, n: int) -> None:
        if offset < 0 or n < 0:
            raise UsageError(f"pread needs offset, n >= 0, got {offset}, {n}", file=self.label)
        if offset + n > self.size:
            raise TruncatedFileError(f"read of {n:,} bytes at {offset:,} passes the end ({self.size:,} bytes)",
                                     file=self.label)

    def pread(self, offset: int, n: int) -> bytes:
        self._check(offset, n)
        if offset + n <= len(self._prefix):
            return self._prefix[offset:offset + n]
        buf = bytearray(n)
        self.pread_into(offset, memoryview(buf))
        return bytes(buf)

    def pread_into(self, offset: int, buf: memoryview) -> None:
        view = memoryview(buf).cast("B")
        n = view.nbytes
        self._check(offset, n)
        if n == 0:
            return
        if offset + n <= len(self._prefix):
            view[:] = self._prefix[offset:offset + n]
            return
        self.client.read_range(self.url, offset, view, size=self.size, label=self.label, repo_id=self.repo_id,
                               commit=self.commit)

    def prefetch_header(self, guess: int) -> int:
        """Fetch and keep the header bytes; ``guess`` is the expected header
        size (too small costs one more request).  Returns the bytes kept."""
        from ..io.header import parse_header_length

        first = self.pread(0, min(self.size, max(8, int(guess))))
        n = parse_header_length(first[:8], source=self.label, file_size=self.size)
        need = 8 + n
        if need > len(first):
            first += self.pread(len(first), need - len(first))
        self._prefix = first[:need]
        return need

    def release_prefix(self) -> None:
        self._prefix = b""

    def close(self) -> None:
        self._prefix = b""  # the HTTP session is huggingface_hub's shared one; nothing else to free
