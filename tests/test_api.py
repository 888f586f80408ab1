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


def test_shard_takes_the_cli_order_and_a_typed_missing_plan(k3_tiny, tmp_path):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(api.plan(k3_tiny, "2xH100").to_json())
    r = api.shard(k3_tiny, tmp_path / "out", plan=plan_path)   # k3ckpt shard SRC DST --plan PLAN
    assert r.dst == str(tmp_path / "out") and len(r.ranks) == 2
    assert (tmp_path / "out" / "rank-00000").is_dir()
    with pytest.raises(NotFoundError) as e:
        api.shard(k3_tiny, tmp_path / "out2", plan=tmp_path / "nope.json")
    assert "nope.json" in str(e.value) and not (tmp_path / "out2").exists()


LONG = ("inspect", "make_fixture", "dequant", "requant", "shard")


@pytest.mark.parametrize("name", ["open_source", "inspect", "make_fixture", "dequant", "requant", "plan", "shard",
                                  "verify"])
def test_every_parameter_is_spelled_out(name):
    fn = getattr(api, name)
    params = pyinspect.signature(fn).parameters.values()
    assert not [p.name for p in params if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    doc = pyinspect.getdoc(fn)
    assert doc
    if name in LONG:   # one progress rule: a progress= parameter, off for the API
        assert pyinspect.signature(fn).parameters["progress"].default is False


def test_requant_draws_no_bar_unless_asked(k3_tiny, tmp_path, capfd):
    api.requant(k3_tiny, tmp_path / "a", workers=1, experts="down")
    assert "requant" not in capfd.readouterr().err
    api.requant(k3_tiny, tmp_path / "b", workers=1, experts="down", progress=True)
    assert "requant:" in capfd.readouterr().err
