"""Loopback Hugging Face Hub emulator for tests (stdlib only; never leaves 127.0.0.1)."""

from .repos import FileEntry, Repo, Revision, fake_commit
from .server import Fault, HubEmulator, Req

__all__ = ["Fault", "FileEntry", "HubEmulator", "Repo", "Req", "Revision", "fake_commit"]
