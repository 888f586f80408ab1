"""k3ckpt gguf --imatrix: each expert of a stacked GGUF tensor is encoded with its row of the
importance entry of that tensor's name, the same for any worker count, and the report weighs its
error; an importance matrix of another model is refused before anything is written."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from k3ckpt import api
from k3ckpt.errors import UsageError
from k3ckpt.formats import get_format, ids
from k3ckpt.io.reader import open_checkpoint

from test_imatrix import write_gguf

PROJ = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}


def _expert_tensors(path):
    r = gguf.GGUFReader(path)
    return {t.name: t for t in r.tensors if "_exps" in t.name}


def _entries(tensors, *, leave_out=(), seed=0, n_per_row=None):
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in sorted(tensors.items()):
        if name in leave_out:
            continue
        k, _, experts = (int(d) for d in t.shape)          # ggml order: K, rows, experts
        k = n_per_row or k
        energy = rng.lognormal(0.0, 1.0, (experts, k)).astype(np.float32)
        energy[:, rng.random(k) < 0.02] *= 50
        counts = rng.integers(1, 30, experts).astype(np.float32)
        out[name] = (energy * counts[:, None], counts)
    return out


@pytest.fixture(scope="module")
def layout(k3_tiny, tmp_path_factory):
    """The expert tensors of k3-tiny's GGUF (names and shapes, from a dry run's file)."""
    root = tmp_path_factory.mktemp("gguf-imatrix")
    plain = api.gguf(k3_tiny, root / "plain.gguf", expert_type="q2_k", split_max_size=None, workers=1)
    return root, plain.paths[0], _expert_tensors(plain.paths[0])


def test_each_expert_is_encoded_with_its_row(k3_tiny, layout):
    root, plain_path, tensors = layout
    skip = sorted(tensors)[0]
    entries = _entries(tensors, leave_out={skip})
    im = write_gguf(root / "im.gguf", entries)
    res = api.gguf(k3_tiny, root / "w.gguf", expert_type="q2_k", split_max_size=None, workers=1, imatrix=im)
    got, plain = _expert_tensors(res.paths[0]), _expert_tensors(plain_path)
    q2k = get_format(ids.GGUF_Q2_K)
    assert np.asarray(got[skip].data).tobytes() == np.asarray(plain[skip].data).tobytes()   # no entry: unweighted
    with open_checkpoint(k3_tiny) as src:
        for name in sorted(entries)[:2]:
            layer = int(name.split(".")[1])
            sums, counts = entries[name]
            data = np.asarray(got[name].data)
            changed = False
            for e in range(data.shape[0]):
                base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{PROJ[name.split('.')[2]]}"
                packed = src.read_raw(base + ".weight_packed").view(np.uint8)
                scale = src.read_raw(base + ".weight_scale").view(np.uint8)
                cols = (sums[e] / np.float32(counts[e])).astype(np.float32)
                want = q2k.from_mxfp4(packed, scale, imatrix=cols)["packed"]
                assert data[e].tobytes() == want.tobytes(), (name, e)
                changed |= want.tobytes() != q2k.from_mxfp4(packed, scale)["packed"].tobytes()
            assert changed, name
    report = json.loads((res.report / "requant_report.json").read_text())
    assert report["meta"]["imatrix"]["without_entry"] == [skip]
    assert report["overall"]["weighted_snr_db"] == pytest.approx(res.weighted_snr_db)
    weighted = [t for t in report["tensors"] if "weighted_snr_db" in t]
    assert weighted and len(weighted) < len(report["tensors"])
    again = api.gguf(k3_tiny, root / "w2.gguf", expert_type="q2_k", split_max_size=None, workers=2, imatrix=im)
    assert again.paths[0].read_bytes() == res.paths[0].read_bytes()


def test_an_imatrix_for_another_model_is_refused_first(k3_tiny, layout, tmp_path):
    _, _, tensors = layout
    other = write_gguf(tmp_path / "other.gguf", {"blk.0.attn_q.weight": (np.ones((1, 64), np.float32), [1])})
    with pytest.raises(UsageError, match="names no tensor this run encodes.*expected names like 'blk"):
        api.gguf(k3_tiny, tmp_path / "o.gguf", expert_type="q2_k", split_max_size=None, workers=1, imatrix=other)
    wrong = write_gguf(tmp_path / "wrong.gguf", _entries(tensors, n_per_row=100))
    with pytest.raises(UsageError, match="not a multiple of rows of 256"):
        api.gguf(k3_tiny, tmp_path / "o.gguf", expert_type="q2_k", split_max_size=None, workers=1, imatrix=wrong)
    assert list(tmp_path.glob("o.*")) == [] and list(tmp_path.glob(".o*")) == []


def test_target_bpw_ranks_by_weighted_error_when_every_tensor_has_an_entry(k3_tiny, layout):
    # the measuring pass weighs by the importance matrix only when it covers every expert tensor
    # (a mix of weighted and plain errors would rank unlike things); the file holds what the
    # allocation says
    from k3ckpt.gguf.convert import plan_gguf_types

    root, _, tensors = layout
    full = write_gguf(root / "im-full.gguf", _entries(tensors, seed=3))
    part = write_gguf(root / "im-part.gguf", _entries(tensors, seed=3, leave_out={sorted(tensors)[0]}))
    allocs = {}
    with open_checkpoint(k3_tiny) as src:
        for label, im in (("full", full), ("part", part), ("none", None)):
            allocs[label] = plan_gguf_types(src, target_bpw=2.2, imatrix=im)[3].allocation
    assert allocs["full"].weighted and not allocs["part"].weighted and not allocs["none"].weighted
    # the weighted sums are on another scale than the plain ones (the encoders weigh by the
    # matrix either way, so "part" measures weighted encodes by their plain error)
    assert allocs["full"].sse != pytest.approx(allocs["part"].sse)
    assert all(a.bpw <= 2.2 + 1e-9 for a in allocs.values())
    res = api.gguf(k3_tiny, root / "mix.gguf", target_bpw=2.2, split_max_size=None, workers=1, imatrix=full)
    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(res.paths[0]).tensors}
    assert {n: written[n] for n, _ in allocs["full"].types} == dict(allocs["full"].types)
    assert res.allocation["weighted"] is True and res.allocation["types"] == dict(allocs["full"].types)
