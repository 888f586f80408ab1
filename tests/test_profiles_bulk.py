"""``Profile.locate_many`` (regex and numba paths) against ``locate`` name by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import json
from importlib import resources
from k3ckpt.profiles import base as B
from k3ckpt.profiles import get_profile

_NAMES = [
    "language_model.model.layers.12.block_sparse_moe.experts.5.w1.weight_packed",
    "language_model.model.layers.12.block_sparse_moe.experts.5.w1.weight_scale",
    "language_model.model.layers.3.self_attn.q_proj.weight",
    "model.layers.0.mlp.experts.gate_up_proj_blocks",
    "model.embed_tokens.weight",
    "lm_head.weight",
    "5.leading.number",
    "a..5",
    "a.5.6.7.8.9.10.11.12.13.14",          # more numbers than the scanner keeps
    "layers.007.x",
    "layers.1e3.x",
    "x.12",
    "",
    "vision_tower.blocks.3.attn.qkv.weight",
    "model.layers.99999999999999999999.x",  # too long for int64
    "caf\u00e9.layers.2.mlp.experts.1.w2.weight",
    "tab\there.layers.1.x",
]


def _check(profile, names, dtypes):
    distinct = sorted(set(dtypes))
    codes = np.array([distinct.index(d) for d in dtypes], dtype=np.int64)
    entries, which, layer, expert = profile.locate_many(names, codes, distinct)
    for i, (n, d) in enumerate(zip(names, dtypes)):
        e, lay, ex = profile.locate(n, d)
        assert entries[which[i]] is e, n
        assert layer[i] == (-1 if lay is None else lay), n
        assert expert[i] == (-1 if ex is None else ex), n


@pytest.mark.parametrize("scan_min", [0, 1 << 60])
def test_locate_many_equals_locate(scan_min, monkeypatch):
    monkeypatch.setattr(B, "_SCAN_MIN", scan_min)
    config = json.loads(resources.files("k3ckpt.data").joinpath("k3_config.json").read_text())
    profile = get_profile("kimi_k3", config)
    names = _NAMES * 3
    dtypes = ["U8", "BF16", "F32"] * (len(names) // 3)
    _check(profile, names, dtypes)
    plain = [n for n in names if n.isascii() and "999999" not in n]
    _check(profile, plain, ["U8"] * len(plain))


def test_separators_in_names_fall_back(monkeypatch):
    monkeypatch.setattr(B, "_SCAN_MIN", 0)
    profile = get_profile("generic")
    _check(profile, ["a.1.b", "x\n.2", "n\x00ul.3"], ["U8"] * 3)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.one_of(st.sampled_from(["layers", "experts", "w1", "weight", "h", "blocks", "0", "1",
                                                     "17", "0007", ""]),
                                   st.integers(0, 10**6).map(str)), min_size=1, max_size=7).map(".".join),
                min_size=1, max_size=40),
       st.booleans())
def test_fuzz_locate_many(names, scanned):
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(B, "_SCAN_MIN", 0 if scanned else 1 << 60)
        _check(get_profile("generic"), names, ["BF16"] * len(names))
    finally:
        mp.undo()


def test_first_ids():
    from k3ckpt.columns import first_ids

    firsts, ids = first_ids(["b", "a", "b", "c", "a"])
    assert firsts.tolist() == [0, 1, 3] and ids.tolist() == [0, 1, 0, 2, 1]
    firsts, ids = first_ids([])
    assert len(firsts) == 0 and len(ids) == 0 and ids.dtype == np.int64


def test_inspect_survives_numbers_beyond_int64(tmp_path):
    from safetensors.numpy import save_file

    from k3ckpt import api

    save_file({"model.layers.99999999999999999999.mlp.experts.3.w1.weight": np.zeros(4, np.uint8),
               "model.layers.1.mlp.experts.99999999999999999999999.w1.weight": np.zeros(4, np.uint8),
               "x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    r = api.inspect(tmp_path)
    assert (r.tensor_count, r.total_bytes, r.unrecognised) == (3, 16, ("x",))
