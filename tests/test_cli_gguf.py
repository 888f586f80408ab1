"""`k3ckpt gguf`: the command over api.gguf."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf

ROOT = str(Path(__file__).resolve().parents[1])
ENV = {**os.environ, "PYTHONPATH": ROOT}


def run(*args):
    return subprocess.run([sys.executable, "-m", "k3ckpt", "gguf", *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=600)


def test_dry_run_writes_nothing_and_says_what_it_would(k3_tiny, tmp_path):
    p = run(k3_tiny, tmp_path / "k3.gguf", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["dry_run"] and d["tensors"] == 107 and d["paths"] == [str(tmp_path / "k3.gguf")]
    assert d["bytes_by_type"]["IQ2_XS"] == 9 * 8 * 256 * 74        # 9 expert tensors x 8 experts x 256 rows
    assert d["free_bytes"] > 0 and list(tmp_path.iterdir()) == []
    est = d["estimate"]                                            # every expert weight, at a rate > 0
    assert [(r["type"], r["weights"]) for r in est["encode"]] == [("IQ2_XS", 9 * 8 * 256 * 256)]
    assert d["estimated_seconds"] == est["seconds"] > 0
    assert est["copy_bytes"] == sum(d["bytes_by_type"].values()) - 9 * 8 * 256 * 74
    text = run(k3_tiny, tmp_path / "k3.gguf", "--dry-run", "--workers", "3")
    assert text.returncode == 0 and "estimated about" in text.stdout and "with 3 worker(s)" in text.stdout


def test_splits_are_written_and_read_back(k3_tiny, tmp_path):
    p = run(k3_tiny, tmp_path / "k3.gguf", "--expert-type", "MXFP4", "--split-max-size", "2MB", "-q")
    assert p.returncode == 0, p.stderr
    files = sorted(f for f in tmp_path.iterdir() if f.suffix == ".gguf")
    assert [f.name for f in files] == [f"k3-{i:05d}-of-{len(files):05d}.gguf" for i in range(1, len(files) + 1)]
    assert sorted(f.name for f in tmp_path.iterdir() if f not in files) == \
        ["k3-report", "k3.k3ckpt-manifest.json", "k3.k3ckpt-results"]
    assert "routed experts: SNR inf dB against the source" in p.stdout      # a lossless repack
    assert len(files) > 1 and f"first file: {files[0]}" in p.stdout
    assert sum(len(gguf.GGUFReader(f).tensors) for f in files) == 107
    again = run(k3_tiny, tmp_path / "k3.gguf", "--expert-type", "MXFP4", "--split-max-size", "2MB")
    assert again.returncode == 2 and "exists" in again.stderr and "--resume" in again.stderr
    done = run(k3_tiny, tmp_path / "k3.gguf", "--expert-type", "MXFP4", "--split-max-size", "2MB", "--resume")
    assert done.returncode == 0 and f"{len(files)} kept from an earlier run" in done.stdout, done.stderr
    other = run(k3_tiny, tmp_path / "k3.gguf", "--expert-type", "iq2_xs", "--split-max-size", "2MB", "--resume")
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1
    assert "cannot resume: --expert-type was mxfp4, now iq2_xs" in other.stderr
    ok = subprocess.run([sys.executable, "-m", "k3ckpt", "verify", files[-1]], capture_output=True, text=True,
                        env=ENV, timeout=600)
    assert ok.returncode == 0 and ok.stdout.startswith(f"ok: {files[-1]}: {len(files)} file(s)"), ok.stderr


def test_bad_options_are_one_line_exit_2(k3_tiny, tmp_path):
    for args, needle in [(("--expert-type", "iq9"), "--expert-type 'iq9' is not one of"),
                         (("--outtype", "q4_0"), "--outtype 'q4_0'"),
                         (("--split-max-size", "12"), "no unit")]:
        p = run(k3_tiny, tmp_path / "x.gguf", *args)
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    for args, needle in [(("--max-disk", "1GB"), "--max-disk: only for an hf:// source"),
                         (("--keep-source",), "--keep-source: only for an hf:// source"),
                         (("--workers", "0"), "--workers must be at least 1"),
                         (("--revision", "main"), "--revision main picks a Hub revision")]:
        p = run(k3_tiny, tmp_path / "x.gguf", *args)
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    other = tmp_path / "other"                   # an architecture no GGUF layout maps
    shutil.copytree(k3_tiny, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["NopeForCausalLM"]}))
    p = run(other, tmp_path / "x.gguf")
    assert p.returncode == 2 and "k3ckpt gguf maps " in p.stderr and "['NopeForCausalLM']" in p.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["other"]
