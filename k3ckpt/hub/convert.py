"""Download-and-convert: ``k3ckpt requant`` / ``k3ckpt shard`` with an ``hf://`` source.

Each function opens the source as a ``StagedCheckpoint`` (shards downloaded
one at a time into the staging folder, released once the run has moved past
them), checks the ``max_disk`` budget against the run's output estimate
before anything is downloaded, runs the ordinary local pipeline, and on
success removes the staging folder (kept with ``keep_source``).  An
interrupted run leaves staged and partial shards in place; the rerun with
``resume=True`` reopens the commit the first run pinned in its manifest,
continues partial downloads and re-verifies staged shards instead of
fetching them again.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .staged import DiskPreflight, StageStats, open_staged

SIDE_FILE_LIMIT = 64 << 20     # tokenizer files and the like; anything larger is not a side file
_NOT_SIDE = ("README.md", ".gitattributes")


@dataclass(frozen=True)
class HubRun:
    """A pipeline's result plus what staging did."""

    result: Any                       # RequantResult or ShardResult
    side_files: tuple[str, ...]       # small files of the source folder copied into the output
    source: str                       # hf://ORG/NAME@COMMIT[/SUB]: the pinned source
    commit: str
    stage: StageStats
    preflight: DiskPreflight

    def facts(self) -> dict[str, Any]:
        pf = self.preflight
        return {"source": self.source, "commit": self.commit, **self.stage.to_dict(),
                "max_disk": pf.max_disk or None, "output_estimate": pf.output_bytes,
                "largest_shard_bytes": pf.largest_shard_bytes}


def _stage_kw(kw: dict[str, Any]) -> dict[str, Any]:
    keys = ("staging", "keep_source", "max_disk", "endpoint", "token", "client", "window")
    return {k: kw.pop(k) for k in keys if k in kw}


def requant_from_hub(url: str, dst: str | os.PathLike, *, resume: bool = False, **options: Any) -> HubRun:
    """``requant_checkpoint`` from ``url`` into ``dst`` with staged shards.

    ``options``: ``staging``, ``keep_source``, ``max_disk``, ``endpoint``,
    ``token`` (staging, see ``open_staged``) and the ``requant_checkpoint``
    options (``format``, ``experts``, ``tensor_type``, ``workers``,
    ``target_bpw``, ...).  With ``target_bpw`` every weight is measured in a
    first pass and converted in a second, so each shard is downloaded twice
    unless ``keep_source`` (or a budget holding every shard) keeps it."""
    from ..requant.pipeline import requant_checkpoint
    from ..requant.plan import DEFAULT_FORMAT, plan_requant

    stage = _stage_kw(options)
    with open_staged(url, dst, resume=resume, **stage) as ckpt:
        extra = {"layout": options["layout"]} if options.get("layout") is not None else {}
        plan = plan_requant(ckpt, format=options.get("format", DEFAULT_FORMAT), experts=options.get("experts"),
                            tensor_type=options.get("tensor_type", ()), **extra)
        estimate = plan.total_bytes
        if options.get("target_bpw") is not None:  # weights kept in MXFP4 keep their source size
            estimate += max(0, plan.in_bytes - plan.out_bytes)
        pf = ckpt.staging.preflight(estimate)
        source = str(ckpt.hub.url)
        result = requant_checkpoint(ckpt, dst, resume=resume, source_label=source, **options)
        side = fetch_side_files(ckpt, dst)
        ckpt.finish()
        return HubRun(result, side, source, ckpt.hub.commit, ckpt.staging.stats(), pf)


def shard_from_hub(url: str, plan, dst: str | os.PathLike, *, resume: bool = False, **options: Any) -> HubRun:
    """``shard_checkpoint`` from ``url`` into ``dst`` with staged shards (options as ``requant_from_hub``,
    plus the ``shard_checkpoint`` options)."""
    from ..shard.materialize import estimate_bytes, rank_work, shard_checkpoint
    from ..shard.source import read_source

    stage = _stage_kw(options)
    with open_staged(url, dst, resume=resume, **stage) as ckpt:
        layout, tp = options.get("layout", "k3ckpt"), options.get("tp", 1)
        src = read_source(ckpt, moet=layout == "moet", tp=tp)
        works = rank_work(src, plan, options.get("ranks"))
        pf = ckpt.staging.preflight(estimate_bytes(src, works, layout, tp))
        result = shard_checkpoint(ckpt, plan, dst, resume=resume, **options)
        ckpt.finish()
        return HubRun(result, (), str(ckpt.hub.url), ckpt.hub.commit, ckpt.staging.stats(), pf)


def fetch_side_files(ckpt, dst: str | os.PathLike) -> tuple[str, ...]:
    """Copy the source folder's small non-weight files (tokenizer, generation config, ...) that
    ``dst``'s manifest does not list yet into it, through the Hugging Face cache, and list them.

    The source's README.md (its model card) is not copied: the output is another model."""
    from huggingface_hub.hf_api import RepoFile

    from ..io.manifest import RunManifest
    from ..io.reader import CONFIG_NAME, INDEX_NAME
    from .remote import RemoteFile, _download

    files, client = ckpt.hub.files, ckpt.staging.stager.client
    repo, commit, folder = files.requested.repo_id, files.commit, files.folder
    listing = client.call(lambda: list(client.api.list_repo_tree(repo, path_in_repo=folder or None, revision=commit,
                                                                  recursive=False, expand=False)),
                          file=str(files.url), repo_id=repo, revision=commit)
    prefix = folder + "/" if folder else ""
    dst = Path(dst)
    manifest = RunManifest.load(dst)
    copied = []
    for e in sorted(listing, key=lambda e: e.path):
        name = e.path[len(prefix):]
        if (not isinstance(e, RepoFile) or "/" in name or name.startswith(".") or name in _NOT_SIDE
                or name.endswith(".safetensors") or name in (INDEX_NAME, CONFIG_NAME)
                or e.size > SIDE_FILE_LIMIT or name in manifest.records):   # outputs, or copied before
            continue
        cached = _download(client, repo, commit, RemoteFile(e.path, int(e.size), e.blob_id),
                           label=files.label(e.path))
        tmp = dst / f".{name}.partial"
        shutil.copyfile(cached, tmp)
        os.replace(tmp, dst / name)
        manifest.record(name)
        copied.append(name)
    return tuple(copied)
