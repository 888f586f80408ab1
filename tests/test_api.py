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


def test_requant_result_prints_a_summary_with_the_figures_people_look_for(k3_tiny, tmp_path):
    from k3ckpt.requant.metrics import pooled_snr_db

    r = api.requant(k3_tiny, tmp_path / "out", workers=1)
    text = repr(r)
    assert len(text) < 1000 and len(r.results) == 72     # the table stays behind .results
    assert r.bpw == pytest.approx(2.25) and f"{r.bpw:.4f} bpw" in text
    assert r.snr_db == pytest.approx(pooled_snr_db(x.stats for x in r.results)) and 5 < r.snr_db < 15
    assert f"SNR {r.snr_db:.2f} dB" in text
    assert r.bytes_written == sum(Path(p).stat().st_size for p in r.paths) > 0
    assert [Path(p).name for p in r.report_paths] == ["requant_report.json", "requant_report.md",
                                                      "requant_report.svg"]
    assert all(Path(p).is_file() for p in r.paths + r.report_paths)
    doc = r.to_dict()
    assert doc["snr_db"] == r.snr_db and doc["bytes_written"] == r.bytes_written
    dry = api.requant(k3_tiny, tmp_path / "dry", dry_run=True)
    assert len(repr(dry)) < 1000 and "dry run" in repr(dry) and dry.bytes_written == 0


def test_rewording_for_python_keeps_the_errors_hint():
    from k3ckpt.api import _for_python
    from k3ckpt.errors import Hint, UsageError

    @_for_python
    def fails():
        raise UsageError("--max-disk is too small", hint=Hint("overwrite", True, "to replace it"))

    with pytest.raises(UsageError) as e:
        fails()
    assert e.value.hint == Hint("overwrite", True, "to replace it")
    assert str(e.value) == "max_disk is too small; pass overwrite=True to replace it"
