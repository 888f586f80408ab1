"""Pipeline stages as vLLM forms them: which decoder layers each stage creates.

vLLM splits *all* decoder layers (dense ones included) over the pipeline stages with
``vllm.distributed.utils.get_pp_indices(num_hidden_layers, pp_rank, pp_size)``:
``num_hidden_layers // pp_size`` layers a stage, and the remainder one each to the
stages before the last, from the second-to-last backwards (the last stage holds the
final norm, the first the embeddings); ``VLLM_PP_LAYER_PARTITION="a,b,..."`` sets the
counts instead (one per stage, summing to ``num_hidden_layers``).  The Moet runtime
numbers a stage's MoE layers by creation order (``layer_key`` 0, 1, ... in each
stage), so a pack is only right if our stage holds exactly the MoE layers vLLM creates
there.
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError

__all__ = ["pp_counts", "pp_indices", "parse_partition", "moe_bounds", "partition_text", "check_stages",
           "stage_ranges"]


def pp_counts(num_layers: int, pp_size: int, partition=None) -> list[int]:
    """Decoder layers per stage: ``partition`` checked, else vLLM's default rule."""
    if not isinstance(pp_size, int) or pp_size < 1:
        raise UsageError(f"pipeline stages must be a positive integer, found {pp_size!r}")
    if partition is not None:
        counts = [int(c) for c in partition]
        if len(counts) != pp_size:
            raise UsageError(f"pipeline partition {partition_text(counts)} has {len(counts)} stage(s); the plan has "
                             f"{pp_size} (one count per GPU, as VLLM_PP_LAYER_PARTITION)")
        if sum(counts) != num_layers or min(counts) < 1:
            raise UsageError(f"pipeline partition {partition_text(counts)} must be {pp_size} positive counts summing "
                             f"to the model's {num_layers} decoder layers (num_hidden_layers)")
        return counts
    if num_layers < pp_size:
        raise UsageError(f"{num_layers} decoder layers cannot fill {pp_size} pipeline stages")
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):   # get_pp_indices: partitions[-i] += 1
        counts[-i] += 1
    return counts


def pp_indices(num_layers: int, pp_rank: int, pp_size: int, partition=None) -> tuple[int, int]:
    """``[start, end)`` decoder layers of stage ``pp_rank``, as ``get_pp_indices``."""
    counts = pp_counts(num_layers, pp_size, partition)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def parse_partition(text: str | None):
    """``"2,2"`` (``--pp-partition``, the format of ``VLLM_PP_LAYER_PARTITION``) -> [2, 2]."""
    if text is None:
        return None
    try:
        counts = [int(p) for p in str(text).split(",")]
    except ValueError:
        raise UsageError(f"--pp-partition takes decoder-layer counts per stage like 47,46 (as "
                         f"VLLM_PP_LAYER_PARTITION), found {text!r}") from None
    return counts


def partition_text(counts) -> str:
    return ",".join(str(int(c)) for c in counts)


def moe_bounds(layer_ids, num_layers: int, pp_size: int, partition=None) -> np.ndarray:
    """``[pp_size + 1]`` MoE-layer row boundaries of the stages: stage ``r`` runs MoE
    rows ``[b[r], b[r+1])``, the MoE layers among its decoder layers."""
    ids = np.asarray(layer_ids, dtype=np.int64)
    if ids.size and int(ids.max()) >= num_layers:
        raise UsageError(f"MoE layer {int(ids.max())} lies beyond the model's {num_layers} decoder layers")
    counts = pp_counts(num_layers, pp_size, partition)
    ends = np.cumsum(counts)
    bounds = np.concatenate(([0], np.searchsorted(ids, ends, side="left"))).astype(np.int64)
    empty = [r for r in range(pp_size) if bounds[r + 1] == bounds[r]]
    if empty:
        r = empty[0]
        a, b = int(ends[r] - counts[r]), int(ends[r])
        raise UsageError(f"pipeline stage {r} (decoder layers {a}-{b - 1} of partition {partition_text(counts)}) "
                         f"holds no MoE layer; give --pp-partition with an MoE layer in every stage, or fewer GPUs")
    return bounds


def _span(ids) -> str:
    ids = list(ids)
    return "none" if not ids else f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"


def check_stages(layers, num_layers: int, plan, layout: str) -> None:
    """Refuse a cache plan whose ranks are not vLLM's stages where that matters.

    A moet pack keys a stage's MoE layers 0, 1, ... in the order vLLM's stage creates
    them, so each rank must run exactly the MoE layers of its stage: the plan's
    ``pp_partition``, or vLLM's default split of the checkpoint's ``num_layers``
    decoder layers for plans that do not record one.  Any layout: a recorded partition
    must cover this checkpoint's decoder layers."""
    c, G = plan.cache, plan.devices.num_gpus
    if c.pp_partition and sum(c.pp_partition) != num_layers:
        raise UsageError(f"the plan splits {sum(c.pp_partition)} decoder layers over its ranks "
                         f"({partition_text(c.pp_partition)}); this checkpoint has {num_layers}: plan this checkpoint")
    if layout != "moet" or G < 2:
        return
    counts = list(c.pp_partition) or pp_counts(num_layers, G)
    want = moe_bounds(layers, num_layers, G, counts)
    if not np.array_equal(want, c.layer_bounds):
        r = max(int(np.flatnonzero(want != c.layer_bounds)[0]) - 1, 0)
        got = list(layers[int(c.layer_bounds[r]): int(c.layer_bounds[r + 1])])
        need = list(layers[int(want[r]): int(want[r + 1])])
        raise UsageError(
            f"rank {r} of the plan runs MoE layers {_span(got)}, but vLLM's stage {r} (decoder layers "
            f"{partition_text(counts)} per stage, get_pp_indices) creates MoE layers {_span(need)}: the runtime would "
            f"read another layer's experts; re-plan with k3ckpt plan (it follows vLLM's split; --pp-partition for "
            f"another)")


def stage_ranges(num_layers: int, plan) -> list[tuple[int, int]] | None:
    """``[start, stop)`` decoder layers of every rank of a cache plan that records its
    partition for ``num_layers`` layers; None otherwise (placement, older plans)."""
    counts = plan.cache.pp_partition if plan.mode == "cache" else ()
    if not counts or sum(counts) != num_layers:
        return None
    ends = np.cumsum(counts)
    return [(int(e - n), int(e)) for n, e in zip(counts, ends)]
