"""``plan_inputs()``: an open checkpoint (or a geometry) and a device set in, a ``Plan`` out
(``api.plan``, ``k3ckpt plan``).

The steps, cheapest checks first so that bad input fails before any work:

1. the format id, the mode and the device set (unknown names raise ``UsageError``);
2. the model geometry from the checkpoint headers (``placement.from_checkpoint``),
   or a ``MoEGeometry`` given directly;
3. the load and trace files: shape (both shapes named), NaN, negative values;
4. whether the device set can hold one copy of the model in any tier;
5. the planner (``placement.planner.make_plan``).

Without loads, the loads are synthetic (``placement.synthetic``, K3-calibrated skew,
fixed seed) and so is a held-out routing trace (window 1, with drift) for the
traffic figures and the cache simulation; the plan's notes say so.  A given trace
without loads gives the loads (its selection counts).

``dense="host"`` keeps the non-expert weights in host DRAM (a box whose GPUs cannot
hold them, such as K3 on two 32 GB cards): the planner then sees no dense bytes on
the GPUs and the host DRAM left after them; the notes record both.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import numpy as np

from ..errors import NotFoundError, UsageError
from .devices import GB, TB, DeviceSet, preset_devices
from .spec import FORMAT_ID, MoEGeometry, Plan, placement_slot_limit

__all__ = ["plan_inputs", "resolve_geometry", "check_capacity", "balance_warning", "SYNTHETIC_SEED", "SYNTHETIC_TOKENS",
           "SYNTHETIC_TRACE_TOKENS"]

SYNTHETIC_SEED = 1
SYNTHETIC_TOKENS = 200_000      # tokens behind the synthetic planning loads
SYNTHETIC_TRACE_TOKENS = 1024   # tokens of the synthetic held-out trace
PCIE_EFFICIENCY = 0.8           # same as make_plan's default


def resolve_geometry(source, *, format_id: str | None = None, include_vision: bool = False,
                     model_id: str | None = None, requant_report=None) -> tuple[MoEGeometry, str, tuple[str, ...]]:
    """``(geometry, format id, notes)`` of ``source``: a ``MoEGeometry`` (used as is), an
    open ``Checkpoint``, or a folder / file / ``hf://`` URL (headers only).  A None
    format is ``stored`` for a mixed-format requant output, else MXFP4."""
    return _resolve(source, format_id=format_id, include_vision=include_vision, model_id=model_id,
                    requant_report=requant_report)[:3]


def _resolve(source, *, format_id, include_vision, model_id, requant_report):
    """``resolve_geometry`` plus the model's decoder-layer count (pipeline stages)."""
    from .from_checkpoint import STORED, check_format_id, moe_geometry_report

    if format_id is not None:
        check_format_id(format_id)
    if isinstance(source, MoEGeometry):
        if requant_report is not None:
            raise UsageError("a requant report needs the checkpoint it was made from, not a MoEGeometry")
        geo = source if model_id is None else dataclasses.replace(source, model_id=model_id)
        return geo, format_id or (STORED if geo.mixed else FORMAT_ID), (), geo.layer_ids[-1] + 1
    kw = dict(format_id=format_id, include_vision=include_vision, model_id=model_id, requant_report=requant_report)
    if hasattr(source, "tensors") and hasattr(source, "config"):
        rep = moe_geometry_report(source, **kw)
        geo, layers = _named(rep.geometry, source), _decoder_layers(source, rep.geometry)
    else:
        raise UsageError(f"plan needs an open Checkpoint or a MoEGeometry, found {type(source).__name__} "
                         "(k3ckpt.api.plan opens folders, files and hf:// URLs)")
    return geo, rep.format_id, rep.notes, layers


def _decoder_layers(ckpt, geo: MoEGeometry) -> int:
    """The config's ``num_hidden_layers`` (vLLM partitions all of them over pipeline
    stages), or one past the last MoE layer where the config does not say."""
    cfg = ckpt.config or {}
    tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    n = tc.get("num_hidden_layers")
    last = geo.layer_ids[-1] + 1
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= last else last


def _named(geo: MoEGeometry, ckpt) -> MoEGeometry:
    """A local folder whose config names no model: the model its profile detects
    (``Kimi K3``, inspect's ``model_name``), so the plan is not "(unnamed)"; not the
    profile's display name, which says MXFP4 experts even of a moet-w2 output.  The
    generic profile names nothing."""
    if geo.model_id:
        return geo
    from ..profiles import detect

    profile = detect(ckpt.config, ckpt.tensors.keys())
    if profile.id == "generic":
        return geo
    return dataclasses.replace(geo, model_id=profile.model_name or profile.display_name)


def _size(n: float) -> str:
    """Decimal size for messages: GB / TB for model-scale numbers, MB below 1 GB."""
    if n >= TB:
        return f"{n / TB:.3f} TB"
    if n >= GB:
        return f"{n / GB:.2f} GB"
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{int(n):,} B"


def _resolve_devices(devices) -> tuple[DeviceSet, tuple[str, ...]]:
    """A ``DeviceSet`` as given, or a shorthand with the CLI's defaults (host DRAM of the
    preset, 10 % of HBM reserved; ``devices.preset_devices``) and notes naming them."""
    if isinstance(devices, DeviceSet):
        return devices, ()
    if isinstance(devices, str):
        return preset_devices(devices)
    raise UsageError(f"devices must be a DeviceSet or a shorthand like '64xGB200', found {type(devices).__name__}")


def _is_file_arg(x) -> bool:
    return isinstance(x, (str, os.PathLike))


def _load_array(loads, geo: MoEGeometry) -> np.ndarray:
    """Loads from a path or an array, with the shape checked against the model first."""
    from .loads import check_loads, read_loads

    file = str(loads) if _is_file_arg(loads) else None
    arr = read_loads(loads) if file else check_loads(loads)
    L, E, last = geo.moe_layers, geo.experts, max(geo.layer_ids)
    per_model_layer = arr.shape[1] == E and arr.shape[0] > last
    if arr.shape != (L, E) and not per_model_layer:
        raise UsageError(
            f"loads are {list(arr.shape)}; the model needs [{L}, {E}] (MoE layers x experts) or "
            f"[{last + 1}, {E}] (one row per model layer)", file=file)
    return check_loads(arr, geo, file=file)


def _trace_array(trace, geo: MoEGeometry) -> np.ndarray:
    from .loads import check_trace, read_trace

    if _is_file_arg(trace):
        return read_trace(trace, geo)
    return check_trace(trace, geo)


def check_capacity(geo: MoEGeometry, devices: DeviceSet, *, dense: str = "hbm") -> None:
    """Refuse a device set that cannot hold one copy of the model in HBM, host DRAM
    and NVMe together, or (``dense="hbm"``) whose HBM cannot hold the dense weights
    even split over all GPUs; ``dense="host"`` needs them in each node's DRAM."""
    G, n = devices.num_gpus, devices.nodes
    per_gpu = devices.device.hbm_bytes - devices.reserved_bytes
    experts = geo.all_expert_bytes
    model = geo.dense_bytes + experts
    hbm, host = G * per_gpu, n * devices.host_dram_bytes
    caps = [d.capacity_bytes for d in devices.nvme]
    nvme = None if any(c is None for c in caps) else n * sum(caps)  # None: capacity not stated
    name = geo.model_id or "the model"
    if nvme is not None and hbm + host + nvme < model:
        nv = _size(nvme) if devices.nvme else "none"
        raise UsageError(
            f"{devices.describe()} cannot hold one copy of {name} ({_size(model)}: dense {_size(geo.dense_bytes)} + "
            f"experts {_size(experts)}) in any tier: HBM {_size(hbm)} after reserved memory, host DRAM "
            f"{_size(host)}, NVMe {nv}; add GPUs, host DRAM or NVMe drives")
    if dense == "hbm":
        share = -(-geo.dense_bytes // G)
        if share >= per_gpu:
            raise UsageError(
                f"the dense (non-expert) weights of {name}, {_size(geo.dense_bytes)}, need {_size(share)} per GPU "
                f"even split over {G} GPUs; {devices.device.name} has {_size(per_gpu)} after reserved memory. "
                f"Keep them in host DRAM (dense='host', --dense host) or add GPUs")
    else:
        share = -(-geo.dense_bytes // n)
        if devices.host_dram_bytes < share:
            raise UsageError(
                f"dense='host' keeps the dense weights in host DRAM: {_size(share)} per node; the device set has "
                f"{_size(devices.host_dram_bytes)} of host DRAM per node (give --host-dram)")


@functools.lru_cache(maxsize=4)
def _synthetic(layers: int, experts: int, top_k: int, seed: int, tokens: int, trace_tokens: int,
               planning_trace: bool):
    """Synthetic loads, planning trace (or None) and held-out trace, read-only.

    Cached: a session that plans one model on several device sets draws them once
    (the 1,024-token K3 trace alone takes seconds)."""
    from . import synthetic as syn

    pop = syn.make_popularity(layers, experts, top_k, seed)
    loads = syn.window_loads(pop, tokens, seed, 0)
    held = syn.sample_trace(pop, trace_tokens, seed, 1) if trace_tokens else None
    plan_tr = syn.sample_trace(pop, trace_tokens, seed, 0) if trace_tokens and planning_trace else None
    for a in (loads, plan_tr, held):
        if a is not None:
            a.setflags(write=False)
    return loads, plan_tr, held


def plan_inputs(
    source,
    devices,
    *,
    format_id: str | None = None,
    requant_report=None,
    loads=None,
    trace=None,
    heldout=None,
    redundant: int | None = None,
    slots_per_gpu: int | None = None,
    mode: str = "auto",
    dense: str = "hbm",
    include_vision: bool = False,
    model_id: str | None = None,
    pp_partition=None,
    seed: int = SYNTHETIC_SEED,
    synthetic_tokens: int = SYNTHETIC_TOKENS,
    synthetic_trace_tokens: int = SYNTHETIC_TRACE_TOKENS,
    **planner_options,
) -> Plan:
    """Plan expert placement or an expert cache for ``source`` on ``devices``.

    Args:
        source: an open ``Checkpoint`` or a ``MoEGeometry`` (``api.plan`` opens
            folders, files and ``hf://`` URLs).
        devices: a ``DeviceSet`` (used as is) or a shorthand (``"64xGB200"``: the
            preset's host DRAM and 10 % of HBM reserved, as ``k3ckpt plan --devices``).
        format_id: on-device format of the experts (sets the bytes per expert);
            ``stored``: each expert as the checkpoint stores it; None: ``stored`` for
            a requant output whose experts differ in format, else MXFP4.
        requant_report: a requant report (file or folder) made from or into
            ``source``: bytes per expert as it wrote them (format ``stored``).
        loads: ``[moe_layers, experts]`` array or a .npy / .json / .csv file; None:
            the trace's counts, else synthetic.
        trace: planning routing trace ``[tokens, moe_layers, top_k]`` (array or .npy):
            co-activation order in placement mode; also the held-out trace when
            ``heldout`` is not given (then the figures are in-sample).
        heldout: held-out trace for traffic figures and the cache simulation.
        redundant / slots_per_gpu: placement slot budget (see ``make_plan``).
        mode: ``auto``, ``placement`` or ``cache``.
        dense: ``hbm`` (dense weights on the GPUs) or ``host`` (in host DRAM).
        include_vision: count the vision tower among the dense weights.
        model_id: recorded in the plan (default: hub repo id, config name, else the
            detected family).
        pp_partition: cache mode: decoder layers per GPU (dense layers included), as
            ``VLLM_PP_LAYER_PARTITION`` gives them; default vLLM's ``get_pp_indices``
            split of the config's ``num_hidden_layers`` (``placement.stages``).
        seed, synthetic_tokens, synthetic_trace_tokens: synthetic loads and trace.
        planner_options: passed to ``make_plan`` (``host_fraction``, ``topology``, ...).

    Raises:
        UsageError: unknown format, device or mode; loads or traces that do not fit
            the model; a device set too small for the model.
        NotFoundError: a missing loads, trace or checkpoint path.
    """
    from .planner import make_plan

    if mode not in ("auto", "placement", "cache"):
        raise UsageError(f"mode must be auto, placement or cache, found {mode!r}")
    if dense not in ("hbm", "host"):
        raise UsageError(f"dense must be 'hbm' or 'host', found {dense!r}")
    devices, device_notes = _resolve_devices(devices)
    for what, x in (("loads", loads), ("trace", trace), ("held-out trace", heldout)):
        if _is_file_arg(x) and not Path(x).is_file():
            raise NotFoundError(f"{what} file not found", file=str(x))
    geo, format_id, geo_notes, decoder_layers = _resolve(source, format_id=format_id, include_vision=include_vision,
                                                         model_id=model_id, requant_report=requant_report)
    notes = list(geo_notes) + list(device_notes)
    loads_arr = None if loads is None else _load_array(loads, geo)
    trace_arr = None if trace is None else _trace_array(trace, geo)
    held_arr = None if heldout is None else _trace_array(heldout, geo)
    check_capacity(geo, devices, dense=dense)

    plan_geo, plan_devices = geo, devices
    if dense == "host":
        share = -(-geo.dense_bytes // devices.nodes)
        plan_geo = dataclasses.replace(geo, dense_bytes=0)
        plan_devices = dataclasses.replace(devices, host_dram_bytes=devices.host_dram_bytes - share)

    if loads_arr is None and trace_arr is None and held_arr is None:
        # a planning trace only orders GPUs by co-activation: placement mode, several domains
        fits = placement_slot_limit(plan_geo, plan_devices) * devices.num_gpus >= geo.experts
        wants_order = mode != "cache" and fits and bool(devices.gpu_domain().max() > 0)
        loads_arr, trace_arr, held_arr = _synthetic(geo.moe_layers, geo.experts, geo.top_k, int(seed),
                                                    int(synthetic_tokens), int(synthetic_trace_tokens), wants_order)
        notes.append(f"loads: synthetic (k3ckpt.placement.synthetic, seed {seed}, {synthetic_tokens} tokens, "
                     f"planning window 0); held-out trace: synthetic window 1 (drift 0.1), "
                     f"{synthetic_trace_tokens} tokens" + ("; planning trace: window 0" if trace_arr is not None
                                                           else ""))
    elif loads_arr is None:
        from .loads import loads_from_trace

        src = trace_arr if trace_arr is not None else held_arr
        loads_arr = loads_from_trace(src, geo.experts)
        notes.append(f"loads: selection counts of the {'planning' if trace_arr is not None else 'held-out'} trace "
                     f"({src.shape[0]} tokens)")
    if held_arr is None and trace_arr is not None:
        held_arr = trace_arr
        notes.append("held-out figures use the planning trace (in-sample); give a second trace for out-of-sample")

    per_pass = None
    if dense == "host":
        per_pass = geo.dense_bytes / (devices.device.host_link_bw * PCIE_EFFICIENCY)
        notes.append(
            f"dense weights ({geo.dense_bytes:,} B) kept in host DRAM (dense=host): model.dense_bytes is 0 here and "
            f"devices.host_dram_bytes is what is left per node ({devices.host_dram_bytes:,} B - {share:,} B); "
            f"streaming them to the GPUs takes {per_pass:.2f} s per forward pass at "
            f"{PCIE_EFFICIENCY:.0%} of the host links, shared by the batch")
    if per_pass:   # cache mode: the dense stream bounds tokens/s at batch 1 (metrics.binding)
        planner_options = {**planner_options, "dense_stream_s": per_pass}
    if pp_partition is not None or (mode != "placement" and not _fits(plan_geo, plan_devices)):
        # cache mode: pipeline stages as vLLM splits the decoder layers (placement.stages)
        planner_options = {**planner_options, "decoder_layers": decoder_layers, "pp_partition": pp_partition}
    result = make_plan(plan_geo, plan_devices, loads_arr, trace=trace_arr, heldout_trace=held_arr,
                       slots_per_gpu=slots_per_gpu, redundant=redundant, mode=mode, format_id=format_id,
                       **planner_options)
    if pp_partition is not None and result.mode != "cache":
        raise UsageError("a pipeline partition (--pp-partition) applies to cache plans; this plan is a placement")
    warn = balance_warning(result)
    return dataclasses.replace(result, notes=tuple(result.notes) + tuple(notes) + ((warn,) if warn else ()))


def _fits(geo: MoEGeometry, devices: DeviceSet) -> bool:
    return placement_slot_limit(geo, devices) * devices.num_gpus >= geo.experts


def balance_warning(p: Plan) -> str | None:
    """A placement with fewer slots per layer than GPUs leaves GPUs without an expert
    of a layer: the mean GPU load counts them, so balancedness (mean / max) is at most
    slots / GPUs however the experts are placed, and reads as a bad plan when it is
    only a small model on many GPUs."""
    if p.mode != "placement":
        return None
    S, G, E = p.placement_report.total_slots, p.devices.num_gpus, p.model.experts
    if S >= G:
        return None
    return (f"warning: {E} experts per layer in {S} slots on {G} GPUs: {G - S} GPUs hold no expert of a layer, so "
            f"balancedness cannot exceed {S}/{G} = {S / G:.2f} and says nothing about the placement; plan on "
            f"{S} GPUs or fewer, or give --slots-per-gpu / --redundant to replicate experts over all {G}")
