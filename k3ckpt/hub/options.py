"""Checking the hub options of ``api.requant`` / ``shard`` / ``gguf`` (light: no huggingface_hub import)."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from .url import HubUrl, is_hub_url


def check_push_repo(repo_id: str) -> str:
    """``ORG/NAME`` for ``--push-to-hub`` (the Hub's repo-id rules), or a ``UsageError``."""
    if not isinstance(repo_id, str) or repo_id.startswith("hf://") or "@" in repo_id:
        raise UsageError(f"--push-to-hub takes ORG/NAME, found {repo_id!r}")
    try:
        HubUrl(repo_id)
    except UsageError as e:
        raise UsageError(f"--push-to-hub {repo_id!r}: {e.detail}") from None
    return repo_id


def hub_run_options(src: str, *, max_disk: int | str | None, staging: str | None, keep_source: bool,
                    push_to: str | None, private: bool, revision: str | None,
                    dry_run: bool = False) -> dict[str, Any] | None:
    """The staging options for ``k3ckpt.hub.convert`` when ``src`` is an ``hf://`` URL (None
    otherwise, to use the ordinary local path).  A dry run uses them only to check the budget.

    Refuses staging options with a local source and push options without
    ``--push-to-hub`` (or with ``--dry-run``), naming the option."""
    if push_to is not None:
        check_push_repo(push_to)
        if dry_run:
            raise UsageError("--push-to-hub with --dry-run: nothing would be written to push")
    elif private or revision is not None:
        raise UsageError("--private and --push-revision only go with --push-to-hub ORG/NAME")
    hub = is_hub_url(src)
    given = [o for o, v in (("--max-disk", max_disk), ("--staging", staging), ("--keep-source", keep_source))
             if v is not None and v is not False]
    if given and not hub:
        raise UsageError(f"{', '.join(given)}: only for an hf:// source (shards are downloaded, converted, "
                         "deleted); SRC is a local path")
    if not hub:
        return None
    budget = None
    if max_disk is not None:
        from ..placement.devices import parse_bytes

        budget = parse_bytes(max_disk, "--max-disk")
        if budget <= 0:
            raise UsageError(f"--max-disk must be above zero, found {max_disk!r}")
    return {"max_disk": budget, "staging": staging, "keep_source": bool(keep_source)}
