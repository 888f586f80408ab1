"""`k3ckpt verify OUT.gguf`: a GGUF output against its manifest and the gguf package's reader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3ckpt import api
from k3ckpt.errors import NotFoundError
from k3ckpt.gguf.convert import write_gguf
from k3ckpt.io.reader import open_checkpoint

ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def written(k3_tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("verify")
    with open_checkpoint(k3_tiny) as c:
        r = write_gguf(c, folder / "k3.gguf", expert_type="mxfp4", split_max_bytes=2_000_000)
    return r


@pytest.fixture
def out(written, tmp_path):
    """A fresh copy of the output to damage."""
    for p in [*written.paths, written.manifest]:
        shutil.copy(p, tmp_path / p.name)
    return [tmp_path / p.name for p in written.paths]


def verify_cli(target, *more):
    return subprocess.run([sys.executable, "-m", "k3ckpt", "verify", str(target), *map(str, more)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)


def test_a_fresh_output_passes_from_any_of_its_names(out, k3_tiny):
    n = len(out)
    assert n > 1
    for name in (out[0], out[-1], out[0].with_name("k3.gguf")):    # a split, or OUT as given to gguf
        r = api.verify(name)
        assert r.ok and r.files_checked == n and r.tensors_checked == 107, r.problems
        assert r.bytes_checked == sum(p.stat().st_size for p in out)
    r = api.verify(out[1], source=k3_tiny)
    assert r.ok and r.source_checked
    p = verify_cli(out[0], "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["ok"] is True


def test_a_flipped_byte_fails_with_one_clear_line(out):
    data = bytearray(out[1].read_bytes())
    data[-1000] ^= 0x01                                    # tensor data: the reader still opens it
    out[1].write_bytes(bytes(data))
    r = api.verify(out[0])
    assert r.problems == (f"{out[1].name}: sha256 differs from the manifest",)
    p = verify_cli(out[0])
    assert p.returncode == 1 and p.stdout.startswith("FAILED")
    last = p.stderr.strip().splitlines()[-1]
    assert last.endswith(f"1 problem: {out[1].name}: sha256 differs from the manifest")


def test_a_damaged_header_and_a_deleted_split(out):
    data = bytearray(out[2].read_bytes())
    data[0:4] = b"FUGG"                                     # not GGUF any more
    out[2].write_bytes(bytes(data))
    out[-1].unlink()
    problems = api.verify(out[0]).problems
    assert problems[0] == f"{out[2].name}: sha256 differs from the manifest"
    assert problems[1].startswith(f"{out[2].name}: the gguf package's reader cannot open it")
    assert problems[2] == f"{out[-1].name}: missing" and len(problems) == 3
    p = verify_cli(out[1])
    assert p.returncode == 1 and "3 problems" in p.stderr


def test_a_tensor_the_plan_does_not_have_is_found(out):
    """A manifest planning another tensor than the file holds (the reader's view, not ours)."""
    m = out[0].with_name("k3.k3ckpt-manifest.json")
    d = json.loads(m.read_text())
    first = next(iter(d["splits"]))
    d["splits"][first][0][0] = "token_embd.nope"
    m.write_text(json.dumps(d))
    assert api.verify(out[0]).problems == (f"{first}: 1 planned tensor(s) not found, e.g. token_embd.nope",)


def test_another_source_and_no_manifest(out, kimi_k2_tiny, tmp_path):
    r = api.verify(out[0], source=kimi_k2_tiny)
    assert not r.ok and r.problems[0].startswith("the source is not the checkpoint the run read: shard")
    out[0].with_name("k3.k3ckpt-manifest.json").unlink()
    with pytest.raises(NotFoundError, match="no k3ckpt GGUF manifest"):
        api.verify(out[0])
    p = verify_cli(out[0])
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1


def test_an_unfinished_run_is_reported(k3_tiny, tmp_path, monkeypatch):
    from k3ckpt.gguf import manifest as M

    real = M.GGUFManifest.record

    def record(self, name, sha256):
        real(self, name, sha256)
        raise KeyboardInterrupt

    monkeypatch.setattr(M.GGUFManifest, "record", record)
    with open_checkpoint(k3_tiny) as c, pytest.raises(KeyboardInterrupt):
        write_gguf(c, tmp_path / "k3.gguf", split_max_bytes=2_000_000)
    problems = api.verify(tmp_path / "k3.gguf").problems
    assert problems[0].startswith("the run is not complete (state 'running')")
    assert problems[1:] == tuple(f"k3-0000{i}-of-00004.gguf: missing" for i in (2, 3, 4))
