"""Shared fixtures: small synthetic checkpoints built once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def k3_tiny(tmp_path_factory):
    from k3ckpt.fixtures import make_fixture

    return make_fixture("k3-tiny", tmp_path_factory.mktemp("k3-tiny") / "ckpt")


@pytest.fixture(scope="session")
def gpt_oss_tiny(tmp_path_factory):
    from k3ckpt.fixtures import make_fixture

    return make_fixture("gpt-oss-tiny", tmp_path_factory.mktemp("gpt-oss-tiny") / "ckpt")


@pytest.fixture(scope="session")
def kimi_k2_tiny(tmp_path_factory):
    from k3ckpt.fixtures import make_fixture

    return make_fixture("kimi-k2-tiny", tmp_path_factory.mktemp("kimi-k2-tiny") / "ckpt")


@pytest.fixture(scope="session")
def kimi_k2_thinking_tiny(tmp_path_factory):
    from k3ckpt.fixtures import make_fixture

    return make_fixture("kimi-k2-thinking-tiny", tmp_path_factory.mktemp("kimi-k2-thinking-tiny") / "ckpt")


@pytest.fixture(scope="session")
def virtual_k3(tmp_path_factory):
    from k3ckpt.fixtures import make_virtual_k3

    return make_virtual_k3(tmp_path_factory.mktemp("k3-virtual") / "ckpt")
