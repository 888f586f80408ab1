"""``k3ckpt requant`` and ``k3ckpt formats`` through the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from k3ckpt.cli.main import main
from k3ckpt.formats import list_formats

ROOT = Path(__file__).resolve().parents[1]


def cli(capsys, *args):
    rc = main(list(map(str, args)))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_formats_table_and_json(capsys):
    rc, out, _ = cli(capsys, "formats")
    assert rc == 0
    for info in list_formats():
        assert info.id in out
    assert "moet-w2" in out and "from mxfp4" in out
    rc, out, _ = cli(capsys, "formats", "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["id"] for r in rows] == [i.id for i in list_formats()]
    by_id = {r["id"]: r for r in rows}
    assert by_id["moet-w2"]["bits_per_weight"] == 2.25 and by_id["moet-w2"]["from_mxfp4"] is True
    assert by_id["k3ckpt-mx2"]["tensor_bytes"] == 9 and by_id["bf16"]["from_mxfp4"] is False


def test_requant_dry_run_then_run(capsys, k3_tiny, tmp_path):
    dst = tmp_path / "out"
    rc, out, _ = cli(capsys, "requant", k3_tiny, dst, "--dry-run", "--format", "k3ckpt-mx2")
    assert rc == 0 and "nothing written" in out and "k3ckpt-mx2" in out and not dst.exists()
    rc, out, err = cli(capsys, "requant", k3_tiny, dst, "--workers", "1", "--quiet")
    assert rc == 0, err
    assert "72 weight(s) requantized, 2.2500 bpw" in out and "requant_report.md" in out
    assert (dst / "requant_report.json").is_file() and (dst / "config.json").is_file()
    rc, _, err = cli(capsys, "requant", k3_tiny, dst, "--workers", "1", "--quiet")
    assert rc == 2 and "--resume" in err and "earlier k3ckpt run" in err
    rc, _, err = cli(capsys, "requant", k3_tiny, dst, "--workers", "1", "--quiet", "--resume",
                     "--format", "moet-w2:keep-scales")
    assert rc == 2 and "cannot resume: --format was moet-w2, now moet-w2:keep-scales" in err
    rc, out, _ = cli(capsys, "requant", k3_tiny, tmp_path / "j", "--workers", "1", "--json",
                     "--experts", "down", "--tensor-type", r"experts\.0\.=moet-w2:keep-scales")
    doc = json.loads(out)
    assert rc == 0 and doc["weights"] == 24 + 6 and len(doc["results"]) == 30
    assert {r["method"] for r in doc["results"]} == {"refit", "keep-scales"}


@pytest.mark.parametrize("args, kind", [
    (["--format", "nope"], "UsageError"),
    (["--format", "moet-w2:fancy"], "UsageError"),
    (["--tensor-type", "noequals"], "UsageError"),
    (["--experts", "(unclosed"], "UsageError"),
    (["--workers", "0"], "UsageError"),
    (["--target-bpw", "2.0"], "UsageError"),
])
def test_requant_usage_errors(capsys, k3_tiny, tmp_path, args, kind):
    rc, _, err = cli(capsys, "requant", k3_tiny, tmp_path / "x", *args)
    assert rc == 2 and err.count("\n") == 1 and kind not in err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("bpw", ["5", "4.3", "2.0", "nan"])
def test_target_bpw_outside_the_working_range_is_refused_with_the_range(capsys, k3_tiny, tmp_path, bpw):
    rc, out, err = cli(capsys, "requant", k3_tiny, tmp_path / "x", "--target-bpw", bpw, "--workers", "1", "-q")
    # k3-tiny's experts are MXFP4 (4.25 bpw); moet-w2 is 2.25 bpw: the allocation works in between.
    assert rc == 2 and "2.2500" in err and "4.2500" in err and not (tmp_path / "x").exists()


def test_resume_mismatch_is_one_line_naming_the_flag(capsys, k3_tiny, tmp_path):
    dst = tmp_path / "out"
    rc, _, err = cli(capsys, "requant", k3_tiny, dst, "--workers", "1", "-q", "--experts", "down")
    assert rc == 0, err
    rc, _, err = cli(capsys, "requant", k3_tiny, dst, "--workers", "1", "-q", "--experts", "down", "--resume",
                     "--format", "k3ckpt-mx2")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "--format was moet-w2, now k3ckpt-mx2" in err and "a new DST" in err
    assert "{" not in err and "max_shard_bytes" not in err
    rc, _, err = cli(capsys, "requant", k3_tiny, dst, "--workers", "1", "-q", "--resume")
    assert rc == 2 and "--experts was down, now not given" in err


def test_max_shard_size_takes_a_size_with_a_unit(capsys, k3_tiny, tmp_path):
    rc, out, err = cli(capsys, "requant", k3_tiny, tmp_path / "a", "--workers", "1", "-q", "--json",
                       "--max-shard-size", "2MB")
    assert rc == 0, err
    shards = json.loads(out)["shards"]
    # the limit counts tensor bytes (as transformers does); each header adds a few kB
    assert len(shards) >= 3 and all((tmp_path / "a" / s).stat().st_size <= 2_000_000 + 16_384 for s in shards)
    rc, _, err = cli(capsys, "requant", k3_tiny, tmp_path / "b", "--max-shard-size", "2000000")
    assert rc == 2 and "unit" in err and not (tmp_path / "b").exists()
    rc, out, _ = cli(capsys, "requant", "--help")
    assert "--max-shard-size SIZE" in out and "[default: 5GB]" in out


def _k3ckpt(*args, cache):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "k3ckpt", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


def test_dry_run_counts_compiling_kernels_when_the_cache_is_cold(k3_tiny, tmp_path):
    cold = _k3ckpt("requant", k3_tiny, tmp_path / "x", "--dry-run", "--json", cache=tmp_path / "empty")
    assert cold.returncode == 0, cold.stderr
    doc = json.loads(cold.stdout)
    assert doc["compile_seconds"] == 10.0 and doc["estimated_seconds"] > 10.0
    text = _k3ckpt("requant", k3_tiny, tmp_path / "x", "--dry-run", "--format", "IQ2_XS", cache=tmp_path / "empty")
    assert "estimated about 3" in text.stdout and "compiling kernels, first run only" in text.stdout
    assert not (tmp_path / "x").exists()


def test_dry_run_estimate_uses_the_measured_rates(k3_tiny):
    from k3ckpt.io.reader import open_checkpoint
    from k3ckpt.requant.plan import plan_requant

    with open_checkpoint(k3_tiny) as ckpt:
        iq2 = plan_requant(ckpt, format="gguf-iq2_xs")
        w2 = plan_requant(ckpt, format="moet-w2")
    io = (iq2.in_bytes + iq2.total_bytes) / 500e6
    # docs/BENCHMARKS.md: IQ2_XS 9.0-11.6 Mw/s a core, moet-w2 refit+report 847-997 Mw/s
    assert iq2.estimated_seconds(2) == pytest.approx(1.0 + iq2.params / 9e6 / 2 + io)
    assert w2.estimated_seconds(1) == pytest.approx(1.0 + w2.params / 800e6 + (w2.in_bytes + w2.total_bytes) / 500e6)


@pytest.mark.slow
def test_first_run_says_it_compiles_kernels_and_the_second_does_not(k3_tiny, tmp_path):
    cache = tmp_path / "cache"
    args = ("requant", k3_tiny, None, "--workers", "1", "--experts", r"layers\.1\..*experts\.0\.w1")
    first = _k3ckpt(*[tmp_path / "a" if a is None else a for a in args], cache=cache)
    assert first.returncode == 0, first.stderr
    assert "compiling kernels (first run only, about 10.0 s)" in first.stderr
    second = _k3ckpt(*[tmp_path / "b" if a is None else a for a in args], cache=cache)
    assert second.returncode == 0 and "compiling" not in second.stderr
    quiet = _k3ckpt(*[tmp_path / "c" if a is None else a for a in args], "-q", cache=tmp_path / "cache2")
    assert quiet.returncode == 0 and "compiling" not in quiet.stderr


def test_resume_after_kill(k3_tiny, tmp_path):
    """A process killed (SIGKILL) mid-run leaves hidden temporaries; --resume gives the same bytes."""
    code = (
        "import os, signal, sys\n"
        "from k3ckpt.io.reader import open_checkpoint\n"
        "from k3ckpt.requant.pipeline import requant_checkpoint\n"
        "n = []\n"
        "def hook(r):\n"
        "    n.append(r)\n"
        "    if len(n) == 50: os.kill(os.getpid(), signal.SIGKILL)\n"
        "with open_checkpoint(sys.argv[1]) as c:\n"
        "    requant_checkpoint(c, sys.argv[2], workers=1, progress=False, max_shard_bytes=1_500_000, on_result=hook)\n"
    )
    dst = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code, str(k3_tiny), str(dst)], env=env, cwd=ROOT)
    assert p.returncode == -signal.SIGKILL
    assert not (dst / "config.json").exists() and list(dst.glob(".*.partial"))   # the kill left temporaries
    from k3ckpt.io.reader import open_checkpoint
    from k3ckpt.requant.pipeline import requant_checkpoint

    with open_checkpoint(k3_tiny) as c:
        requant_checkpoint(c, dst, workers=1, progress=False, max_shard_bytes=1_500_000, resume=True)
        requant_checkpoint(c, tmp_path / "clean", workers=1, progress=False, max_shard_bytes=1_500_000)
    assert not list(dst.rglob(".*.partial"))
    assert sorted(p.name for p in dst.glob(".*")) == [".k3ckpt-results"]   # kept: a later --resume reads it

    def files(d):
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*")
                if p.is_file() and p.name != "k3ckpt-manifest.json"}

    assert files(dst) == files(tmp_path / "clean")


@pytest.mark.parametrize("name", ["requant", "report"])
def test_every_option_has_help_and_the_help_has_examples(capsys, name):
    import importlib

    import click

    cmd = importlib.import_module(f"k3ckpt.cli.{name}").command
    bare = [p.opts for p in cmd.params if isinstance(p, click.Option) and not p.help]
    assert bare == []
    rc, out, _ = cli(capsys, name, "--help")
    assert rc == 0 and "Examples:" in out and f"k3ckpt {name} " in out.split("Examples:")[1]
