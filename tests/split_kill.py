"""Stopping a `k3ckpt gguf` run as SIGKILL would, right after its k-th file is final (shared by the
GGUF resume, report and Hub tests)."""

from __future__ import annotations

from k3ckpt.gguf import manifest as M


class Killed(BaseException):
    """Stands for SIGKILL: nothing in k3ckpt catches it."""


def kill_after_split(monkeypatch, k: int) -> None:
    """Raise ``Killed`` once the manifest has recorded its ``k``-th finished file."""
    real, calls = M.GGUFManifest.record, [0]

    def record(self, name, sha256):
        real(self, name, sha256)
        calls[0] += 1
        if calls[0] == k:
            raise Killed()

    monkeypatch.setattr(M.GGUFManifest, "record", record)
