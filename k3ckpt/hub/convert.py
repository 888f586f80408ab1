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

import math
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


def _listing(ckpt, path: str) -> list:
    """The Hub's entries of folder ``path`` of the source's repo, at the pinned commit."""
    files, client = ckpt.hub.files, ckpt.staging.stager.client
    repo, commit = files.requested.repo_id, files.commit
    return client.call(lambda: list(client.api.list_repo_tree(repo, path_in_repo=path or None, revision=commit,
                                                               recursive=False, expand=False)),
                       file=str(files.url), repo_id=repo, revision=commit)


def _fetch_side_file(ckpt, entry, dst: Path) -> None:
    """Repo file ``entry`` copied to ``dst`` through the Hugging Face cache, via a hidden partial file."""
    from .remote import RemoteFile, _download

    files = ckpt.hub.files
    cached = _download(ckpt.staging.stager.client, files.requested.repo_id, files.commit,
                       RemoteFile(entry.path, int(entry.size), entry.blob_id), label=files.label(entry.path))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial")
    shutil.copyfile(cached, tmp)
    os.replace(tmp, dst)


def fetch_side_files(ckpt, dst: str | os.PathLike) -> tuple[str, ...]:
    """Copy the source folder's small non-weight files (tokenizer, generation config, ...) that
    ``dst``'s manifest does not list yet into it, through the Hugging Face cache, and list them.

    The source's README.md (its model card) is not copied: the output is another model."""
    from huggingface_hub.hf_api import RepoFile

    from ..io.manifest import RunManifest
    from ..io.reader import CONFIG_NAME, INDEX_NAME

    folder = ckpt.hub.files.folder
    prefix = folder + "/" if folder else ""
    dst = Path(dst)
    manifest = RunManifest.load(dst)
    copied = []
    for e in sorted(_listing(ckpt, folder), key=lambda e: e.path):
        name = e.path[len(prefix):]
        if (not isinstance(e, RepoFile) or "/" in name or name.startswith(".") or name in _NOT_SIDE
                or name.endswith(".safetensors") or name in (INDEX_NAME, CONFIG_NAME)
                or e.size > SIDE_FILE_LIMIT or name in manifest.records):   # outputs, or copied before
            continue
        _fetch_side_file(ckpt, e, dst / name)
        manifest.record(name)
        copied.append(name)
    return tuple(copied)


# -- k3ckpt gguf from hf:// ------------------------------------------------------------------

_TEMPLATES = "additional_chat_templates"     # gguf.SpecialVocab reads its *.jinja too


def download_side_files(ckpt, folder: str | os.PathLike) -> tuple[str, ...]:
    """The source folder's small non-weight files (``config.json`` and ``additional_chat_templates/``
    included: the vocabulary reader looks in both) copied into ``folder`` through the Hugging Face
    cache, as a local checkpoint folder has them beside its shards; the names copied."""
    from huggingface_hub.hf_api import RepoFile, RepoFolder

    from ..io.reader import INDEX_NAME

    top = ckpt.hub.files.folder
    prefix = top + "/" if top else ""
    entries = _listing(ckpt, top)
    if any(isinstance(e, RepoFolder) and e.path == prefix + _TEMPLATES for e in entries):
        entries += [e for e in _listing(ckpt, prefix + _TEMPLATES) if e.path.endswith(".jinja")]
    folder = Path(folder)
    copied = []
    for e in sorted(entries, key=lambda e: e.path):
        name = e.path[len(prefix):]
        if (not isinstance(e, RepoFile) or name.startswith(".") or name in _NOT_SIDE or name == INDEX_NAME
                or name.endswith(".safetensors") or e.size > SIDE_FILE_LIMIT
                or ("/" in name and not name.startswith(_TEMPLATES + "/"))):
            continue
        _fetch_side_file(ckpt, e, folder / name)
        copied.append(name)
    return tuple(copied)


def _remove_side_files(folder: Path, names) -> None:
    for name in names:
        p = folder / name
        for q in (p, p.with_name(f".{p.name}.partial")):
            q.unlink(missing_ok=True)
    sub = folder / _TEMPLATES
    if sub.is_dir() and not any(sub.iterdir()):
        sub.rmdir()


@dataclass(frozen=True)
class GGUFBudget:
    """``--max-disk`` for a GGUF run: the output, the fetched side files and the two largest source
    shards staged at once (a tensor's read may straddle two; workers read a little ahead)."""

    max_disk: int
    output_bytes: int                       # the output's files, plus the staging window's slack
    side_bytes: int
    shards: tuple[tuple[str, int], ...]     # the two largest source shards

    @property
    def need(self) -> int:
        from .staged import _blocks

        return _blocks(self.output_bytes) + _blocks(self.side_bytes) + sum(_blocks(n) for _, n in self.shards)

    @property
    def ok(self) -> bool:
        return self.need <= self.max_disk

    def message(self) -> str:
        big = " and ".join(f"{s} ({n:,} bytes)" for s, n in self.shards)
        if not self.ok:
            return (f"--max-disk {self.max_disk:,} bytes cannot work: the output ({self.output_bytes:,} bytes) plus "
                    f"the largest source shards {big} need {self.need:,} bytes")
        return (f"--max-disk {self.max_disk:,} bytes works: the output plus the two largest source shards need "
                f"{self.need:,}")

    def to_dict(self) -> dict[str, Any]:
        return {"max_disk": self.max_disk, "need": self.need, "ok": self.ok, "output_estimate": self.output_bytes,
                "side_files_bytes": self.side_bytes, "largest_shards": [list(s) for s in self.shards],
                "message": self.message()}


def gguf_budget(ckpt, output_bytes: int, max_disk: int, side_bytes: int) -> GGUFBudget:
    from .staged import budget_check

    sizes = {n: ckpt.shard_size(n) for n in ckpt.shards}
    reserve = budget_check(sizes, len(ckpt.tensors), output_bytes, max_disk).output_bytes
    two = tuple(sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:2])
    return GGUFBudget(int(max_disk), reserve, int(side_bytes), two)


def gguf_from_hub(url: str, out: str | os.PathLike, *, resume: bool = False, dry_run: bool = False,
                  workers: int | None = None, progress: bool = False, ray: str | None = None,
                  **options: Any) -> HubRun:
    """``k3ckpt gguf`` from ``url`` into ``out`` (``GGUFResult`` in ``.result``) with staged shards.

    The side files (vocabulary, config, chat templates) are fetched first into the staging folder
    (default ``.k3ckpt-staging`` beside ``out``) and read from there; the plan and the ``max_disk``
    budget (``GGUFBudget``) come before any shard is downloaded.  Shards are staged when a tensor
    first reads them and released once no later tensor does (the GGUF order is by layer, not the
    source's).  A dry run fetches only the side files, into a temporary folder.  ``resume`` pins the
    commit the first run recorded in its manifest.  ``ray``: a Ray cluster (``HOST:PORT`` or
    ``auto``) encodes the experts; the driver stages the shards and sends each expert's weights to
    its task as Ray objects (``gguf.pool``), so no node but this one needs the staging folder.
    ``options``: ``staging``, ``keep_source``, ``max_disk``, ``endpoint``, ``token``, ``client``
    and the ``gguf.convert.write_gguf`` options."""
    import tempfile

    from ..errors import DiskSpaceError
    from ..gguf.manifest import GGUFManifest, manifest_path
    from ..gguf.run import (dry_result, estimate, output_files, plan_job, precheck, resolve_workers, run_job,
                            with_root)
    from .staged import STAGING_DIR, allocated_bytes, budget_check
    from .url import parse_hub_url

    stage = _stage_kw(options)
    report = options.pop("report", None)
    stage.pop("window", None)
    out = Path(out)
    if ray is not None and not dry_run:   # before any download: a cluster that cannot be reached is one line
        from ..raypool import join

        workers = join(ray, workers)
    n = resolve_workers(workers)
    ref = parse_hub_url(url)
    if resume and manifest_path(out).is_file():   # the commit the first run read, even if the branch moved
        commit = GGUFManifest.load(manifest_path(out)).source_commit
        if commit is not None:
            ref = ref.pinned(commit)
    tmp = tempfile.TemporaryDirectory(prefix="k3ckpt-gguf-") if dry_run else None
    try:
        given = stage.pop("staging", None)
        folder = Path(tmp.name) if tmp is not None else Path(given) if given else out.parent / STAGING_DIR
        max_disk = stage.get("max_disk")
        with open_staged(ref, out.parent, staging=folder, **stage) as ckpt:
            if not dry_run:
                precheck(ckpt, out, resume=resume, **options)
            folder.mkdir(parents=True, exist_ok=True)
            side = download_side_files(ckpt, folder)
            side_bytes = sum((folder / s).stat().st_size for s in side)
            view = with_root(ckpt, folder)
            base = plan_job(view, out, measure=False, **options)     # headers and vocabulary only
            grow = 0
            if options.get("target_bpw") is not None:   # measured types may be larger than the base plan's
                experts = [p for p in base.planned if p.recipe.kind == "experts"]
                weights = sum(math.prod(p.info.shape) for p in experts)
                grow = max(0, int(weights * float(options["target_bpw"]) / 8) - sum(p.info.nbytes for p in experts))
            budget = None if max_disk is None else gguf_budget(ckpt, base.total_size + grow, max_disk, side_bytes)
            if dry_run:
                pf = budget_check({s: ckpt.shard_size(s) for s in ckpt.shards}, len(ckpt.tensors),
                                  base.total_size + grow, max_disk)
                result = dry_result(base, estimate(view, base, n),
                                    budget=budget.to_dict() if budget is not None else None)
                return HubRun(result, side, str(ckpt.hub.url), ckpt.hub.commit, ckpt.staging.stats(), pf)
            if budget is not None and not budget.ok:
                raise DiskSpaceError(budget.message(), file=str(out))
            job = base if options.get("target_bpw") is None else plan_job(view, out, measure=True,
                                                                          progress=progress, **options)
            win = ckpt.staging
            win.output_bytes = lambda: sum(allocated_bytes(p) for p in output_files(job))
            pf = win.preflight(job.total_size)
            win.window = len(ckpt.shards) + 1      # no release behind a front: releases go by last use
            last: dict[int, list[str]] = {}
            for shard, i in _last_use(view, job).items():
                last.setdefault(i, []).append(shard)

            def after(i: int) -> None:
                for shard in last.get(i, ()):
                    win.release(shard)

            result = run_job(view, job, resume=resume, workers=n, report=report, progress=progress,
                             after_tensor=after, ray=ray)
            if not win.stager.keep:
                _remove_side_files(folder, side)
            ckpt.finish()
            result = _with_budget(result, budget)
            return HubRun(result, side, str(ckpt.hub.url), ckpt.hub.commit, win.stats(), pf)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _last_use(ckpt, job) -> dict[str, int]:
    """Source shard -> the last planned tensor (by index) that reads it."""
    out: dict[str, int] = {}
    for i, p in enumerate(job.planned):
        for name in p.recipe.sources:
            out[ckpt.tensors[name].shard] = i
    return out


def _with_budget(result, budget):
    import dataclasses

    return result if budget is None else dataclasses.replace(result, budget=budget.to_dict())
