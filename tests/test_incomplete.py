"""Incomplete checkpoints are refused by writers and reported by inspect (issue 17, item 2)."""

from __future__ import annotations

import json
import shutil

import pytest

from k3ckpt import api
from k3ckpt.cli.main import main
from k3ckpt.errors import InvalidFileError, NotFoundError
from k3ckpt.io import open_checkpoint
from k3ckpt.io.writer import save_file

SHARD3 = "model-00003-of-000007.safetensors"   # k3-tiny: layer 2's routed experts


def _copy(src, dst, *, index=True, skip=()):
    dst.mkdir()
    for p in src.iterdir():
        if p.name in skip or (not index and p.name == "model.safetensors.index.json"):
            continue
        shutil.copy(p, dst / p.name)
    return dst


def _cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_numbered_set_with_a_gap_is_refused_everywhere(capsys, k3_tiny, tmp_path):
    src = _copy(k3_tiny, tmp_path / "src", index=False, skip={SHARD3})
    with pytest.raises(NotFoundError, match=r"incomplete checkpoint: 1 of 7 shards missing \(" + SHARD3 + r"\)"):
        open_checkpoint(src)
    for args in (["inspect", src], ["requant", src, tmp_path / "out", "--workers", "1"],
                 ["dequant", src, tmp_path / "deq"], ["plan", src, "--devices", "8xH100"]):
        rc, out, err = _cli(capsys, *args)
        assert rc == 2 and err.count("\n") == 1 and SHARD3 in err, (args, err)
    assert not (tmp_path / "out").exists() and not (tmp_path / "deq").exists()


def _without_layer2_experts(k3_tiny, dst):
    """All 7 shards present, but shard 3 rewritten without layer 2's routed experts (no index)."""
    src = _copy(k3_tiny, dst, index=False)
    with open_checkpoint(k3_tiny) as ck:
        keep = {n: (e.dtype, e.shape, ck.read_bytes(n)) for n, e in ck.tensors.items()
                if e.shard == SHARD3 and ".layers.2.block_sparse_moe.experts." not in n}
    assert keep   # the shard holds other tensors too
    save_file(src / SHARD3, keep)
    return src


def test_moe_layers_without_experts(capsys, k3_tiny, tmp_path):
    src = _without_layer2_experts(k3_tiny, tmp_path / "src")
    # inspect: the report, a warning on stderr and in the JSON; exit 2 only with --strict
    r = api.inspect(src)
    assert r.warnings[0].startswith("MoE layer(s) 2 have no routed-expert tensors in the headers (the config "
                                    "expects 8 each)")
    rc, out, err = _cli(capsys, "inspect", src)
    assert rc == 0 and "MoE: layers 1-3" in out and err.startswith("k3ckpt: warning: MoE layer(s) 2 have no")
    rc, out, err = _cli(capsys, "inspect", src, "--json", "--strict")
    assert rc == 2 and json.loads(out)["warnings"] == list(r.warnings)
    assert err.splitlines()[-1].startswith("k3ckpt: error: 1 warning(s) with --strict: MoE layer(s) 2")
    # writers refuse, naming what is missing, and write nothing
    with pytest.raises(InvalidFileError, match=r"incomplete checkpoint: MoE layer\(s\) 2 have no routed-expert"):
        api.requant(src, tmp_path / "out", workers=1, progress=False)
    for args in (["requant", src, tmp_path / "out", "--workers", "1"], ["dequant", src, tmp_path / "deq"],
                 ["plan", src, "--devices", "8xH100"]):
        rc, _, err = _cli(capsys, *args)
        assert rc == 2 and err.count("\n") == 1 and "MoE layer(s) 2 have no routed-expert tensors" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "deq").exists()


def test_an_empty_weight_map(capsys, k3_tiny, tmp_path):
    src = _copy(k3_tiny, tmp_path / "src")
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    r = api.inspect(src)
    assert r.tensor_count == 0 and r.warnings[0] == "the checkpoint holds no tensors (its index's weight_map is empty)"
    rc, _, err = _cli(capsys, "inspect", src, "--strict")
    assert rc == 2 and "holds no tensors" in err
    for args in (["requant", src, tmp_path / "out", "--workers", "1"], ["dequant", src, tmp_path / "deq"]):
        rc, _, err = _cli(capsys, *args)
        assert rc == 2 and "incomplete checkpoint: the checkpoint holds no tensors" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "deq").exists()


def test_whole_checkpoints_pass(k3_tiny, gpt_oss_tiny, kimi_k2_tiny):
    for ck in (k3_tiny, gpt_oss_tiny, kimi_k2_tiny):
        assert api.inspect(ck).warnings == ()
        api.open_source(ck).close()   # no error
