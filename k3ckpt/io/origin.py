"""Where a checkpoint's bytes come from: a local folder or file, or a Hub repo pinned to
a commit.  Every ``Checkpoint`` carries one (``ckpt.origin``), set when it is opened,
so code that records provenance (manifests, reports, plans) asks it instead of
probing for Hub attributes.  It lives beside the reader because a checkpoint gets its
origin at construction, before anything above ``io`` sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["Origin"]

LOCAL = "local"
HUB = "hub"


@dataclass(frozen=True)
class Origin:
    """A declared origin.  ``kind`` is ``local`` (``path``: the folder or file opened,
    None for in-memory sources) or ``hub`` (``repo_id``, the ``revision`` asked for, the
    ``commit`` it resolved to, the ``subfolder`` inside the repo)."""

    kind: str = LOCAL
    path: str | None = None
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    subfolder: str = ""

    def __post_init__(self) -> None:
        if self.kind not in (LOCAL, HUB):
            raise ValueError(f"origin kind must be {LOCAL!r} or {HUB!r}, found {self.kind!r}")
        if self.kind == HUB and not (self.repo_id and self.commit):
            raise ValueError("a hub origin needs a repo id and the commit it resolved to")

    @classmethod
    def local(cls, path: str | Path | None) -> Origin:
        return cls(LOCAL, path=None if path is None else str(path))

    @classmethod
    def hub(cls, repo_id: str, commit: str, *, revision: str | None = None, subfolder: str = "") -> Origin:
        return cls(HUB, repo_id=repo_id, revision=revision, commit=commit, subfolder=subfolder)

    def is_local(self) -> bool:
        return self.kind == LOCAL

    def identity(self) -> dict[str, str]:
        """What pins this source beyond its own bytes, for resume manifests: a Hub
        source's repo and commit (a resumed run must reopen exactly that commit); nothing
        for a local one (its shard names, sizes and config say what it is, wherever it lies)."""
        return {} if self.is_local() else {"repo_id": self.repo_id, "commit": self.commit}

    def label(self) -> str:
        """One line for reports: the path, or ``hf://REPO@COMMIT[/SUB]``."""
        if self.is_local():
            return self.path or "<in-memory checkpoint>"
        sub = f"/{self.subfolder}" if self.subfolder else ""
        return f"hf://{self.repo_id}@{self.commit}{sub}"
