"""Pipeline stages as vLLM forms them (``get_pp_indices``), and moet packs that follow them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k3ckpt import api
from k3ckpt.cli.main import main
from k3ckpt.errors import UsageError
from k3ckpt.placement.stages import moe_bounds, parse_partition, pp_counts, pp_indices
from k3ckpt.placement.spec import MoEGeometry, Plan


# Hand computation of vLLM's rule (vllm/distributed/utils.py get_pp_indices): num // pp
# layers a stage; the remainder one each to partitions[-2], [-3], ... (never the last).
@pytest.mark.parametrize("layers,pp,counts", [
    (4, 2, [2, 2]),            # k3-tiny: [0, 2) | [2, 4)
    (93, 2, [47, 46]),         # Kimi K3: 46 each, the extra layer to stage 0
    (93, 4, [23, 23, 24, 23]),  # remainder 1: the stage before the last
    (10, 4, [2, 3, 3, 2]),     # remainder 2: the middle stages
    (7, 4, [2, 2, 2, 1]),      # remainder 3: all but the last
    (61, 8, [7, 7, 8, 8, 8, 8, 8, 7]),  # Kimi K2 on 8 stages: 7 each, 5 extra to stages 6, 5, 4, 3, 2
    (6, 3, [2, 2, 2]),
])
def test_default_split_is_get_pp_indices(layers, pp, counts):
    assert pp_counts(layers, pp) == counts
    starts = np.concatenate(([0], np.cumsum(counts)))
    assert [pp_indices(layers, r, pp) for r in range(pp)] == [(int(starts[r]), int(starts[r + 1])) for r in range(pp)]


def test_explicit_partition_is_vllm_pp_layer_partition():
    assert parse_partition("2,2") == [2, 2] and parse_partition(None) is None
    assert pp_indices(4, 1, 2, [3, 1]) == (3, 4)
    for bad, match in (([2, 3], "summing to the model's 4"), ([4], "1 stage"), ([4, 0], "positive")):
        with pytest.raises(UsageError, match=match):
            pp_counts(4, 2, bad)
    with pytest.raises(UsageError, match="--pp-partition takes"):
        parse_partition("2;2")


def test_moe_rows_of_each_stage():
    assert moe_bounds((1, 2, 3), 4, 2).tolist() == [0, 1, 3]          # stage 0: layer 1; stage 1: 2, 3
    assert moe_bounds((1, 2, 3), 4, 2, [3, 1]).tolist() == [0, 2, 3]  # the old 1-2 | 3 split, made explicit
    assert moe_bounds(tuple(range(1, 93)), 93, 2).tolist() == [0, 46, 92]
    with pytest.raises(UsageError, match="stage 0 .* holds no MoE layer"):
        moe_bounds((1, 2, 3), 4, 2, [1, 3])


def test_cache_plans_follow_vllms_stages(k3_tiny):
    p = api.plan(k3_tiny, "2xRTX-5090", mode="cache", synthetic_trace_tokens=32)
    assert p.cache.layer_bounds.tolist() == [0, 1, 3] and p.cache.pp_partition == (2, 2)
    q = api.plan(k3_tiny, "2xRTX-5090", mode="cache", synthetic_trace_tokens=32, pp_partition=[3, 1])
    assert q.cache.layer_bounds.tolist() == [0, 2, 3] and q.cache.pp_partition == (3, 1)
    assert Plan.from_json(q.to_json()).cache.pp_partition == (3, 1)
    with pytest.raises(UsageError, match="applies to cache plans"):
        api.plan(k3_tiny, "8xH100", pp_partition=[1] * 8)
    # K3 as a MoEGeometry: 93 decoder layers (layer 0 dense), 47 | 46
    from k3ckpt.placement.devices import preset_devices

    box = preset_devices("2xRTX-5090", nvme="2x14")[0]
    k3 = api.plan(MoEGeometry.k3(), box, dense="host", mode="cache", synthetic_trace_tokens=0)
    assert k3.cache.pp_partition == (47, 46) and k3.cache.layer_bounds.tolist() == [0, 46, 92]


def test_moet_packs_refuse_ranks_that_are_not_vllms_stages(k3_tiny, tmp_path, capsys):
    """A plan without a recorded partition whose ranks run 1-2 | 3: vLLM's stage 1
    creates layers 2 and 3 and would read layer 3's pack row as layer 2's."""
    q = api.plan(k3_tiny, "2xRTX-5090", mode="cache", synthetic_trace_tokens=32, pp_partition=[3, 1])
    old = json.loads(q.to_json())
    old["cache"]["pp_partition"] = []   # as plans were written before the partition was recorded
    (tmp_path / "old.json").write_text(json.dumps(old))
    rc = main(["shard", str(k3_tiny), str(tmp_path / "o"), "--plan", str(tmp_path / "old.json"), "--layout", "moet",
               "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "rank 0 of the plan runs MoE layers 1-2, but vLLM's stage 0" in err
    assert "creates MoE layers 1" in err and not (tmp_path / "o").exists()
    # the explicit partition: accepted, stage 1's only MoE layer 3 is its key 0
    (tmp_path / "p31.json").write_text(q.to_json())
    assert main(["shard", str(k3_tiny), str(tmp_path / "o"), "--plan", str(tmp_path / "p31.json"), "--layout",
                 "moet", "-q"]) == 0
    out = capsys.readouterr().out
    assert "VLLM_PP_LAYER_PARTITION=3,1" in out
    rank1 = json.loads((tmp_path / "o" / "rank-00001" / "rank.json").read_text())
    assert rank1["moet"]["layer_keys"] == [[3, 0]]
    # the default split: layers 2, 3 on stage 1 as keys 0, 1; no partition variable needed
    p = api.plan(k3_tiny, "2xRTX-5090", mode="cache", synthetic_trace_tokens=32)
    (tmp_path / "p22.json").write_text(p.to_json())
    assert main(["shard", str(k3_tiny), str(tmp_path / "o2"), "--plan", str(tmp_path / "p22.json"), "--layout",
                 "moet", "-q"]) == 0
    assert "VLLM_PP_LAYER_PARTITION" not in capsys.readouterr().out
    rank1 = json.loads((tmp_path / "o2" / "rank-00001" / "rank.json").read_text())
    assert rank1["moet"]["layer_keys"] == [[2, 0], [3, 1]]
