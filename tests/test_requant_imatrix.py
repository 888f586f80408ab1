"""requant --imatrix: llama.cpp importance matrices matched to our weights by the GGUF names
llama.cpp gives them, handed to the weighted encoders, and reported as weighted errors."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from k3ckpt import api
from k3ckpt.cli.main import main
from k3ckpt.errors import ResumeMismatchError, UsageError
from k3ckpt.formats import get_format, ids
from k3ckpt.io.reader import open_checkpoint
from k3ckpt.requant.importance import entry_name
from k3ckpt.requant.metrics import snr_from_sums, weighted_sums

from test_imatrix import legacy_bytes, write_gguf


def _planned(src):
    return api.requant(src, "unused", format=ids.GGUF_Q2_K, dry_run=True).plan.weights


def _importance(src, *, leave_out=(), n_per_row=None, seed=0):
    """Per GGUF expert tensor: sums [experts, K] (log-normal, 1% outlier columns at 50x) and
    counts; ``leave_out`` entries are not written."""
    rng = np.random.default_rng(seed)
    shapes = defaultdict(lambda: [0, 0])
    for w in _planned(src):
        name = entry_name(w.layer, w.expert, w.projection)
        shapes[name][0] = max(shapes[name][0], w.expert + 1)
        shapes[name][1] = n_per_row or w.shape[1]
    out = {}
    for name, (n_mat, k) in sorted(shapes.items()):
        if name in leave_out:
            continue
        energy = rng.lognormal(0.0, 1.0, (n_mat, k)).astype(np.float32)
        energy[:, rng.random(k) < 0.01] *= 50
        counts = rng.integers(1, 40, n_mat).astype(np.float32)
        counts[0] = 0                                            # expert 0 never routed to: all ones
        out[name] = (energy * counts[:, None], counts)
    return out


def _columns(entries, w):
    sums, counts = entries[entry_name(w.layer, w.expert, w.projection)]
    c = counts[w.expert]
    return np.ones(w.shape[1], np.float32) if c == 0 else (sums[w.expert] / np.float32(c)).astype(np.float32)


@pytest.fixture(scope="module")
def weighted_run(k3_tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("imatrix")
    planned = _planned(k3_tiny)
    skip = entry_name(planned[-1].layer, 0, "down")
    entries = _importance(k3_tiny, leave_out={skip})
    path = write_gguf(root / "k3.imatrix.gguf", entries, datasets=("calib.txt",), chunk_count=11, chunk_size=512)
    result = api.requant(k3_tiny, root / "out", format=ids.GGUF_Q2_K, imatrix=path, workers=1)
    return result, root / "out", entries, skip, path


def test_the_weighted_encoder_gets_each_experts_row(k3_tiny, weighted_run):
    result, dst, entries, skip, _ = weighted_run
    fmt = get_format(ids.GGUF_Q2_K)
    mx = get_format(ids.MXFP4_PACK)
    seen = {"with": 0, "without": 0}
    with open_checkpoint(k3_tiny) as src, open_checkpoint(dst) as out:
        for w, r in zip(result.plan.weights, result.results):
            packed, scale = src.read_raw(w.packed).view(np.uint8), src.read_raw(w.scale).view(np.uint8)
            got = out.read_raw(w.outputs[0][1]).view(np.uint8)
            ref = mx.decode({"packed": packed, "scale": scale})
            if entry_name(w.layer, w.expert, w.projection) == skip:
                assert np.array_equal(got, fmt.from_mxfp4(packed, scale)["packed"]), w.name
                assert r.weighted is None and r.weighted_snr_db is None
                seen["without"] += 1
                continue
            cols = _columns(entries, w)
            want = fmt.from_mxfp4(packed, scale, imatrix=cols)["packed"]
            assert np.array_equal(got, want), w.name
            assert r.weighted == weighted_sums(ref, fmt.decode({"packed": got}), cols)
            seen["with"] += 1
    assert seen["with"] > 0 and seen["without"] > 0
    # the weighting matters: some weight's bytes differ from the unweighted encoding
    with open_checkpoint(k3_tiny) as src:
        w = next(w for w in result.plan.weights if w.expert and entry_name(w.layer, w.expert, w.projection) != skip)
        plain = fmt.from_mxfp4(src.read_raw(w.packed).view(np.uint8), src.read_raw(w.scale).view(np.uint8))
    with open_checkpoint(dst) as out:
        assert not np.array_equal(out.read_raw(w.outputs[0][1]).view(np.uint8), plain["packed"])


def test_the_report_names_the_imatrix_and_gives_weighted_errors(weighted_run):
    result, dst, entries, skip, path = weighted_run
    data = json.loads((dst / "requant_report.json").read_text())
    m = data["meta"]["imatrix"]
    assert m["file"] == str(path) and m["kind"] == "gguf" and m["datasets"] == ["calib.txt"]
    assert (m["chunk_count"], m["chunk_size"], m["entries"]) == (11, 512, len(entries))
    missing = [r.name for r in result.results if r.weighted is None]
    assert m["weights_without_entry"] == len(missing) and m["without_entry"] == missing[:20]
    rows = {t["name"]: t for t in data["tensors"]}
    r = next(r for r in result.results if r.weighted is not None)
    assert rows[r.name]["weighted_snr_db"] == pytest.approx(snr_from_sums(*r.weighted))
    sums = [r.weighted for r in result.results if r.weighted is not None]
    pooled = snr_from_sums(sum(s[0] for s in sums), sum(s[1] for s in sums))
    assert data["overall"]["weighted_snr_db"] == pytest.approx(pooled)
    assert data["overall"]["weighted_tensors"] == len(sums)
    text = (dst / "requant_report.md").read_text()
    assert "importance: " + str(path) in text and f"{len(missing):,} weight(s) had no entry" in text
    assert "weighted SNR dB" in api.report(dst).text()


def test_workers_give_the_same_bytes(k3_tiny, weighted_run, tmp_path):
    result, dst, _, _, path = weighted_run
    again = api.requant(k3_tiny, tmp_path / "w2", format=ids.GGUF_Q2_K, imatrix=path, workers=2)
    assert [r.to_dict() for r in again.results] == [r.to_dict() for r in result.results]
    for name in result.shards:
        assert (tmp_path / "w2" / name).read_bytes() == (dst / name).read_bytes()


def test_an_unweighted_encoder_reports_the_weighted_error_too(k3_tiny, weighted_run, tmp_path):
    _, _, entries, _, path = weighted_run
    plain = api.requant(k3_tiny, tmp_path / "a", format=ids.MOET_W2, workers=1)
    weighted = api.requant(k3_tiny, tmp_path / "b", format=ids.MOET_W2, imatrix=path, workers=1)
    for name in plain.shards:   # moet-w2's encoder takes no importance: same bytes
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert all(r.weighted is None for r in plain.results)
    assert any(r.weighted is not None for r in weighted.results)
    rep = api.report(tmp_path / "a").text()
    assert "importance    none: errors are unweighted" in rep


def test_legacy_dat_reads_the_same_rows(k3_tiny, tmp_path):
    # a legacy entry holds every expert's values in one row, already multiplied by ncall
    planned = _planned(k3_tiny)
    entries = _importance(k3_tiny)
    name = entry_name(planned[0].layer, planned[0].expert, planned[0].projection)
    sums, _ = entries[name]
    (tmp_path / "k3.dat").write_bytes(legacy_bytes({name: (4, sums.reshape(-1) * 4)}, chunk_count=3,
                                                   dataset="calib.txt"))
    r = api.requant(k3_tiny, tmp_path / "out", format=ids.GGUF_Q2_K, imatrix=tmp_path / "k3.dat", workers=1)
    got = [x for x in r.results if x.weighted is not None]
    assert {x.name for x in got} == {w.name for w in planned
                                      if entry_name(w.layer, w.expert, w.projection) == name}
    meta = json.loads((tmp_path / "out" / "requant_report.json").read_text())["meta"]["imatrix"]
    assert meta["kind"] == "legacy" and meta["chunk_count"] == 3


def test_an_imatrix_of_another_model_is_one_line_before_anything_is_written(k3_tiny, tmp_path, capsys):
    other = write_gguf(tmp_path / "other.gguf", {"blk.0.attn_q.weight": (np.ones((1, 64), np.float32), [1])})
    with pytest.raises(UsageError, match="names no weight this run encodes.*expected names like 'blk"):
        api.requant(k3_tiny, tmp_path / "out", format=ids.GGUF_Q2_K, imatrix=other)
    assert not (tmp_path / "out").exists()
    wrong = write_gguf(tmp_path / "wrong.gguf", _importance(k3_tiny, n_per_row=100))
    with pytest.raises(UsageError, match="not a multiple of rows of 256"):
        api.requant(k3_tiny, tmp_path / "out", format=ids.GGUF_Q2_K, imatrix=wrong, dry_run=True)
    rc = main(["requant", str(k3_tiny), str(tmp_path / "out"), "--format", "Q2_K", "-q",
               "--imatrix", str(tmp_path / "missing.gguf")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "missing.gguf" in err
    assert not (tmp_path / "out").exists()


def test_resume_refuses_another_imatrix(k3_tiny, weighted_run, tmp_path):
    _, _, entries, _, path = weighted_run
    api.requant(k3_tiny, tmp_path / "out", format=ids.GGUF_Q2_K, imatrix=path, workers=1)
    other = write_gguf(tmp_path / "other.gguf", _importance(k3_tiny, seed=5), datasets=("x", "y"))
    with pytest.raises(ResumeMismatchError, match="imatrix was .*k3.imatrix.gguf.*now .*other.gguf"):
        api.requant(k3_tiny, tmp_path / "out", format=ids.GGUF_Q2_K, imatrix=other, resume=True, workers=1)


def test_weighted_sums_by_hand():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    y = (x + rng.standard_normal((3, 8)).astype(np.float32) * 0.1).astype(np.float32)
    w = rng.random(8).astype(np.float32)
    sig = sum(float(w[j]) * float(x[i, j]) ** 2 for i in range(3) for j in range(8))
    err = sum(float(w[j]) * (float(x[i, j]) - float(y[i, j])) ** 2 for i in range(3) for j in range(8))
    got = weighted_sums(x, y, w)
    assert got == pytest.approx((sig, err), rel=1e-12)
