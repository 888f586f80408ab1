"""hf:// URL parsing: accepted forms, refused forms with the expected form named, light import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from k3ckpt.errors import UsageError
from k3ckpt.hub import EXPECTED, HubUrl, is_hub_url, parse_hub_url

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("url, repo, rev, sub", [
    ("hf://moonshotai/Kimi-K3", "moonshotai/Kimi-K3", None, ""),
    ("hf://moonshotai/Kimi-K3/", "moonshotai/Kimi-K3", None, ""),
    ("hf://org/name@main", "org/name", "main", ""),
    (f"hf://org/name@{SHA}", "org/name", SHA, ""),
    ("hf://org/name@v1.0/bf16", "org/name", "v1.0", "bf16"),
    ("hf://org/name/a/b/c", "org/name", None, "a/b/c"),
    ("hf://org/name@release%2Fv2/sub", "org/name", "release/v2", "sub"),
    ("hf://org/name@refs/pr/12/sub", "org/name", "refs/pr/12", "sub"),
    ("hf://org/name@refs%2Fpr%2F12", "org/name", "refs/pr/12", ""),
    ("hf://Org_1/na.me-2/model.safetensors", "Org_1/na.me-2", None, "model.safetensors"),
])
def test_parse_accepts(url, repo, rev, sub):
    h = parse_hub_url(url)
    assert (h.repo_id, h.revision, h.subfolder) == (repo, rev, sub)
    assert parse_hub_url(str(h)) == h  # str() is a canonical hf:// URL
    assert is_hub_url(url)


@pytest.mark.parametrize("url, why", [
    ("org/name", "does not start"),
    ("hf://", "ORG/NAME"),
    ("hf://org", "ORG/NAME"),
    ("hf://org/", "ORG/NAME"),
    ("hf:///name", "ORG/NAME"),
    ("hf://datasets/org/name", "only model repos"),
    ("hf://spaces/org/name", "only model repos"),
    ("hf://org/na--me", "not a valid Hub name"),
    ("hf://org/na..me", "not a valid Hub name"),
    ("hf://-org/name", "not a valid Hub name"),
    ("hf://org/name./x", "not a valid Hub name"),
    ("hf://org/" + "n" * 97, "not a valid Hub name"),
    ("hf://org/name@", "empty"),
    ("hf://org/name@/sub", "empty"),
    ("hf://org@x/name", "'@'"),
    ("hf://org/name@a%20b", "not a branch"),
    ("hf://org/name@..%2Fx", "not a branch"),
    ("hf://org/name@%ff", "UTF-8"),
    ("hf://org/name/../x", "'..'"),
    ("hf://org/name/a//b", "empty"),
    ("hf://org/name/./b", "'.'"),
    ("hf://org/name/a\\b", "backslash"),
])
def test_parse_refuses_with_expected_form(url, why):
    with pytest.raises(UsageError) as ei:
        parse_hub_url(url)
    msg = str(ei.value)
    assert why in msg
    assert EXPECTED in msg and EXPECTED == "hf://ORG/NAME[@REVISION][/SUBFOLDER]"


def test_direct_construction_is_checked():
    with pytest.raises(UsageError, match="ORG/NAME"):
        HubUrl("justname")
    with pytest.raises(UsageError, match="'..'"):
        HubUrl("org/name", None, "a/../b")
    h = HubUrl("org/name", "main", "sub")
    assert h.pinned(SHA) == HubUrl("org/name", SHA, "sub")
    assert h.path_in_repo("x.safetensors") == "sub/x.safetensors"
    assert HubUrl("org/name").path_in_repo("x") == "x"
    with pytest.raises(Exception):
        h.revision = "other"  # frozen


def test_is_hub_url():
    assert not is_hub_url("checkpoints/kimi-k3")
    assert not is_hub_url("HF://org/name")
    assert not is_hub_url(None)
    assert is_hub_url("hf://broken")  # meant as one; parse_hub_url says what is wrong


def test_import_is_light():
    code = ("import sys, k3ckpt.hub; from k3ckpt.hub import parse_hub_url; parse_hub_url('hf://a/b');"
            "assert 'huggingface_hub' not in sys.modules, 'huggingface_hub imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
