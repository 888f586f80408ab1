"""``requant_checkpoint`` end to end on the tiny K3 and gpt-oss fixtures."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from k3ckpt.errors import (InvalidFileError, NaNScaleError, OutputExistsError, ResumeMismatchError, ShapeError,
                           UsageError)
from k3ckpt.formats import get_format
from k3ckpt.io.header import read_header
from k3ckpt.io.reader import open_checkpoint
from k3ckpt.io.writer import save_file
from k3ckpt.requant.metrics import error_stats
from k3ckpt.requant.pipeline import requant_checkpoint
from k3ckpt.checkpoint.qconfig import declared_groups, targets_for
from k3ckpt.requant.results import TensorResult
from k3ckpt.requant.worker import requant_weight

SHARD = 1_500_000   # small shards, so a K3-tiny output has several (resume needs more than one)
SIDE_FILES = ("generation_config.json", "tiktoken.model", "tokenizer_config.json")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run(src, dst, **kw):
    kw.setdefault("workers", 1)
    kw.setdefault("progress", False)
    kw.setdefault("max_shard_bytes", SHARD)
    with open_checkpoint(src) as ckpt:
        return requant_checkpoint(ckpt, dst, **kw)


def folder_bytes(path: Path, *, skip=("k3ckpt-manifest.json",)) -> dict[str, str]:
    return {p.name: sha(p.read_bytes()) for p in sorted(path.iterdir()) if p.is_file() and p.name not in skip}


def outputs_of(ckpt, w) -> dict[str, np.ndarray]:
    return {role: ckpt.read_raw(name) for role, name in w.outputs}


def source_mxfp4(src_ckpt, w):
    from k3ckpt.requant.worker import read_source

    return read_source(src_ckpt, w)


@pytest.fixture(scope="module")
def k3_refit(k3_tiny, tmp_path_factory):
    dst = tmp_path_factory.mktemp("rq") / "refit"
    return run(k3_tiny, dst), dst


def test_refit_copies_and_decodes_to_the_report(k3_tiny, k3_refit):
    result, dst = k3_refit
    assert len(result.results) == 72 and len(result.shards) > 2 and result.bits_per_weight == 2.25
    assert [r.name for r in result.results] == [w.name for w in result.plan.weights]
    with open_checkpoint(k3_tiny) as src, open_checkpoint(dst) as out:
        # every tensor that is not a requantized weight is byte-identical
        assert result.copied == len(result.plan.copies) > 100
        for name in result.plan.copies:
            assert sha(out.read_bytes(name)) == sha(src.read_bytes(name)), name
        consumed = {t for w in result.plan.weights for t in (w.packed, w.scale)}
        assert set(src.tensors) == set(result.plan.copies) | consumed
        mx = get_format("mxfp4-pack-quantized")
        fmt = get_format("moet-w2")
        for w, r in zip(result.plan.weights, result.results):
            parts = outputs_of(out, w)
            packed, scale = source_mxfp4(src, w)
            ref = mx.decode({"packed": packed, "scale": scale})
            got = fmt.decode(parts)
            stats = error_stats(ref, got)
            assert stats == r.stats, w.name
            assert r.bytes == sum(a.nbytes for a in parts.values()) == w.out_bytes
            assert r.params == ref.size and r.format == "moet-w2" and r.method == "refit"
            assert r.scale_changes == int(np.count_nonzero(parts["scale"] != scale))
            assert sum(r.code_histogram) == r.params
            # the refit is the encoder's own output
            again = fmt.from_mxfp4(packed, scale, method="refit")
            assert all(np.array_equal(again[k], parts[k]) for k in parts)
            assert 7.0 < r.stats.snr_db < 11.0 and abs(r.stats.bias_rel_rms) < 0.02
    for name in SIDE_FILES:
        assert (dst / name).read_bytes() == (Path(k3_tiny) / name).read_bytes()


def test_config_states_the_new_format(k3_tiny, k3_refit):
    result, dst = k3_refit
    config = json.loads((dst / "config.json").read_text())
    source = json.loads((Path(k3_tiny) / "config.json").read_text())
    qc = config["text_config"]["quantization_config"]
    assert qc["quant_method"] == "k3ckpt" and qc["source_quantization_config"] == source["text_config"][
        "quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["format"] == "moet-w2" and group["method"] == "refit" and group["weights"] == 72
    # everything else in config.json is unchanged
    assert {k: v for k, v in config["text_config"].items() if k != "quantization_config"} == {
        k: v for k, v in source["text_config"].items() if k != "quantization_config"}
    (fid, pats), = declared_groups(config)
    written = {n[: -len("_packed")] for w in result.plan.weights for _, n in w.outputs if n.endswith("_packed")}
    with open_checkpoint(dst) as out:
        weights = {n[: -len("_packed")] if n.endswith("_packed") else n for n in out.tensors}
    hits = {w for w in weights if any(p.fullmatch(w) for p in pats)}
    assert fid == "moet-w2" and hits == written


def test_dequant_decodes_the_output(k3_refit, tmp_path):
    from k3ckpt import api

    result, dst = k3_refit
    d = api.dequant(dst, tmp_path / "deq", dtype="f32")
    assert len(d.decoded) == 72 and not d.skipped
    with open_checkpoint(dst) as out, open_checkpoint(tmp_path / "deq") as deq:
        for w in result.plan.weights[::17]:
            assert np.array_equal(deq.read_raw(w.name), get_format("moet-w2").decode(outputs_of(out, w)))
        assert "quantization_config" not in json.loads((tmp_path / "deq" / "config.json").read_text())[
            "text_config"]


def crash_after(src, dst, n: int, **kw) -> list[str]:
    """Run requant into ``dst`` and fail it at the ``n``-th result; the final shards it left."""
    seen = []

    def boom(r):
        seen.append(r.name)
        if len(seen) == n:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated"):
        run(src, dst, on_result=boom, **kw)
    return sorted(p.name for p in dst.glob("*.safetensors"))


def test_resume_after_failure_is_byte_identical(k3_tiny, k3_refit, tmp_path):
    _, full = k3_refit
    dst = tmp_path / "out"
    finals = crash_after(k3_tiny, dst, 40)
    assert finals and not list(dst.glob(".*.partial")) and not (dst / "config.json").exists()
    for name in finals:   # whatever carries a final name is complete
        assert read_header(dst / name).file_size == (dst / name).stat().st_size
    with pytest.raises(OutputExistsError, match="--resume"):
        run(k3_tiny, dst)
    with pytest.raises(ResumeMismatchError, match="format"):
        run(k3_tiny, dst, resume=True, format="moet-w2:keep-scales")
    again = run(k3_tiny, dst, resume=True)
    assert set(again.resumed_shards) == set(finals)
    assert folder_bytes(dst) == folder_bytes(full)
    manifest = json.loads((dst / "k3ckpt-manifest.json").read_text())
    assert manifest["state"] == "complete" and set(folder_bytes(full)) <= set(manifest["files"])
    # a resume of a finished run changes nothing
    run(k3_tiny, dst, resume=True)
    assert folder_bytes(dst) == folder_bytes(full)
    # results live beside the shards, not in the manifest (which would grow with the checkpoint)
    assert not [k for k in manifest["extra"] if k.startswith("results")]
    saved = sorted(p.name for p in (dst / ".k3ckpt-results").iterdir())
    assert saved == sorted(f"{n}.json" for n in finals + [n for n in manifest["files"] if n.endswith(
        ".safetensors") and n not in finals])
    assert {f".k3ckpt-results/{n}" for n in saved} <= set(manifest["files"])


def test_pool_workers_writing_in_place_crash_and_resume(k3_tiny, k3_refit, tmp_path):
    """With a pool, workers write their tensors into the shards' temporary files themselves
    (ShardedWriter.place); a failure with such writes in flight leaves no partial file and only
    complete final shards, and a resumed pool run ends byte-identical to the one-process run."""
    _, full = k3_refit
    dst = tmp_path / "out"
    finals = crash_after(k3_tiny, dst, 40, workers=2)
    assert finals and not list(dst.glob(".*.partial"))
    for name in finals:
        assert read_header(dst / name).file_size == (dst / name).stat().st_size
    again = run(k3_tiny, dst, resume=True, workers=2)
    assert set(again.resumed_shards) == set(finals)
    assert folder_bytes(dst) == folder_bytes(full)


def test_resume_rewrites_a_shard_whose_results_are_lost(k3_tiny, k3_refit, tmp_path):
    _, full = k3_refit
    dst = tmp_path / "out"
    finals = crash_after(k3_tiny, dst, 40)
    assert len(finals) >= 2
    (dst / ".k3ckpt-results" / f"{finals[0]}.json").unlink()
    (dst / ".k3ckpt-results" / f"{finals[1]}.json").write_text("[]")     # hash no longer matches
    again = run(k3_tiny, dst, resume=True)
    assert set(again.resumed_shards) == set(finals[2:])
    assert folder_bytes(dst) == folder_bytes(full) and again.results == run(k3_tiny, tmp_path / "c").results


def test_pool_worker_exit_skips_the_final_collection():
    """init_worker freezes the heap at exit: the interpreter's last collection over numba's
    objects took about half a second per worker, at the end of every pool run."""
    import subprocess
    import sys

    code = ("import atexit, gc\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0))\n"   # runs after init's
            "from k3ckpt.requant.worker import init_worker\n"
            "init_worker(None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "frozen True"


def test_pool_workers_start_with_the_kernel_loaded():
    """On Linux, workers are forked from the fork server after it imported numba and
    loaded the default kernel (_preload): about a second of CPU once, not once per worker."""
    import multiprocessing
    import subprocess
    import sys

    if not sys.platform.startswith("linux") or "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("workers are spawned on this platform")
    probe = ("(__import__('sys').modules['k3ckpt.requant.moet_fused']._kernel.cache_info().currsize, "
             "'k3ckpt.requant.worker' in __import__('sys').modules)")
    code = ("from concurrent.futures import ProcessPoolExecutor\n"
            "from k3ckpt.requant._stream import pool_context, start_pool_server\n"
            "start_pool_server(2)\n"
            "with ProcessPoolExecutor(1, mp_context=pool_context()) as ex:\n"
            f"    print(pool_context().get_start_method(), *ex.submit(eval, {probe!r}).result())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["forkserver", "1", "True"]


def test_pool_workers_exit_when_the_parent_is_killed():
    """SIGKILL (or SIGTERM's default action) gives the parent no chance to stop its pool:
    the workers must notice it is gone and exit, not wait on the task queue forever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    if not os.path.isdir("/proc"):
        pytest.skip("reads process states from /proc")
    code = ("import os, time\n"
            "from k3ckpt.requant._stream import _pool\n"
            "ex = _pool(2, None, 4)\n"
            "for f in [ex.submit(time.sleep, 0.3) for _ in range(2)]: f.result()\n"
            "print(*ex._processes, flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 15
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, workers))


def test_a_worker_killed_from_outside_is_one_clear_error(k3_tiny):
    """A worker that dies without a result (the OOM killer, a signal) is not a bug in k3ckpt:
    WorkerLostError, which the CLI prints as one line, naming a weight and --resume."""
    import os
    import signal

    from k3ckpt.errors import WorkerLostError
    from k3ckpt.requant._stream import _Runner
    from k3ckpt.requant.plan import plan_requant

    with open_checkpoint(k3_tiny) as ck:
        plan = plan_requant(ck, format="moet-w2")
        runner = _Runner(ck, plan.weights, 2, str(k3_tiny), keep_parts=False)
        try:
            runner.next()   # the pool is up
            for pid in list(runner._pool._processes):
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(WorkerLostError, match=r"tensor '.*experts.*': a pool worker process ended"
                                                      r".*rerun with --resume"):
                while runner:
                    runner.next()
        finally:
            runner.close()


def test_too_little_space_is_refused_before_dst_exists(k3_tiny, tmp_path, monkeypatch):
    """Not even a manifest is left behind: after freeing space, the same command runs as
    it was typed (no --resume needed)."""
    import shutil

    from k3ckpt.errors import DiskSpaceError

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    with pytest.raises(DiskSpaceError, match="output needs .* bytes but only 100,000 are free"):
        run(k3_tiny, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert run(k3_tiny, tmp_path / "out").results
    # A DST holding an earlier run is the first thing to say, whatever the free space.
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    with pytest.raises(OutputExistsError):
        run(k3_tiny, tmp_path / "out")


def test_worker_pool_gives_the_same_bytes(gpt_oss_tiny, tmp_path):
    a = run(gpt_oss_tiny, tmp_path / "one", workers=1, format="k3ckpt-mx2")
    b = run(gpt_oss_tiny, tmp_path / "two", workers=2, format="k3ckpt-mx2")
    assert folder_bytes(tmp_path / "one") == folder_bytes(tmp_path / "two")
    assert a.results == b.results and len(a.results) == 16
    with open_checkpoint(gpt_oss_tiny) as src, open_checkpoint(tmp_path / "one") as out:
        for name in a.plan.copies:
            assert sha(out.read_bytes(name)) == sha(src.read_bytes(name)), name
        assert not any(n.endswith(("_blocks", "_scales")) for n in out.tensors)
        assert "model.layers.0.mlp.experts.3.gate_up_proj_bias" not in out   # still fused
        assert "model.layers.0.mlp.experts.gate_up_proj_bias" in out
        w = next(w for w in a.plan.weights if w.name == "model.layers.1.mlp.experts.2.gate_up_proj.weight")
        parts = outputs_of(out, w)
        assert set(parts) == {"packed", "scale", "levels", "exp_base"}
        assert parts["packed"].shape == (320, 40)
        blocks = src.read_raw("model.layers.1.mlp.experts.gate_up_proj_blocks")[2]
        scales = src.read_raw("model.layers.1.mlp.experts.gate_up_proj_scales")[2]
        ref = get_format("gpt-oss-mxfp4").decode({"blocks": blocks, "scales": scales})
        r = a.results[w.index]
        assert error_stats(ref, get_format("k3ckpt-mx2").decode(parts)) == r.stats
        assert r.bytes == 320 * 160 * 9 // 32 + 9 and r.expert == 2 and r.projection == "gate_up"


def test_dry_run_writes_nothing(k3_tiny, tmp_path):
    r = run(k3_tiny, tmp_path / "never", dry_run=True, format="k3ckpt-mx2")
    assert r.dry_run and not r.results and not (tmp_path / "never").exists()
    assert len(r.plan.weights) == 72 and r.plan.out_bytes == 72 * (256 * 256 * 9 // 32 + 9)
    assert r.estimated_seconds > 0 and r.to_dict()["plan"][0]["format"] == "k3ckpt-mx2"


def test_selection_and_overrides(k3_tiny, tmp_path):
    from k3ckpt import api

    r = run(k3_tiny, tmp_path / "o", experts=["gate", "up"], format="moet-w2:keep-scales",
            tensor_type=[(r"layers\.2\..*\.w1\.", "k3ckpt-mx2"), (r"experts\.0\.w3", "keep")])
    kinds = {(x.format, x.method, x.projection) for x in r.results}
    assert kinds == {("moet-w2", "keep-scales", "gate"), ("moet-w2", "keep-scales", "up"),
                     ("k3ckpt-mx2", None, "gate")}
    assert len(r.results) == 48 - 3 and all(x.scale_changes is None for x in r.results)
    assert sum(1 for x in r.results if x.format == "k3ckpt-mx2") == 8
    kept = set(r.plan.kept)
    assert len(kept) == 24 + 3 and all(k.endswith((".w2.weight", ".experts.0.w3.weight")) for k in kept)
    with open_checkpoint(k3_tiny) as src, open_checkpoint(tmp_path / "o") as out:
        for k in kept:   # left in MXFP4, byte for byte
            for suffix in ("_packed", "_scale"):
                assert out.read_bytes(k + suffix) == src.read_bytes(k + suffix)
    d = api.dequant(tmp_path / "o", tmp_path / "d")
    assert len(d.decoded) == 72 and not d.skipped   # both new formats and the kept MXFP4
    with pytest.raises(UsageError, match="selects no"):
        run(k3_tiny, tmp_path / "none", experts=r"experts\.99\.")
    with pytest.raises(UsageError, match="REGEX=FORMAT"):
        run(k3_tiny, tmp_path / "bad", tensor_type=["nothing"])


def test_requant_weight_on_known_input():
    # all +0 nibbles except one -0 block: zero fraction 1, keep-scales maps +0 -> +1, -0 -> -1
    packed = np.zeros((2, 32), np.uint8)
    packed[1, 16:] = 0x88
    scale = np.full((2, 2), 120, np.uint8)
    parts, r = requant_weight(packed, scale, "moet-w2", "keep-scales", name="w")
    assert r.source_zero_fraction == 1.0 and r.code_histogram == (0, 32, 96, 0)
    assert r.stats.snr_db == -np.inf and r.max_row_bias == np.inf
    assert TensorResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    bad = scale.copy()
    bad[1, 0] = 0xFF
    with pytest.raises(NaNScaleError, match="experts.3.w1"):
        requant_weight(packed, bad, "moet-w2", name="m.experts.3.w1.weight")
    with pytest.raises(ShapeError):
        requant_weight(packed[:, :20], scale, "moet-w2", name="w")


def test_targets_match_exactly():
    rng = np.random.default_rng(5)
    every = [f"m.layers.{l}.experts.{e}.w{p}.weight" for l in range(3) for e in range(12) for p in (1, 2, 3)]
    for frac in (1.0, 0.5, 0.1):
        pick = {n for n in every if rng.random() < frac} or {every[0]}
        pats = [__import__("re").compile(t[3:]) for t in targets_for(pick)]
        assert {n for n in every if any(p.fullmatch(n) for p in pats)} == pick
    assert len(targets_for(every)) == 3


# ------------------------------------------------------------------- bad input

def _mini(path: Path, *, drop=(), shapes=None) -> Path:
    """A two-expert, one-layer pair-layout checkpoint (generic names, no config)."""
    rng = np.random.default_rng(1)
    tensors = {"model.layers.0.input_layernorm.weight": np.ones(64, np.float32)}
    for e in range(2):
        for p in ("w1", "w2", "w3"):
            base = f"model.layers.0.block_sparse_moe.experts.{e}.{p}"
            n, k = (shapes or {}).get(base, (8, 64))
            if base + ".weight_packed" not in drop:
                tensors[base + ".weight_packed"] = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
            if base + ".weight_scale" not in drop:
                tensors[base + ".weight_scale"] = np.full((n, max(1, k // 32)), 120, np.uint8)
    path.mkdir(parents=True)
    save_file(path / "model.safetensors", tensors)
    return path


def test_bad_sources(tmp_path):
    ok = run(_mini(tmp_path / "ok"), tmp_path / "ok-out")
    assert len(ok.results) == 6
    with pytest.raises(InvalidFileError, match=r"expert 1 lacks projection\(s\) \['up'\]"):
        run(_mini(tmp_path / "a", drop=("model.layers.0.block_sparse_moe.experts.1.w3.weight_packed",
                                       "model.layers.0.block_sparse_moe.experts.1.w3.weight_scale")), tmp_path / "a-out")
    with pytest.raises(InvalidFileError, match="lacks its scale"):
        run(_mini(tmp_path / "b", drop=("model.layers.0.block_sparse_moe.experts.0.w2.weight_scale",)), tmp_path / "b-out")
    with pytest.raises(ShapeError, match="experts.1.w2"):
        run(_mini(tmp_path / "c", shapes={"model.layers.0.block_sparse_moe.experts.1.w2": (8, 48)}), tmp_path / "c-out")
    assert not (tmp_path / "a-out").exists() and not (tmp_path / "c-out").exists()


def test_nan_scale_and_foreign_dst(k3_tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(k3_tiny, src)
    victim = "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_scale"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][victim]
    h = read_header(shard)
    start = h.data_start + h.tensors[victim].start + 3
    with open(shard, "r+b") as f:
        f.seek(start)
        f.write(b"\xff")
    for workers in (1, 2):   # in-process, and raised inside a pool worker
        out = tmp_path / f"out{workers}"
        with pytest.raises(NaNScaleError, match="experts.5.w2"):
            run(src, out, workers=workers)
        assert not list(out.glob(".*.partial")) and not (out / "config.json").exists()
        for p in out.glob("*.safetensors"):
            assert read_header(p).file_size == p.stat().st_size
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not a k3ckpt output"):
        run(k3_tiny, foreign)


def test_failing_writer_leaves_no_partial_file(k3_tiny, tmp_path, monkeypatch):
    import errno

    from k3ckpt.io import writer as wmod

    calls = {"n": 0}
    real = wmod.ShardedWriter._pwrite_all

    def flaky(fd, view, offset):
        calls["n"] += 1
        if calls["n"] == 150:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real(fd, view, offset)

    monkeypatch.setattr(wmod.ShardedWriter, "_pwrite_all", staticmethod(flaky))
    with pytest.raises(OSError, match="simulated"):
        run(k3_tiny, tmp_path / "out")
    out = tmp_path / "out"
    assert not list(out.glob(".*.partial")) and not (out / "config.json").exists()
    manifest = json.loads((out / "k3ckpt-manifest.json").read_text())
    for p in out.glob("*.safetensors"):
        assert read_header(p).file_size == p.stat().st_size
        assert p.name in manifest["files"]


@pytest.mark.parametrize("seed", [0, 1])
def test_tensor_stats_kernels_equal_references(seed):
    from k3ckpt.requant import tensor_stats as ts

    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (5, 40), dtype=np.uint8)
    assert np.array_equal(ts.byte_counts(b), ts.byte_counts_reference(b))
    # independent counts: unpack every nibble / 2-bit field
    nibbles = np.concatenate([b.reshape(-1) & 15, b.reshape(-1) >> 4])
    assert ts.zero_codes(b) == ts.zero_codes(b, reference=True) == int(np.count_nonzero((nibbles & 7) == 0))
    fields = np.concatenate([(b.reshape(-1) >> sh) & 3 for sh in (0, 2, 4, 6)])
    assert ts.code_histogram(b) == tuple(int(np.count_nonzero(fields == c)) for c in range(4))


# ---------------------------------------------------------------- --target-bpw

def test_allocate_equal_sizes_keeps_the_worst():
    from k3ckpt.requant.allocate import Candidate, allocate

    rng = np.random.default_rng(7)
    cands = [Candidate(f"w{i:02d}", 1024, 544, 288, float(rng.uniform(1, 100))) for i in range(40)]
    for target in (2.25, 2.5, 3.0, 4.25, 9.0):
        a = allocate(cands, target)
        k = min(40, int((target * 40 * 1024 / 8 - 40 * 288) // (544 - 288)))
        assert a.keep == {c.name for c in sorted(cands, key=lambda c: -c.sse)[:k]}
        assert a.bpw <= max(target, 4.25) and (target > 4.25 or target - a.bpw < 8 * 256 / (40 * 1024))
        assert a.sse == pytest.approx(sum(c.sse for c in cands if c.name not in a.keep))
    with pytest.raises(UsageError, match="below"):
        allocate(cands, 2.0)


def test_target_bpw_mixes_formats_and_resumes(k3_tiny, tmp_path, monkeypatch):
    r = run(k3_tiny, tmp_path / "t", target_bpw=2.5)
    assert r.bits_per_weight == pytest.approx(2.5, abs=0.03) and r.bits_per_weight <= 2.5
    assert r.allocation["bpw"] == r.bits_per_weight and len(r.results) == 72
    kept = [x for x in r.results if x.format == "mxfp4-pack-quantized"]
    assert len(kept) == len(r.allocation["keep"]) > 0 and all(x.stats.snr_db == np.inf for x in kept)
    with open_checkpoint(k3_tiny) as src, open_checkpoint(tmp_path / "t") as out:
        for x in kept:   # kept weights are the source bytes
            base = x.name[: -len(".weight")]
            for suffix in (".weight_packed", ".weight_scale"):
                assert out.read_bytes(base + suffix) == src.read_bytes(base + suffix)
    # the kept weights are those the 2.25 format hurts most per extra byte (equal sizes here)
    full = {x.name: x for x in run(k3_tiny, tmp_path / "all").results}
    worst = sorted(full.values(), key=lambda x: -x.stats.err_rms)[: len(kept)]
    assert {x.name for x in kept} == {x.name for x in worst}
    # resuming reuses the stored allocation and gives the same bytes
    crash_after(k3_tiny, tmp_path / "r", 20, target_bpw=2.5)
    assert (tmp_path / "r" / ".k3ckpt-results" / "allocation.json").is_file()
    from k3ckpt.requant import _stream

    def no_measure(*a, **k):
        raise AssertionError("a resumed run measured again")

    monkeypatch.setattr(_stream, "measure", no_measure)
    run(k3_tiny, tmp_path / "r", target_bpw=2.5, resume=True)
    assert folder_bytes(tmp_path / "r") == folder_bytes(tmp_path / "t")


def test_dequant_counts_mx2_nan_blocks(tmp_path):
    from k3ckpt import api

    r = run(_mini(tmp_path / "src"), tmp_path / "mx2", format="k3ckpt-mx2")
    w = r.plan.weights[2]
    name = dict(w.outputs)["scale"]
    (shard,) = list((tmp_path / "mx2").glob("*.safetensors"))
    h = read_header(shard)
    at = h.data_start + h.tensors[name].start + 5
    with open(shard, "r+b") as f:   # offset 63 marks a NaN block whatever the selector
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([(b & 0xC0) | 63]))
    d = api.dequant(tmp_path / "mx2", tmp_path / "d", dtype="f32")
    assert d.nan_blocks == {w.name: 1} and len(d.decoded) == 6


def test_verify_checks_a_requant_output(k3_refit, tmp_path):
    """k3ckpt verify: every file of a requant output (results files included) against the
    manifest; a changed byte or a stray file is reported."""
    import shutil

    from k3ckpt.shard.verify import verify_output

    _, full = k3_refit
    dst = tmp_path / "copy"
    shutil.copytree(full, dst)
    r = verify_output(dst)
    assert r.ok and r.files_checked == len(json.loads((dst / "k3ckpt-manifest.json").read_text())["files"])
    shard = next(dst.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size - 1)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    (dst / "notes.txt").write_text("mine")
    problems = verify_output(dst).problems
    assert any(shard.name in p and "sha256" in p for p in problems)
    assert any("notes.txt" in p and "not listed" in p for p in problems)
    # --source is checked (tests/test_verify.py); an output is not its own source
    rep = verify_output(dst, source=full)
    assert not rep.ok and any("not the one this output was made from" in p for p in rep.problems)
