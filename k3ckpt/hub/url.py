"""``hf://ORG/NAME[@REVISION][/SUBFOLDER]``: parsing and checking Hub checkpoint URLs.

Light on purpose (no huggingface_hub import) so the CLI can tell a hub URL
from a local path without paying for the HTTP stack.

* ``ORG/NAME`` follows the Hub's repo-id rules (huggingface_hub
  ``validate_repo_id``): ASCII letters, digits, ``_ . -``, starting and ending
  with a letter, digit or ``_``; no ``--`` or ``..``; at most 96 characters each.
* ``@REVISION`` is a branch, tag or 40-hex commit.  A revision holding ``/``
  is written percent-encoded (``@release%2Fv1``), except pull-request refs,
  which may be written plainly (``@refs/pr/3``) as in ``HfFileSystem`` paths.
* ``/SUBFOLDER`` is a folder inside the repo holding the checkpoint (or a
  single ``.safetensors`` file); its components obey the same rules as shard
  names in an index (no empty, ``.`` or ``..`` component, no backslash).

Only model repos: ``hf://datasets/...`` and friends are refused rather than
read as a model repo owned by a user called ``datasets``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from urllib.parse import quote, unquote

from ..errors import UsageError

SCHEME = "hf://"
EXPECTED = "hf://ORG/NAME[@REVISION][/SUBFOLDER]"
_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_PR_REF = re.compile(r"refs/pr/\d+")
_OTHER_REPO_TYPES = ("datasets", "spaces", "buckets", "kernels")


def is_hub_url(s: object) -> bool:
    """Whether ``s`` is meant as a Hub URL (starts with ``hf://``); it may still be malformed."""
    return isinstance(s, str) and s.startswith(SCHEME)


def is_commit(revision: str | None) -> bool:
    """A full 40-hex commit sha (immutable, so nothing to resolve)."""
    return revision is not None and _COMMIT.fullmatch(revision) is not None


def _bad(s: str, why: str) -> UsageError:
    return UsageError(f"bad Hub URL {s}: {why}; expected {EXPECTED}")


def _problem(repo_id: object, revision: object, subfolder: object) -> str | None:
    """Why these parts do not make a Hub checkpoint location, or None."""
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        return "the repo id must be ORG/NAME"
    for part in repo_id.split("/"):
        if not _PART.fullmatch(part) or "--" in part or ".." in part:
            return (f"{part!r} is not a valid Hub name (ASCII letters, digits, '_', '.', '-'; "
                    "no '--' or '..'; at most 96 characters)")
    if revision is not None:
        if not isinstance(revision, str) or not revision:
            return "the revision after '@' is empty"
        if (len(revision) > 255 or ".." in revision.split("/")
                or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in revision)):
            return f"revision {revision!r} is not a branch, tag or commit name"
    if not isinstance(subfolder, str):
        return "the subfolder must be a string"
    if subfolder:
        if "\\" in subfolder or "\x00" in subfolder:
            return f"subfolder {subfolder!r} holds a backslash or NUL"
        if any(p in ("", ".", "..") for p in subfolder.split("/")):
            return f"subfolder {subfolder!r} has an empty, '.' or '..' component"
    return None


@dataclass(frozen=True)
class HubUrl:
    """A parsed ``hf://`` URL.  ``revision=None`` means the repo's default branch."""

    repo_id: str
    revision: str | None = None
    subfolder: str = ""

    def __post_init__(self) -> None:
        why = _problem(self.repo_id, self.revision, self.subfolder)
        if why is not None:
            raise _bad(f"repo {self.repo_id!r}, revision {self.revision!r}, subfolder {self.subfolder!r}", why)

    def __str__(self) -> str:
        rev = ""
        if self.revision is not None:
            rev = "@" + (self.revision if _PR_REF.fullmatch(self.revision) else quote(self.revision, safe=""))
        sub = "/" + self.subfolder if self.subfolder else ""
        return f"{SCHEME}{self.repo_id}{rev}{sub}"

    def pinned(self, commit: str) -> HubUrl:
        """The same location at a fixed commit."""
        return replace(self, revision=commit)

    def path_in_repo(self, name: str = "") -> str:
        """``name`` (a path relative to the subfolder) as a path from the repo root."""
        if not name:
            return self.subfolder
        return f"{self.subfolder}/{name}" if self.subfolder else name


def parse_hub_url(s: str) -> HubUrl:
    """Parse ``hf://ORG/NAME[@REVISION][/SUBFOLDER]``; ``UsageError`` (naming the
    expected form) for anything else."""
    if not is_hub_url(s):
        raise _bad(repr(s), f"it does not start with {SCHEME!r}")
    rest = s[len(SCHEME):]
    if rest.endswith("/"):
        rest = rest[:-1]
    parts = rest.split("/")
    if parts[0] in _OTHER_REPO_TYPES:
        raise _bad(repr(s), f"only model repos are supported, not {parts[0]}")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise _bad(repr(s), "the repo id must be ORG/NAME")
    org, name_rev, tail = parts[0], parts[1], parts[2:]
    name, at, rev = name_rev.partition("@")
    revision = None
    if at:
        if rev == "refs" and len(tail) >= 2 and tail[0] == "pr" and tail[1].isdigit():
            revision, tail = f"refs/pr/{tail[1]}", tail[2:]
        else:
            try:
                revision = unquote(rev, errors="strict")
            except UnicodeDecodeError:
                raise _bad(repr(s), "the revision's %-escapes are not UTF-8") from None
        if not revision:
            raise _bad(repr(s), "the revision after '@' is empty")
    if "@" in org or "@" in name:
        raise _bad(repr(s), "'@' may appear once, after NAME")
    subfolder = "/".join(tail)
    why = _problem(f"{org}/{name}", revision, subfolder)
    if why is not None:
        raise _bad(repr(s), why)
    return HubUrl(f"{org}/{name}", revision, subfolder)
