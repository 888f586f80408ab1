"""Open an ``hf://`` checkpoint: index + headers by range reads, tensors on request.

``resolve_checkpoint`` pins the revision to a commit and finds the checkpoint's
files with their sizes (one ``model_info``, one tree listing, the index and
``config.json`` through ``hf_hub_download`` so they land in the Hugging Face
cache).  ``open_hub_checkpoint`` then fetches each shard's header -- the first
``8 + N`` bytes, in at most two range requests per shard, shards in parallel --
and hands the bytes to the reader's one strict parser through
``checkpoint_from_sources``.  No tensor byte is fetched until a tensor is read.

With ``HF_HUB_OFFLINE=1`` nothing is asked of the Hub: the checkpoint is
opened from a complete snapshot in the local cache, or a ``RemoteError`` says
it is not there.

The returned ``Checkpoint`` carries ``.origin`` (repo, commit) and ``.hub``, a ``HubSource`` (repo, revision,
pinned commit, endpoint, ``bytes_fetched``).  The file list
(``HubCheckpointFiles``, sizes and LFS sha256 per file) is what the later
download/convert steps plan disk budgets and verify downloads with.
"""

from __future__ import annotations

import itertools
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from huggingface_hub import constants, hf_hub_download, snapshot_download, try_to_load_from_cache
from huggingface_hub.hf_api import RepoFile
from tqdm.auto import tqdm

from ..errors import InvalidFileError, K3ckptError, NotFoundError, RemoteError
from ..io.header import MAX_HEADER_BYTES, Header, loads_index, loads_strict, paused_gc, read_header
from ..io.origin import Origin
from ..io.reader import (
    CONFIG_NAME,
    INDEX_NAME,
    MAX_JSON_BYTES,
    Checkpoint,
    check_shard_name,
    checkpoint_from_sources,
    load_config,
    open_checkpoint,
    parse_index,
)
from .client import HubClient, HubFile, TransferStats
from .url import HubUrl, is_commit, parse_hub_url

HEADER_WORKERS = 8                # parallel header fetches: latency, not bandwidth, bounds a remote open
_BYTES_PER_ENTRY = 80             # JSON bytes per header entry besides its name (K3 averages 76)
_GUESS_NO_INDEX = 64 << 10        # first header read when no index says how many tensors a shard holds


@dataclass(frozen=True)
class RemoteFile:
    """One file of the repo at the pinned commit."""

    path: str                 # from the repo root
    size: int
    blob_id: str | None = None
    sha256: str | None = None  # LFS files: the sha256 a download must hash to


@dataclass(frozen=True)
class HubCheckpointFiles:
    """Where a checkpoint lives in a repo at one commit, and its files."""

    requested: HubUrl
    commit: str
    endpoint: str
    folder: str                           # checkpoint folder in the repo, "" for the root
    shards: dict[str, RemoteFile]         # shard name (relative to ``folder``) -> file
    index: RemoteFile | None = None
    config: RemoteFile | None = None

    @property
    def url(self) -> HubUrl:
        """The checkpoint at the pinned commit (a single-file checkpoint keeps its file name)."""
        return self.requested.pinned(self.commit)

    @property
    def shard_bytes(self) -> int:
        return sum(f.size for f in self.shards.values())

    @property
    def total_bytes(self) -> int:
        extra = [f for f in (self.index, self.config) if f is not None]
        return self.shard_bytes + sum(f.size for f in extra)

    def label(self, path_in_repo: str) -> str:
        return f"hf://{self.requested.repo_id}@{self.commit}/{path_in_repo}"


@dataclass
class HubSource:
    """What an ``hf://`` checkpoint was opened from.  ``bytes_fetched`` grows as
    tensors are read (file bytes: index, config, header and tensor ranges)."""

    requested: HubUrl
    commit: str
    endpoint: str
    files: HubCheckpointFiles | None        # None when opened from the local cache
    stats: TransferStats = field(default_factory=TransferStats)
    cache_folder: Path | None = None         # set when opened from the local cache (offline)

    @property
    def bytes_fetched(self) -> int:
        return self.stats.bytes_fetched

    @property
    def url(self) -> HubUrl:
        return self.requested.pinned(self.commit)

    def facts(self) -> dict[str, Any]:
        """JSON-ready facts for reports (``InspectReport.extra['hub']``)."""
        out: dict[str, Any] = {
            "url": str(self.requested),
            "repo_id": self.requested.repo_id,
            "revision": self.requested.revision,
            "commit": self.commit,
            "subfolder": self.requested.subfolder,
            "endpoint": self.endpoint,
            "bytes_fetched": self.stats.bytes_fetched,
            "range_requests": self.stats.range_requests,
            "retries": self.stats.retries,
            "offline": self.cache_folder is not None,
        }
        if self.files is not None:
            out["repo_checkpoint_bytes"] = self.files.total_bytes
        return out


class _QuietTqdm(tqdm):
    """Library code never prints: huggingface_hub's download bars stay off."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _remote_file(entry: RepoFile) -> RemoteFile:
    lfs = entry.lfs
    return RemoteFile(path=entry.path, size=int(entry.size), blob_id=entry.blob_id,
                      sha256=None if lfs is None else lfs.sha256)


# ---------------------------------------------------------------------------
# resolving


def resolve_checkpoint(url: str | HubUrl, client: HubClient) -> tuple[HubCheckpointFiles, dict | None, dict | None]:
    """Pin ``url``'s revision and list its checkpoint files.  Returns the file
    list, the index JSON (None without an index) and ``config.json`` (or None)."""
    ref = url if isinstance(url, HubUrl) else parse_hub_url(url)
    repo, api = ref.repo_id, client.api
    where = str(ref)

    def call(thunk, file=where):
        return client.call(thunk, file=file, repo_id=repo, revision=ref.revision)

    info = call(lambda: api.model_info(repo, revision=ref.revision))
    commit = getattr(info, "sha", None)
    if not is_commit(commit):
        raise RemoteError(f"{client.endpoint} did not give a 40-hex commit for revision "
                          f"{ref.revision or 'default'}, found {commit!r}", file=where)
    pinned = ref.pinned(commit)

    folder, single = ref.subfolder, None
    if folder.endswith(".safetensors"):
        found = call(lambda: api.get_paths_info(repo, [folder], revision=commit), file=str(pinned))
        hit = [e for e in found if e.path == folder]
        if not hit:
            raise NotFoundError(f"no such file or folder in {repo} at {commit}", file=str(pinned))
        if isinstance(hit[0], RepoFile):
            folder, single = posixpath.dirname(folder), _remote_file(hit[0])

    listing = call(lambda: list(api.list_repo_tree(repo, path_in_repo=folder or None, revision=commit,
                                                   recursive=False, expand=False)), file=str(pinned))
    prefix = folder + "/" if folder else ""
    here: dict[str, RemoteFile] = {}
    for e in listing:
        if isinstance(e, RepoFile) and e.path.startswith(prefix) and "/" not in e.path[len(prefix):]:
            here[e.path[len(prefix):]] = _remote_file(e)

    def label(name: str) -> str:
        return f"hf://{repo}@{commit}/{prefix}{name}"

    index_file = None if single else here.get(INDEX_NAME)
    config_file = here.get(CONFIG_NAME)
    index_json = None
    if single is not None:
        shards = {posixpath.basename(single.path): single}
    elif index_file is not None:
        index_json = _load_json(client, repo, commit, index_file, what="index JSON", label=label(INDEX_NAME))
        names = _shard_names(index_json, source=label(INDEX_NAME))
        nested = [prefix + n for n in names if n not in here]
        if nested:  # shards in sub-folders of the checkpoint folder: ask for exactly those
            for e in call(lambda: api.get_paths_info(repo, nested, revision=commit), file=str(pinned)):
                if isinstance(e, RepoFile) and e.path.startswith(prefix):
                    here[e.path[len(prefix):]] = _remote_file(e)
        missing = [n for n in names if n not in here]
        if missing:
            raise NotFoundError(f"index names {len(missing)} shard(s) the repo does not hold at {commit}, "
                                f"e.g. {missing[0]!r}", file=label(INDEX_NAME))
        shards = {n: here[n] for n in names}
    else:
        shards = {n: f for n, f in here.items() if n.endswith(".safetensors") and not n.startswith(".")}
        if not shards:
            raise NotFoundError(f"no {INDEX_NAME} and no *.safetensors files in "
                                f"{folder or 'the repo root'} at {commit}", file=str(pinned))
    for n in shards:
        check_shard_name(n, source=str(pinned))  # names from a listing are the server's word: check them too

    config = None
    if config_file is not None:
        path = _download(client, repo, commit, config_file, label=label(CONFIG_NAME))
        config = load_config(path)
    files = HubCheckpointFiles(requested=ref, commit=commit, endpoint=client.endpoint, folder=folder,
                               shards=shards, index=index_file, config=config_file)
    return files, index_json, config


def _shard_names(index_json: Any, *, source: str) -> list[str]:
    """The shard names an index lists, each checked by the reader's rules.

    ``checkpoint_from_sources`` validates the whole index again (``parse_index``);
    this pass only needs the names, so it checks each distinct name once
    instead of once per tensor (K3: 96 names, 497,220 tensors)."""
    wm = index_json.get("weight_map") if isinstance(index_json, dict) else None
    if not isinstance(wm, dict):
        parse_index(index_json, source=source)  # raises the reader's own message
        raise AssertionError("parse_index accepted an index without a weight_map")  # pragma: no cover
    if set(map(type, wm.values())) - {str}:
        tensor, shard = next((t, v) for t, v in wm.items() if not isinstance(v, str))
        raise InvalidFileError(f"weight_map value must be a shard name, found {shard!r}", file=source,
                               tensor=tensor)
    names = sorted(set(wm.values()))
    for n in names:
        check_shard_name(n, source=source)
    return names


def _download(client: HubClient, repo: str, commit: str, f: RemoteFile, *, label: str) -> Path:
    """One small file through huggingface_hub's cache (reused, and counted only when fetched)."""
    cached = try_to_load_from_cache(repo, f.path, revision=commit)
    path = client.call(lambda: hf_hub_download(repo, f.path, revision=commit, endpoint=client.endpoint,
                                               token=client.token, tqdm_class=_QuietTqdm, library_name="k3ckpt"),
                       file=label, repo_id=repo, revision=commit)
    if not isinstance(cached, str):
        client.stats.add(nbytes=f.size)
    return Path(path)


def _load_json(client: HubClient, repo: str, commit: str, f: RemoteFile, *, what: str, label: str) -> Any:
    if f.size > MAX_JSON_BYTES:
        raise InvalidFileError(f"{what} is {f.size:,} bytes, over the {MAX_JSON_BYTES:,}-byte limit", file=label)
    path = _download(client, repo, commit, f, label=label)
    return (loads_index if what == "index JSON" else loads_strict)(path.read_bytes(), source=label, what=what)


# ---------------------------------------------------------------------------
# opening


def _header_guesses(index_json: dict | None, shards: dict[str, RemoteFile]) -> dict[str, int]:
    """Expected header bytes per shard, from the index's tensor names."""
    if index_json is None:
        return {n: _GUESS_NO_INDEX for n in shards}
    wm = index_json["weight_map"]
    # Per shard: the UTF-8 bytes of its names plus a fixed cost per entry, summed in bulk
    # (a K3 index has 497,220 names; a Python loop over them costs a second).
    ids = {n: i for i, n in enumerate(shards)}
    which = np.fromiter(map(ids.get, wm.values(), itertools.repeat(len(ids))), dtype=np.int64, count=len(wm))
    names = "".join(wm)
    lengths = map(len, wm) if names.isascii() else (len(t.encode("utf-8")) for t in wm)
    nbytes = np.fromiter(lengths, dtype=np.int64, count=len(wm)) + _BYTES_PER_ENTRY
    per_shard = np.bincount(which, weights=nbytes, minlength=len(ids) + 1)[: len(ids)].astype(np.int64)
    est = {n: 256 + int(per_shard[i]) for n, i in ids.items()}  # 256: __metadata__ and braces
    return {n: min(MAX_HEADER_BYTES + 8, v + v // 16 + 4096) for n, v in est.items()}


def _relabel(e: K3ckptError, labels: dict[str, str]) -> K3ckptError:
    """The reader names remote shards by their bare names; name them by hf:// URL."""
    if e.file in labels:
        return type(e)(e.detail, file=labels[e.file], tensor=e.tensor)
    return e


def open_hub_checkpoint(url: str | HubUrl, *, endpoint: str | None = None, token: str | bool | None = None,
                        client: HubClient | None = None) -> Checkpoint:
    """Open ``hf://ORG/NAME[@REVISION][/SUBFOLDER]`` like a local checkpoint.

    Reads the index (or the folder listing), ``config.json`` and each shard's
    header; tensors are read later by range requests.  ``endpoint`` defaults
    to ``HF_ENDPOINT``, ``token`` to huggingface_hub's lookup (``HF_TOKEN``,
    the saved login); ``token=False`` sends none.  The result has ``.hub``
    (a ``HubSource``).
    """
    ref = url if isinstance(url, HubUrl) else parse_hub_url(url)
    client = client or HubClient(endpoint, token)
    if constants.is_offline_mode():
        return _open_cached(ref, client)
    # numba's first dispatch costs about a second of set-up; do it while the API calls
    # and the index download wait on the network.
    warm = threading.Thread(target=_warm_scanners, name="k3ckpt-warm-scanners", daemon=True)
    warm.start()
    files, index_json, config = resolve_checkpoint(ref, client)
    prefix = files.folder + "/" if files.folder else ""
    labels = {n: files.label(prefix + n) for n in files.shards}
    sources = {n: HubFile(client, repo_id=ref.repo_id, commit=files.commit, path=f.path, name=n, size=f.size,
                          label=labels[n]) for n, f in files.shards.items()}
    guesses = _header_guesses(index_json, files.shards)

    def fetch_and_parse(name: str, src: HubFile) -> Header:
        # parsing overlaps the other downloads: sockets and the numba header scan release the GIL
        src.prefetch_header(guesses[name])
        return read_header(src, source=name)

    try:
        with paused_gc(), ThreadPoolExecutor(max_workers=max(1, min(HEADER_WORKERS, len(sources)))) as pool:
            futures = {n: pool.submit(fetch_and_parse, n, s) for n, s in sources.items()}
            parsed = {n: f.result() for n, f in futures.items()}
    except K3ckptError as e:
        for s in sources.values():
            s.close()
        raise _relabel(e, labels) from None
    except BaseException:
        for s in sources.values():
            s.close()
        raise
    index_label = files.label(prefix + INDEX_NAME) if files.index is not None else str(files.url)
    try:
        with paused_gc():
            ckpt = checkpoint_from_sources(
                index_json, sources, config, root=None, index_source=index_label, headers=parsed,
                origin=_origin(ref, files.commit),
                hub=HubSource(requested=ref, commit=files.commit, endpoint=client.endpoint, files=files,
                              stats=client.stats))
    except K3ckptError as e:
        raise _relabel(e, labels) from None
    for s in sources.values():
        s.release_prefix()  # headers are parsed; keep no copy of their bytes
    return ckpt


def _warm_scanners() -> None:
    """Load the header, index and name scanners (numba caches) ahead of use.  Only
    a head start: any failure here shows again, properly reported, at first real use."""
    try:
        from ..io._header_scan import scan_header, scan_index
        from ..profiles._templates import scan_templates

        empty = np.frombuffer(b"{}", dtype=np.uint8)
        scan_header(empty)
        scan_index(empty)
        scan_templates(np.frombuffer(b"a", dtype=np.uint8), 1)
    except Exception:  # noqa: BLE001
        pass


def _open_cached(ref: HubUrl, client: HubClient) -> Checkpoint:
    """``HF_HUB_OFFLINE``: the checkpoint from a complete cached snapshot, or a RemoteError."""
    prefix = ref.subfolder + "/" if ref.subfolder else ""
    patterns = [prefix + "*.safetensors", prefix + "*.json"] if not ref.subfolder.endswith(".safetensors") \
        else [ref.subfolder, posixpath.join(posixpath.dirname(ref.subfolder), CONFIG_NAME)]
    snap = Path(client.call(lambda: snapshot_download(ref.repo_id, revision=ref.revision, local_files_only=True,
                                                      allow_patterns=patterns),
                            file=str(ref), repo_id=ref.repo_id, revision=ref.revision))
    where = snap / ref.subfolder if ref.subfolder else snap
    try:
        ckpt = open_checkpoint(where)
    except NotFoundError as e:
        raise RemoteError(f"HF_HUB_OFFLINE is set and the cached copy is incomplete: {e}", file=str(ref)) from None
    ckpt.origin = _origin(ref, snap.name)
    ckpt.hub = HubSource(requested=ref, commit=snap.name, endpoint=client.endpoint, files=None, stats=client.stats,
                         cache_folder=snap)
    return ckpt


def _origin(ref: HubUrl, commit: str) -> Origin:
    return Origin.hub(ref.repo_id, commit, revision=ref.revision, subfolder=ref.subfolder)
