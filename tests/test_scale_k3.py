"""The planning step of dequant, requant and verify on the full-size virtual K3 (497,220 tensors
as headers over sparse files): each finishes (the dequant plan was O(N^2), ~3 h) and counts
what the real K3 holds.  Slow: ``-m slow`` runs them (``.ci/run`` does)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from k3ckpt import api
from k3ckpt.io import open_checkpoint

pytestmark = pytest.mark.slow

WEIGHTS = 247_296        # routed-expert weights: 896 experts x 3 projections x 92 MoE layers
COPIED = 2_628           # every other tensor (dense layers, attention, norms, vision tower)
PARAMS = 2_722_740_830_208   # in the routed experts
COPIED_BYTES = 114_404_258_816


def test_dequant_dry_run_on_the_virtual_k3(virtual_k3, tmp_path):
    r = api.dequant(virtual_k3, tmp_path / "out", dry_run=True)
    assert not (tmp_path / "out").exists() and r.dry_run
    assert (len(r.decoded), r.copied, r.tensors) == (WEIGHTS, COPIED, WEIGHTS + COPIED)
    assert r.bytes_written == 2 * PARAMS + COPIED_BYTES == 5_559_885_919_232   # bf16 experts + copies
    assert len(r.shards) == 1_115 and r.shards[-1] == "model.safetensors.index.json"
    assert r.shards[0] == "model-00001-of-01114.safetensors" and r.skipped == ()


def test_requant_dry_run_on_the_virtual_k3(virtual_k3, tmp_path):
    r = api.requant(virtual_k3, tmp_path / "out", dry_run=True)
    assert not (tmp_path / "out").exists() and r.dry_run
    assert (len(r.plan.weights), r.copied, len(r.plan.specs)) == (WEIGHTS, COPIED, 2 * WEIGHTS + COPIED)
    assert r.plan.params == PARAMS and r.bits_per_weight == 2.25
    assert r.plan.out_bytes == PARAMS * 9 // 32 == 765_770_858_496                # 2.25 bits a weight
    assert r.plan.total_bytes == r.plan.out_bytes + COPIED_BYTES


def test_gguf_dry_run_on_the_virtual_k3(virtual_k3, tmp_path):
    r = api.gguf(virtual_k3, tmp_path / "K3-IQ2_XS.gguf", dry_run=True)
    assert r.dry_run and list(tmp_path.iterdir()) == []
    assert r.bytes_by_type["IQ2_XS"] == PARAMS * 74 // 256 == 787_042_271_232   # 2.3125 bits a weight
    assert r.tensors == 2_573 and len(r.skipped) == 168                           # text model only
    n = len(r.paths)
    assert n == 20 and r.paths[0].name == f"K3-IQ2_XS-00001-of-{n:05d}.gguf"


def test_verify_plan_of_a_dequant_output_on_the_virtual_k3(virtual_k3, tmp_path):
    """What ``verify --source`` checks in a dequant output of K3, from headers alone: the output
    here is the dequant plan's tensors as headers over sparse files (5.56 TB of holes)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_verify_plan import write_header_only

    from k3ckpt.shard.verify_convert import expected_outputs, plan_source_check

    options = {"dtype": "bf16", "tensors": None}
    with open_checkpoint(virtual_k3) as src:
        specs, copies = expected_outputs(src, "dequant", options)
        write_header_only(tmp_path / "out", list(specs))
        with open_checkpoint(tmp_path / "out") as out:
            plan = plan_source_check(out, src, "dequant", options)
            assert plan.problems == ()
            assert (plan.expected, plan.transformed, len(plan.compare)) == (WEIGHTS + COPIED, WEIGHTS, COPIED)
            assert plan.compare_bytes == sum(src.entry(n).nbytes for n in copies) == COPIED_BYTES
