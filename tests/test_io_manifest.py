"""RunManifest and ShardedWriter resume: a resumed run ends byte-identical to an uninterrupted one."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from k3ckpt.errors import OutputExistsError, ResumeMismatchError, UsageError
from k3ckpt.io.manifest import MANIFEST_NAME, RunManifest, sha256_file
from k3ckpt.io.writer import ShardedWriter, TensorSpec

SPECS = [TensorSpec(f"t{i}", "F32", (64,)) for i in range(6)]   # 256 B each -> 3 shards of 2 at 600 B


def _data(i: int) -> np.ndarray:
    return np.arange(64, dtype=np.float32) * (i + 1)


def _run(dst, *, resume=False, stop_after=None, options=None):
    m = RunManifest.begin(dst, job="test", options=options or {"fmt": "x"}, source={"id": "s"}, resume=resume)
    done = [n for n in m.records if m.done(n)]
    w = ShardedWriter(dst, SPECS, max_shard_bytes=600, done_shards=done, overwrite=resume,
                      on_shard_final=lambda p: m.record(p.name))
    written = 0
    for i, s in enumerate(SPECS):
        if not w.needs(s.name):
            continue
        if stop_after is not None and written == stop_after:
            w.abort()   # what a kill leaves: final shards so far, no temporaries under final names
            return m, written
        w.write(s.name, _data(i))
        written += 1
    w.close()
    m.finish(tensors=len(SPECS))
    return m, written


def _tree(root):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())
            if p.name != MANIFEST_NAME}


def test_resume_is_byte_identical_and_skips_final_shards(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    _run(whole)
    m, n = _run(part, stop_after=3)
    assert n == 3 and sorted(m.records) == ["model-00001-of-00003.safetensors"]
    assert not any(p.name.startswith("model.safetensors.index") for p in part.iterdir())
    m2, n2 = _run(part, resume=True)
    assert n2 == 4                                  # shard 1's two tensors were not rewritten
    assert _tree(part) == _tree(whole)
    assert m2.state == "complete" and len(m2.records) == 3
    for name, rec in m2.records.items():
        assert rec.sha256 == sha256_file(part / name) and m2.verify(name)


def test_non_empty_folder_needs_resume_and_same_options(tmp_path):
    dst = tmp_path / "out"
    _run(dst, stop_after=2)
    with pytest.raises(OutputExistsError, match="--resume"):
        _run(dst)
    with pytest.raises(ResumeMismatchError, match="fmt"):
        _run(dst, resume=True, options={"fmt": "y"})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("not ours")
    with pytest.raises(OutputExistsError, match="not a k3ckpt output"):
        _run(tmp_path / "other")
    with pytest.raises(ResumeMismatchError, match="no k3ckpt manifest"):
        _run(tmp_path / "other", resume=True)


def test_changed_final_shard_is_refused(tmp_path):
    dst = tmp_path / "out"
    m, _ = _run(dst, stop_after=3)
    shard = dst / "model-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF                              # inside the header
    shard.write_bytes(bytes(data))
    with pytest.raises(ResumeMismatchError, match="does not match"):
        _run(dst, resume=True)
    assert not m.verify(shard.name)


def test_truncated_final_shard_is_redone(tmp_path):
    whole, dst = tmp_path / "whole", tmp_path / "out"
    _run(whole)
    _run(dst, stop_after=3)
    shard = dst / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])      # size no longer matches: not done
    _run(dst, resume=True, stop_after=None)
    assert _tree(dst) == _tree(whole)


def test_manifest_put_get_and_stray_temporaries(tmp_path):
    dst = tmp_path / "out"
    m = RunManifest.begin(dst, job="j", options={"a": (1, 2)}, source={}, resume=False)
    m.put("results", [{"name": "x", "snr": 9.5}])
    (dst / ".model-00001-of-00002.safetensors.partial").write_bytes(b"junk")
    m2 = RunManifest.begin(dst, job="j", options={"a": [1, 2]}, source={}, resume=True)  # tuple == list once stored
    assert m2.get("results") == [{"name": "x", "snr": 9.5}]
    assert not list(dst.glob(".*.partial"))
    assert json.loads((dst / MANIFEST_NAME).read_text())["state"] == "running"
    with pytest.raises(UsageError):
        m2.record("absent.bin")


def test_writing_a_resumed_tensor_is_refused(tmp_path):
    dst = tmp_path / "out"
    m, _ = _run(dst, stop_after=3)
    w = ShardedWriter(dst, SPECS, max_shard_bytes=600, done_shards=list(m.records))
    assert not w.needs("t0") and w.needs("t2")
    with pytest.raises(UsageError, match="already"):
        w.write("t0", _data(0))
    w.abort()
