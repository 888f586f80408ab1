"""pytest fixtures for hub tests; import them into a test module:
``from hubemu.fixtures import hub, hub_env  # noqa: F401``.

``hub_env`` isolates huggingface_hub: a fresh ``HF_HOME``, no token, xet,
telemetry, update checks and progress bars off, offline mode off -- both in
``os.environ`` (for subprocesses) and in ``huggingface_hub.constants`` (read
at import, so patching the environment alone would not reach this process).
It also refuses any connection to a host other than loopback, so a test that
would reach the real Hub fails instead.
"""

from __future__ import annotations

import socket

import pytest

from .server import HubEmulator

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
ENV_OFF = {
    "HF_HUB_DISABLE_XET": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def _guard(real):
    def guarded(host, *args, **kwargs):
        h = host[0] if isinstance(host, tuple) else host
        if isinstance(h, bytes):
            h = h.decode()
        if h is not None and h not in _LOOPBACK:
            raise OSError(f"hub tests may only connect to 127.0.0.1, not {h!r}")
        return real(host, *args, **kwargs)
    return guarded


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    home.mkdir()
    for k, v in ENV_OFF.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
              "HF_TOKEN_PATH", "HF_XET_CACHE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_XET_CACHE", str(home / "xet"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(socket, "getaddrinfo", _guard(socket.getaddrinfo))
    monkeypatch.setattr(socket, "create_connection", _guard(socket.create_connection))
    return home


@pytest.fixture
def hub(hub_env):
    """A started loopback Hub emulator (stopped after the test)."""
    with HubEmulator() as emu:
        yield emu
