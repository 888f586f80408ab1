"""``k3ckpt.api`` as Python users call it: scripts, parameters, errors, results."""

from __future__ import annotations

import inspect as pyinspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3ckpt import api
from k3ckpt.errors import NotFoundError, OutputExistsError

ROOT = Path(__file__).resolve().parents[1]

# No ``if __name__ == "__main__":`` guard on purpose: pool workers must not re-run it.
SCRIPT = """\
import json, sys
from k3ckpt import api
r = api.requant(sys.argv[1], sys.argv[2], workers=2)
print(json.dumps({"weights": len(r.results), "shards": list(r.shards)}))
"""


def _run(args, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, **kw)


def test_requant_pool_from_a_script_without_main_guard(k3_tiny, tmp_path):
    script = tmp_path / "convert.py"
    script.write_text(SCRIPT)
    proc = _run([str(script), str(k3_tiny), str(tmp_path / "out")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["weights"] == 72
    assert (tmp_path / "out" / "requant_report.json").is_file()


def test_requant_pool_from_stdin(k3_tiny, tmp_path):
    proc = _run(["-", str(k3_tiny), str(tmp_path / "out")], input=SCRIPT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["weights"] == 72


def test_errors_name_python_arguments_not_flags(k3_tiny, tmp_path):
    dst = tmp_path / "out"
    api.requant(k3_tiny, dst, workers=1, experts="down")
    with pytest.raises(OutputExistsError) as e:
        api.requant(k3_tiny, dst, workers=1, experts="down")
    assert "resume=True" in str(e.value) and "--resume" not in str(e.value)
