"""`k3ckpt gguf --resume` and `--workers`: an interrupted run continues split by split to the same
bytes, kill -9 never leaves a partial file under a final name, and any worker count writes the
same files."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3ckpt.errors import OutputExistsError, ResumeMismatchError
from k3ckpt.gguf.convert import write_gguf
from k3ckpt.io.reader import open_checkpoint
from split_kill import Killed, kill_after_split

ROOT = str(Path(__file__).resolve().parents[1])
SPLIT = 2_000_000          # k3-tiny at IQ2_XS in 4 files


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def clean(k3_tiny, tmp_path_factory):
    """The reference: an uninterrupted run, in process."""
    out = tmp_path_factory.mktemp("clean") / "k3.gguf"
    with open_checkpoint(k3_tiny) as c:
        r = write_gguf(c, out, split_max_bytes=SPLIT)
    assert len(r.paths) == 4
    return {p.name: sha(p) for p in r.paths}


def finals(folder: Path) -> dict[str, str]:
    return {p.name: sha(p) for p in folder.iterdir() if p.name.endswith(".gguf") and not p.name.startswith(".")}


@pytest.mark.parametrize("k,workers", [(1, 1), (2, 2), (3, 1)])
def test_resume_after_split_k_gives_the_same_bytes(k3_tiny, clean, tmp_path, monkeypatch, k, workers):
    out = tmp_path / "k3.gguf"
    with monkeypatch.context() as mp:
        kill_after_split(mp, k)
        with open_checkpoint(k3_tiny) as c, pytest.raises(Killed):
            write_gguf(c, out, split_max_bytes=SPLIT, workers=workers)
    names = sorted(clean)
    assert finals(tmp_path) == {n: clean[n] for n in names[:k]}      # the first k, complete; nothing else
    assert not list(tmp_path.glob(".*.partial"))                     # the partial one was removed
    m = json.loads((tmp_path / "k3.k3ckpt-manifest.json").read_text())
    assert m["state"] == "running" and sorted(m["files"]) == names[:k]
    with open_checkpoint(k3_tiny) as c:
        with pytest.raises(OutputExistsError, match="--resume"):
            write_gguf(c, out, split_max_bytes=SPLIT)
        r = write_gguf(c, out, split_max_bytes=SPLIT, resume=True, workers=workers)
    assert r.resumed == tuple(names[:k])
    assert finals(tmp_path) == clean
    m = json.loads((tmp_path / "k3.k3ckpt-manifest.json").read_text())
    assert m["state"] == "complete" and {n: f["sha256"] for n, f in m["files"].items()} == clean


def test_resume_refuses_other_options_or_source(k3_tiny, clean, tmp_path, monkeypatch):
    out = tmp_path / "k3.gguf"
    with monkeypatch.context() as mp:
        kill_after_split(mp, 1)
        with open_checkpoint(k3_tiny) as c, pytest.raises(Killed):
            write_gguf(c, out, split_max_bytes=SPLIT)
    from k3ckpt.gguf import convert

    with monkeypatch.context() as mp, open_checkpoint(k3_tiny) as c:
        mp.setattr(convert, "plan_gguf_types", lambda *a, **k: pytest.fail("planned before refusing"))  # refused first
        with pytest.raises(ResumeMismatchError) as e:
            write_gguf(c, out, split_max_bytes=SPLIT, expert_type="q8_0", resume=True)
        assert "--expert-type was iq2_xs, now q8_0" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ResumeMismatchError, match="--split-max-size was 2000000, now 3000000"):
            write_gguf(c, out, split_max_bytes=3_000_000, resume=True)
        with pytest.raises(OutputExistsError, match="pass --resume"):
            write_gguf(c, out, split_max_bytes=SPLIT)
    m = json.loads((tmp_path / "k3.k3ckpt-manifest.json").read_text())
    m["source"]["shards"]["model-00002-of-000007.safetensors"] += 1
    (tmp_path / "k3.k3ckpt-manifest.json").write_text(json.dumps(m))
    with open_checkpoint(k3_tiny) as c, pytest.raises(ResumeMismatchError, match="shard model-00002-of-000007"):
        write_gguf(c, out, split_max_bytes=SPLIT, resume=True)
    assert finals(tmp_path) == {sorted(clean)[0]: clean[sorted(clean)[0]]}       # nothing touched


def test_resume_without_a_manifest(k3_tiny, clean, tmp_path):
    out = tmp_path / "k3.gguf"
    with open_checkpoint(k3_tiny) as c:
        r = write_gguf(c, out, split_max_bytes=SPLIT, resume=True)      # nothing there yet: a fresh run
        assert r.resumed == () and finals(tmp_path) == clean
        (tmp_path / "k3.k3ckpt-manifest.json").unlink()
        with pytest.raises(ResumeMismatchError, match="no k3ckpt manifest"):
            write_gguf(c, out, split_max_bytes=SPLIT, resume=True)


# A k3ckpt CLI whose tensors come slowly (a short sleep after each piece), so a test can kill it
# mid-write at a point it chooses; the bytes are the ordinary ones.
SLOW_CLI = """
import sys, time
from k3ckpt.gguf import produce
real = produce.tensor_pieces
def slow(ckpt, p):
    for piece in real(ckpt, p):
        time.sleep(0.02)
        yield piece
produce.tensor_pieces = slow
from k3ckpt.cli.main import main
sys.exit(main())
"""


def _cli(*args, slow=False):
    env = {**os.environ, "PYTHONPATH": ROOT}
    head = ["-c", SLOW_CLI] if slow else ["-m", "k3ckpt"]
    return [sys.executable, *head, "gguf", *map(str, args)], env


@pytest.mark.parametrize("wait_for", [0, 2])
def test_kill_9_mid_write_then_resume(k3_tiny, clean, tmp_path, wait_for):
    """SIGKILL while split ``wait_for`` is being written: every file under a final name is complete,
    and --resume finishes the same bytes."""
    names = sorted(clean)
    args = (k3_tiny, tmp_path / "k3.gguf", "--split-max-size", "2MB", "--workers", "1", "-q")
    cmd, env = _cli(*args, slow=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    partial = tmp_path / f".{names[wait_for]}.partial"
    deadline = time.monotonic() + 300
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()         # killed mid-run, not after it
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    left = finals(tmp_path)
    assert set(left) <= set(names[:wait_for + 1]) and set(names[:wait_for]) <= set(left)
    assert all(left[n] == clean[n] for n in left)           # nothing partial under a final name
    m = json.loads((tmp_path / "k3.k3ckpt-manifest.json").read_text())
    assert all(m["files"][n]["sha256"] == clean[n] for n in m["files"])
    cmd, env = _cli(*args, "--resume")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert finals(tmp_path) == clean and not list(tmp_path.glob(".*.partial"))


def test_any_worker_count_writes_the_same_files(k3_tiny, kimi_k2_tiny, clean, tmp_path):
    with open_checkpoint(k3_tiny) as c:
        r = write_gguf(c, tmp_path / "k3.gguf", split_max_bytes=SPLIT, workers=2)
    assert r.workers == 2 and finals(tmp_path) == clean
    for t in ("bf16", "q8_0"):             # block-FP8 experts decoded in the workers
        one, two = tmp_path / f"one-{t}", tmp_path / f"two-{t}"
        with open_checkpoint(kimi_k2_tiny) as c:
            write_gguf(c, one / "k2.gguf", expert_type=t, workers=1)
            write_gguf(c, two / "k2.gguf", expert_type=t, workers=3)
        assert sha(one / "k2.gguf") == sha(two / "k2.gguf")


def test_the_pool_works_ahead_within_runs_of_expert_tensors_only(k3_tiny, tmp_path, monkeypatch):
    """Tasks go out within consecutive expert tensors, at most 2 x workers experts at a time."""
    from k3ckpt.gguf import pool
    from k3ckpt.gguf.convert import plan_gguf

    runs, live, most = [], [0], [0]
    real_run, real_executor = pool.ExpertRunner.run, pool.ExpertRunner._executor

    class Counting:
        def __init__(self, ex):
            self.ex = ex

        def submit(self, *a):
            live[0] += 1
            most[0] = max(most[0], live[0])
            return self.ex.submit(*a)

    def executor(self):
        return Counting(real_executor(self))

    def run(self, tensors):
        runs.append([p.info.name for p in tensors])
        for item in real_run(self, tensors):
            live[0] -= 1
            yield item

    monkeypatch.setattr(pool.ExpertRunner, "_executor", executor)
    monkeypatch.setattr(pool.ExpertRunner, "run", run)
    with open_checkpoint(k3_tiny) as c:
        write_gguf(c, tmp_path / "k3.gguf", workers=2)
        _, planned, _ = plan_gguf(c)
    want, prev = [], -2
    for i, p in enumerate(planned):
        if p.recipe.kind == "experts":
            if i != prev + 1:
                want.append([])
            want[-1].append(p.info.name)
            prev = i
    assert runs == want and len(want) == 3 and all(len(r) == 3 for r in want)   # 3 MoE layers
    assert most[0] == 4 and live[0] == 0                    # 2 x workers ahead, all drained


@pytest.mark.parametrize("order", ["file", "reversed"])
def test_the_writer_hashes_each_split_as_it_is_written(tmp_path, order):
    """The sha256 the manifest records is the file's, whether pieces came in file order (hashed on
    the way) or not (hashed from the file at the end)."""
    import numpy as np

    from k3ckpt.gguf import container as C
    from k3ckpt.gguf.writer import GGUFWriter

    rng = np.random.default_rng(7)
    infos = [C.TensorInfo(f"t{i}", 0, (n,)) for i, n in enumerate([5, 64, 3, 200, 9])]     # F32, odd padding
    data = {t.name: rng.integers(0, 256, t.nbytes, dtype=np.uint8).tobytes() for t in infos}
    kvs = [C.KV("general.architecture", C.STRING, "x")]
    with GGUFWriter(tmp_path / "m.gguf", kvs, infos, split_max_bytes=400) as w:
        for t in (infos if order == "file" else infos[::-1]):
            for at in range(0, t.nbytes, 7):                   # pieces cutting values
                w.write(t.name, data[t.name][at:at + 7])
    assert len(w.paths) > 1 and w.sha256 == {p.name: sha(p) for p in w.paths}


def test_a_cold_encoder_is_compiled_once_by_the_parent(k3_tiny, tmp_path, monkeypatch):
    """With numba's cache lacking the IQ2_XS kernel the parent compiles it on one row before the pool
    starts, rather than every worker at once; with a warm cache (or one worker) nothing extra runs."""
    from k3ckpt.gguf import run

    calls, real = [], run._timed
    monkeypatch.setattr(run, "_timed", lambda c, p, n: calls.append((p.info.name, n)) or real(c, p, n))
    for cold, workers, want in [(True, 2, 1), (False, 2, 0), (True, 1, 0)]:
        monkeypatch.setattr(run, "_iq2xs_cold", lambda: cold)
        calls.clear()
        with open_checkpoint(k3_tiny) as c:
            write_gguf(c, tmp_path / f"{cold}-{workers}" / "k3.gguf", workers=workers)
        assert [n for _, n in calls] == [1] * want
        assert all(name.endswith("_exps.weight") for name, _ in calls)
