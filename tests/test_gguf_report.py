"""The error report of a GGUF output: one row per routed expert and projection, our bytes decoded back
against the source's own values, the same report for any worker count and after a resume."""

from __future__ import annotations

import json
import math
import re

import gguf
import numpy as np
import pytest

from k3ckpt.formats.mxfp4 import decode_pair_ref
from k3ckpt.gguf.convert import write_gguf
from k3ckpt.io.reader import open_checkpoint
from k3ckpt.requant.report import load_report
from split_kill import Killed, kill_after_split

SPLIT = 2_000_000          # k3-tiny at IQ2_XS in 4 files
GGUF_PROJ = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


@pytest.fixture(scope="module")
def written(k3_tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "k3.gguf"
    with open_checkpoint(k3_tiny) as c:
        return write_gguf(c, out, split_max_bytes=SPLIT, workers=1)


def _experts_energy(k3_tiny, paths):
    """Signal and error energies of every routed expert, decoded by the gguf package (not our decoders)
    against the MXFP4 source decoded by the numpy reference."""
    tensors = {t.name: t for p in paths for t in gguf.GGUFReader(p).tensors}
    sig = err = 0.0
    per = {}
    with open_checkpoint(k3_tiny) as c:
        for name in c.tensors:
            m = re.search(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight_packed$", name)
            if not m:
                continue
            layer, expert, w = int(m.group(1)), int(m.group(2)), m.group(3)
            ref = decode_pair_ref(c.read_raw(name), c.read_raw(name.replace("_packed", "_scale")))
            t = tensors[f"blk.{layer}.{GGUF_PROJ[w]}.weight"]
            raw = np.asarray(t.data)[expert]
            got = gguf.quants.dequantize(raw, t.tensor_type).reshape(ref.shape)
            s, e = float(np.sum(ref.astype(np.float64) ** 2)), float(np.sum((got - ref).astype(np.float64) ** 2))
            per[name.removesuffix("_packed")] = 10 * math.log10(s / e)
            sig, err = sig + s, err + e
    return 10 * math.log10(sig / err), per


def test_report_rows_are_each_expert_decoded_back_against_the_source(k3_tiny, written):
    report = load_report(written.report)
    assert len(report.tensors) == 3 * 3 * 8                  # MoE layers x projections x experts
    assert {r.format for r in report.tensors} == {"gguf-iq2_xs"}
    assert {r.projection for r in report.tensors} == {"gate", "up", "down"}
    pooled, per = _experts_energy(k3_tiny, written.paths)
    assert {r.name for r in report.tensors} == set(per)
    for r in report.tensors:
        assert r.stats.snr_db == pytest.approx(per[r.name], abs=1e-4)
        assert r.bpw == pytest.approx(2.3125)
    assert report.overall.snr_db == pytest.approx(pooled, abs=1e-4)
    assert written.snr_db == report.overall.snr_db
    assert 9.0 < pooled < 12.0


def test_report_is_the_same_for_any_worker_count_and_after_a_resume(k3_tiny, written, tmp_path, monkeypatch):
    want = (written.report / "requant_report.json").read_text()
    with open_checkpoint(k3_tiny) as c:
        two = write_gguf(c, tmp_path / "two" / "k3.gguf", split_max_bytes=SPLIT, workers=2)
    assert (two.report / "requant_report.json").read_text().replace(str(tmp_path / "two"), "") == \
        want.replace(str(written.report.parent), "")
    out = tmp_path / "resumed" / "k3.gguf"
    with monkeypatch.context() as mp:
        kill_after_split(mp, 2)
        with open_checkpoint(k3_tiny) as c, pytest.raises(Killed):
            write_gguf(c, out, split_max_bytes=SPLIT, workers=1)
    assert not (out.parent / "k3-report").exists()
    with open_checkpoint(k3_tiny) as c:
        r = write_gguf(c, out, split_max_bytes=SPLIT, resume=True, workers=1)
    assert len(r.resumed) == 2
    got = json.loads((r.report / "requant_report.json").read_text())
    assert got["tensors"] == json.loads(want)["tensors"] and got["overall"] == json.loads(want)["overall"]


def test_a_resume_without_the_finished_splits_rows_is_refused(k3_tiny, tmp_path, monkeypatch):
    from k3ckpt.errors import InvalidFileError

    out = tmp_path / "k3.gguf"
    with monkeypatch.context() as mp:
        kill_after_split(mp, 1)
        with open_checkpoint(k3_tiny) as c, pytest.raises(Killed):
            write_gguf(c, out, split_max_bytes=SPLIT, workers=1)
    for f in (tmp_path / "k3.k3ckpt-results").iterdir():
        f.unlink()
    with open_checkpoint(k3_tiny) as c, pytest.raises(InvalidFileError, match="report rows of finished split"):
        write_gguf(c, out, split_max_bytes=SPLIT, resume=True, workers=1)
