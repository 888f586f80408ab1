"""Classify all 497,220 tensor names of the released Kimi K3 (packaged index).

Dtypes come from the K3 fact sheet's tensor table: experts' weight_packed /
weight_scale are U8; conv1d, A_log, o_norm, dt_bias and the router's
e_score_correction_bias are F32; everything else is BF16.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections import Counter
from importlib import resources

import pytest

from k3ckpt.profiles import Role, detect

_F32 = (".q_conv1d.weight", ".k_conv1d.weight", ".v_conv1d.weight", ".A_log", ".o_norm.weight", ".dt_bias",
        ".e_score_correction_bias")
_EXPERT = re.compile(r"^language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight_(packed|scale)$")


def _dtype(name: str) -> str:
    if name.endswith((".weight_packed", ".weight_scale")):
        return "U8"
    if name.endswith(_F32):
        return "F32"
    return "BF16"


@pytest.fixture(scope="module")
def k3():
    data = resources.files("k3ckpt.data")
    config = json.loads(data.joinpath("k3_config.json").read_text())
    index = json.loads(gzip.decompress(data.joinpath("k3_index.json.gz").read_bytes()))
    names = list(index["weight_map"])
    prof = detect(config, index["weight_map"])
    start = time.process_time()
    roles = {n: prof.classify(n, _dtype(n)) for n in names}
    elapsed = time.process_time() - start
    print(f"\nclassified {len(names):,} K3 names in {elapsed:.2f} s CPU ({elapsed / len(names) * 1e6:.1f} us each)")
    return prof, names, roles


def test_index_is_the_release(k3):
    _, names, _ = k3
    assert len(names) == 497_220


def test_every_routed_expert_tensor(k3):
    prof, names, roles = k3
    g = prof.geometry
    seen = Counter()
    proj = {"w1": "gate", "w3": "up", "w2": "down"}
    for n in names:
        m = _EXPERT.match(n)
        r = roles[n]
        if m is None:
            assert r.role is not Role.ROUTED_EXPERT, n
            continue
        layer, expert, w, part = int(m[1]), int(m[2]), m[3], m[4]
        assert r.role is Role.ROUTED_EXPERT, n
        assert (r.layer, r.expert, r.projection, r.part) == (layer, expert, proj[w], part), n
        assert r.weight == n.rsplit("_", 1)[0], n  # ...w1.weight_packed -> ...w1.weight
        assert r.storage == "mxfp4-pack-quantized"
        seen[(layer, expert)] += 1
    assert len(seen) == len(g.moe_layers) * g.experts == 92 * 896
    assert set(seen.values()) == {6}
    assert {lay for lay, _ in seen} == set(g.moe_layers)
    assert sum(seen.values()) == 494_592


def test_role_counts(k3):
    prof, names, roles = k3
    g = prof.geometry
    moe, mla, kda = len(g.moe_layers), len(g.layers_of("mla")), len(g.layers_of("kda"))
    assert (moe, mla, kda) == (92, 24, 69)
    counts = Counter(r.role for r in roles.values())
    expected = {
        Role.ROUTED_EXPERT: 6 * g.experts * moe,
        Role.SHARED_EXPERT: 3 * moe,                  # gate/up/down
        Role.ROUTER: 2 * moe,                         # gate.weight + e_score_correction_bias
        Role.LATENT_PROJ: 3 * moe,                    # routed_expert_{down,up}_proj + routed_expert_norm
        Role.ATTN_MLA: 8 * mla,
        Role.ATTN_KDA: 14 * kda,
        Role.DENSE_MLP: 3 * len(g.dense_layers),
        Role.NORM: 2 * g.num_layers + 1,              # input/post_attention per layer + final norm
        Role.RESIDUAL: 4 * g.num_layers + 2,          # self_attention_res_*, mlp_res_* + output_attn_res_*
        Role.EMBEDDING: 1,
        Role.LM_HEAD: 1,
        Role.VISION: 168,
    }
    assert dict(counts) == expected
    assert sum(expected.values()) == len(names)


def test_bf16_despite_quantization_config(k3):
    _, names, roles = k3
    storages = Counter(r.storage for r in roles.values())
    assert storages["mxfp4-pack-quantized"] == 494_592
    assert set(storages) == {"mxfp4-pack-quantized", "bf16", "f32"}
    for n in names:
        if "routed_expert_" in n or "_res_proj" in n or n.endswith("block_sparse_moe.gate.weight"):
            assert roles[n].storage == "bf16", n


def test_attention_kind_follows_the_layer(k3):
    prof, names, roles = k3
    for n in names:
        if n.endswith(".self_attn.o_proj.weight"):
            r = roles[n]
            want = Role.ATTN_MLA if prof.geometry.attention[r.layer] == "mla" else Role.ATTN_KDA
            assert r.role is want, n


def test_names_alone_detect_k3(k3):
    _, names, _ = k3
    prof = detect(None, names)
    assert prof.id == "kimi_k3"
    r = prof.classify(names[-1], _dtype(names[-1]))
    assert r.role is not None
