"""Load and trace files: formats, validation, DeepSeek-style rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k3ckpt.errors import UsageError
from k3ckpt.placement.loads import (
    check_trace,
    loads_from_trace,
    read_keep_tiers,
    read_loads,
    read_trace,
    write_loads,
)
from k3ckpt.placement.spec import MoEGeometry

GEO = MoEGeometry(3, 4, 2, 1000, 0, (3, 4, 5))


@pytest.mark.parametrize("suffix", [".npy", ".json", ".csv"])
def test_round_trip(tmp_path, suffix):
    loads = np.arange(12, dtype=float).reshape(3, 4) + 0.5
    p = tmp_path / f"l{suffix}"
    write_loads(p, loads)
    assert np.array_equal(read_loads(p, GEO), loads)


def test_formats(tmp_path):
    p = tmp_path / "plain.json"
    p.write_text(json.dumps([[1, 2, 3, 4]] * 3))
    assert read_loads(p, GEO).shape == (3, 4)
    c = tmp_path / "h.csv"
    c.write_text("e0,e1,e2,e3\n1,2,3,4\n1,2,3,4\n1,2,3,4\n")
    assert read_loads(c, GEO).sum() == 30


def test_model_layer_rows_are_cut_to_moe_rows(tmp_path):
    full = np.zeros((6, 4))
    full[3:] = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"logical_count": full.tolist()}))  # like DeepSeek-V3: dense rows first
    assert read_loads(p, GEO).tolist() == full[3:].tolist()


@pytest.mark.parametrize(
    "data,match",
    [([[1, 2, 3]] * 3, "3 experts"), ([[1, 2, 3, 4]] * 2, "2 layers"), ([[1, 2, -3, 4]] * 3, "negative"),
     ([[1, 2, float("nan"), 4]] * 3, "NaN"), ([[0, 0, 0, 0]] * 3, "all zero"), ([1, 2, 3], "2-D")],
)
def test_validation(tmp_path, data, match):
    p = tmp_path / "x.npy"
    np.save(p, np.array(data, dtype=float))
    with pytest.raises(UsageError, match=match):
        read_loads(p, GEO)


def test_bad_files(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps([[1, 2, 3, 4], [1, 2]]))
    with pytest.raises(UsageError, match="different lengths"):
        read_loads(p, GEO)
    p = tmp_path / "r.txt"
    p.write_text("1")
    with pytest.raises(UsageError, match="unknown loads format"):
        read_loads(p, GEO)
    p = tmp_path / "k.json"
    p.write_text(json.dumps({"counts": []}))
    with pytest.raises(UsageError, match="logical_count"):
        read_loads(p, GEO)


def test_traces(tmp_path):
    tr = np.array([[[0, 1], [2, 3], [1, 0]], [[3, 2], [0, 1], [2, 1]]])
    p = tmp_path / "t.npy"
    np.save(p, tr)
    assert read_trace(p, GEO).shape == (2, 3, 2)
    assert loads_from_trace(tr, 4).tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 2, 1, 0]]
    for bad, match in ((tr.astype(float), "integer"), (tr[:, :2], "needs"), (tr + 1, "names expert 4"),
                       (np.array([[[1, 1], [2, 3], [0, 1]]]), "twice")):
        with pytest.raises(UsageError, match=match):
            check_trace(bad, GEO)


def test_keep_tiers(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"layers": {str(i): {"keep": [0, 1]} for i in (3, 4, 5)}}))
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"layers": {str(i): {"keep": [0, 1, 2]} for i in (3, 4, 5)}}))
    assert read_keep_tiers([a, b], GEO).tolist() == [[2, 2, 1, 0]] * 3
    b.write_text(json.dumps({"layers": {"3": {"keep": [9]}}}))
    with pytest.raises(UsageError):
        read_keep_tiers([b], GEO)
