"""One exception hierarchy for users' mistakes and bad input.

Every kind subclasses ``K3ckptError`` *and* the builtin it resembles, so callers
can catch either.  The CLI turns any ``K3ckptError`` into a one-line message and
exit status 2; anything else is our own bug and keeps its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hint:
    """What the caller can pass to get past an error: a keyword argument of the API and its
    value.  The API's message says ``pass overwrite=True``; the CLI names the option that sets
    the same parameter (``--overwrite``), so one raise speaks to both kinds of caller."""

    argument: str        # the API keyword, which is also the click parameter's name
    value: Any = True
    then: str = ""       # what passing it does: "to rebuild the fixture there"

    def say(self, spelled: str) -> str:
        return f"pass {spelled}" + (f" {self.then}" if self.then else "")

    def for_api(self) -> str:
        return self.say(f"{self.argument}={self.value!r}")


class K3ckptError(Exception):
    """Base of every error caused by input, not by a bug in k3ckpt.

    ``file`` and ``tensor`` (when known) are folded into the message so the
    one-line CLI output names them; ``hint`` is the argument that fixes it
    (worded for the API in ``str(exc)``, for the CLI by ``message(...)``).
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 hint: Hint | None = None):
        self.file = None if file is None else str(file)
        self.tensor = tensor
        self.detail = message
        self.hint = hint
        super().__init__(self.message(hint.for_api() if hint else None))

    def message(self, hint_text: str | None) -> str:
        """The full message with ``hint_text`` (the hint in some caller's words) after it."""
        where = []
        if self.file:
            where.append(self.file)
        if self.tensor:
            where.append(f"tensor {self.tensor!r}")
        prefix = (": ".join(where) + ": ") if where else ""
        return prefix + self.detail + (f"; {hint_text}" if hint_text else "")


class InvalidFileError(K3ckptError, ValueError):
    """A file's bytes do not follow its format (safetensors header, index, pack)."""


class TruncatedFileError(InvalidFileError):
    """A file is shorter than its own header says."""


class UnsupportedError(K3ckptError, NotImplementedError):
    """Valid input that k3ckpt does not handle (unknown dtype, format, model)."""


class ShapeError(K3ckptError, ValueError):
    """A tensor's shape or dtype does not fit what the operation needs."""


class UnsafePathError(K3ckptError, PermissionError):
    """A path from a file (index, manifest) would leave the checkpoint folder."""


class NotFoundError(K3ckptError, FileNotFoundError):
    """A named checkpoint, shard, tensor or format does not exist."""


class UsageError(K3ckptError, ValueError):
    """Bad options or arguments from the caller."""


class OutputExistsError(K3ckptError, FileExistsError):
    """The destination exists and is not something we may overwrite or resume."""


class ResumeMismatchError(K3ckptError, ValueError):
    """A resumed run was started with options different from the first run."""


class DiskSpaceError(K3ckptError, OSError):
    """Not enough free space for the output (checked before large writes)."""


class NaNScaleError(K3ckptError, ValueError):
    """A block scale is NaN (E8M0 0xFF) where a number is required."""


class RemoteError(K3ckptError, ConnectionError):
    """A hub request failed in a way retries did not cure."""


class WorkerLostError(K3ckptError, RuntimeError):
    """A pool worker process ended without its result: killed from outside (the kernel's
    out-of-memory killer, a signal), not an error in the input or in k3ckpt."""
