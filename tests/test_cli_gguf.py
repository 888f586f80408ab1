"""`k3ckpt gguf`: the command over api.gguf."""

from __future__ import annotations

import json
import os
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


def test_splits_are_written_and_read_back(k3_tiny, tmp_path):
    p = run(k3_tiny, tmp_path / "k3.gguf", "--expert-type", "MXFP4", "--split-max-size", "2MB", "-q")
    assert p.returncode == 0, p.stderr
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == [f"k3-{i:05d}-of-{len(files):05d}.gguf" for i in range(1, len(files) + 1)]
    assert len(files) > 1 and f"first file: {files[0]}" in p.stdout
    assert sum(len(gguf.GGUFReader(f).tensors) for f in files) == 107
    again = run(k3_tiny, tmp_path / "k3.gguf", "--expert-type", "MXFP4", "--split-max-size", "2MB")
    assert again.returncode == 2 and "exists" in again.stderr


def test_bad_options_are_one_line_exit_2(k3_tiny, gpt_oss_tiny, tmp_path):
    for args, needle in [(("--expert-type", "iq9"), "--expert-type 'iq9' is not one of"),
                         (("--outtype", "q4_0"), "--outtype 'q4_0'"),
                         (("--split-max-size", "12"), "no unit")]:
        p = run(k3_tiny, tmp_path / "x.gguf", *args)
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = run(gpt_oss_tiny, tmp_path / "x.gguf")
    assert p.returncode == 2 and "k3ckpt gguf maps DeepseekV3ForCausalLM, KimiK3ForConditionalGeneration" in p.stderr
    assert list(tmp_path.iterdir()) == []
