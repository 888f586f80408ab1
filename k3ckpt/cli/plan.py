"""``k3ckpt plan SRC --devices SPEC``: expert placement or an NVMe expert cache.

Thin over ``k3ckpt.api.plan``: parses the options, prints a summary (or
``--json``) and writes the plan (docs/plan-json.md) with ``-o``.  The summary holds
no timings, so the same inputs print the same text (docs/examples/ are checked by a
test).
"""

from __future__ import annotations

import json

import click
import numpy as np

from .. import api
from .render import human_bytes, table
from .source import hub_option, source_argument


def _gb(n) -> str:
    return human_bytes(n)


def _rate(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _tps(x) -> str:
    return "unbounded" if x is None else f"{x:,.2f}"


def _layers(ids) -> str:
    """Model layer numbers as words: "layer 3", "layers 1-46", "layers 1, 3, 5"."""
    ids = [int(i) for i in ids]
    if not ids:
        return "no layers"
    if len(ids) == 1:
        return f"layer {ids[0]}"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"layers {ids[0]}-{ids[-1]}"
    return "layers " + ", ".join(map(str, ids))


def _layer_ranges(ids, bounds) -> str:
    parts = []
    for r in range(len(bounds) - 1):
        a, b = int(bounds[r]), int(bounds[r + 1])
        parts.append(f"rank {r}: {_layers(ids[a:b])}" if b > a else f"rank {r}: none")
    return "; ".join(parts)


def _headline(best, dense_stream_s) -> str:
    """The binding ceiling first, then the limit that binds and the others."""
    tps, binding = api.plan_ceiling(best, dense_stream_s)
    experts = f"NVMe {_tps(best.tokens_per_s_nvme)}, PCIe {_tps(best.tokens_per_s_pcie)}"
    if binding == "dense-stream":
        return (f"ceiling {_tps(tps)} at batch 1, bound by streaming the dense weights from host DRAM "
                f"({dense_stream_s:.2f} s per forward pass, shared by the batch); the experts alone allow "
                f"{_tps(best.tokens_per_s)} ({experts})")
    if not binding:
        return "ceiling unbounded (no expert read leaves HBM)"
    return f"ceiling {_tps(tps)}, bound by {'NVMe reads' if binding == 'nvme' else 'the host links (PCIe)'} ({experts})"


def _stages(counts) -> str:
    """How the pipeline ranks meet vLLM's stages (``placement.stages``)."""
    if len(counts) < 2:
        return "pipeline ranks"
    text, default = api.plan_stages(counts)
    if default:
        return f"pipeline ranks = vLLM's default stages of {text} decoder layers"
    return f"pipeline ranks of {text} decoder layers: run vLLM with VLLM_PP_LAYER_PARTITION={text}"


def _row(label: str, text: str) -> str:
    return f"{label:<16} {text}"


def _expert_sizes(m) -> str:
    if not m.mixed:
        return f"{m.expert_bytes:,} B each"
    t = m.bytes_table()
    return f"{int(t.min()):,}-{int(t.max()):,} B each (mean {float(t.mean()):,.0f} B)"


def _tier_bytes(p) -> np.ndarray:
    """``[ranks, 2]`` bytes a cache plan keeps in HBM and in host DRAM per rank."""
    c, m = p.cache, p.model
    if not m.mixed:
        return np.stack([c.hbm_slots, c.host_slots], axis=1).astype(np.int64) * m.expert_bytes
    out = np.zeros((len(c.hbm_slots), 2), dtype=np.int64)
    if c.preload.size:   # rows (rank, tier, layer, expert)
        sizes = m.bytes_table()[c.preload[:, 2], c.preload[:, 3]]
        np.add.at(out, (c.preload[:, 0], c.preload[:, 1]), sizes)
    return out


def render_plan(p) -> str:
    """The readable summary of a ``Plan`` (deterministic: no paths, no timings)."""
    m, d = p.model, p.devices
    if p.mode == "placement":
        dense = f"{_gb(m.dense_bytes)} (non-expert weights) on every GPU"
    elif m.dense_bytes:
        dense = f"{_gb(m.dense_bytes)} (non-expert weights) split over the pipeline ranks"
    else:
        dense = "none on the GPUs (kept in host DRAM, see the notes)"
    lines = [
        _row("model", f"{m.model_id or '(unnamed)'}: {m.moe_layers} MoE layers x {m.experts} experts, top-{m.top_k}"),
        _row("experts", f"{_expert_sizes(m)} " + ("as stored" if p.format_id == "stored" else f"in {p.format_id}")
             + f"; all routed experts {_gb(m.all_expert_bytes)}"),
        _row("dense", dense),
        _row("devices", f"{d.describe()}; HBM {_gb(d.device.hbm_bytes)} per GPU, reserved {_gb(d.reserved_bytes)}; "
                        f"host DRAM {_gb(d.host_dram_bytes)} per node"),
    ]
    if p.mode == "placement":
        r = p.placement_report
        lines += [
            _row("mode", "placement: every expert fits in HBM"),
            _row("slots", f"{r.total_slots} per layer ({r.redundant_slots} redundant), {r.min_slots_per_gpu}-"
                          f"{r.max_slots_per_gpu} per GPU; colocated replicas {r.colocated_replicas}"),
            _row("balancedness", f"{r.balancedness:.5f} (sum of mean / sum of max GPU load, planning loads)"),
            _row("gap to bound", f"{r.gap_to_lower_bound * 100:.4f} % above the lower bound"),
            _row("memory per GPU", f"{_gb(r.max_gpu_memory_bytes)} of {_gb(r.hbm_bytes)} (dense + reserved + "
                                   f"{r.max_slots_per_gpu} slots x " + (
                                       f"{m.moe_layers} layers x {m.expert_bytes:,} B)" if not m.mixed else
                                       f"{_gb(m.expert_layer_bytes)}: each layer's largest expert)")),
            _row("remote dispatch", f"{r.remote_domain_fraction:.4f} of expert copies leave the scale-up domain; "
                                    f"{r.remote_domains_per_token:.2f} remote domains per token (over all layers)"),
            _row("all-to-all", f"{_gb(r.a2a_bytes_per_token)} per token (dispatch + combine), "
                               f"{_gb(r.remote_domain_bytes_per_token)} of it across domains; traffic from "
                               f"{r.traffic_source}" + ("; GPUs ordered by co-activation" if r.topology_ordered else "")),
        ]
    else:
        c, r = p.cache, p.cache_report
        active = m.top_k * (c.layer_bounds[1:] - c.layer_bounds[:-1])
        fits = api.plan_fits_placement(p)
        why = ("cache (forced by --mode cache; the experts would fit in HBM as a placement)" if fits else
               "cache: the experts do not fit in HBM")
        lines += [
            _row("mode", f"{why}; per rank an HBM tier, a host-DRAM tier, NVMe"),
            _row("layers", f"{_layer_ranges(m.layer_ids, c.layer_bounds)} ({_stages(c.pp_partition)})"),
        ]
        rows = []
        tier_bytes = _tier_bytes(p)
        for g in range(len(c.hbm_slots)):
            keys = int(c.layer_bounds[g + 1] - c.layer_bounds[g]) * m.experts
            rest = keys - int(c.hbm_slots[g]) - int(c.host_slots[g])
            rows.append((g, f"{int(c.hbm_slots[g]):,}", _gb(tier_bytes[g, 0]),
                         f"{int(c.host_slots[g]):,}", _gb(tier_bytes[g, 1]),
                         f"{rest:,}", f"{int(active[g])}"))
        lines += ["", table(rows, ["rank", "HBM experts", "HBM bytes", "host experts", "host bytes",
                                   "NVMe experts", "active/token"]), ""]
        how = "simulated on the held-out trace" if r.simulated else "static hot set estimated from the loads"
        prow = [(x.policy, f"{x.hbm_hit:.4f}", f"{x.host_hit:.4f}", f"{x.nvme_rate:.4f}",
                 _gb(x.nvme_bytes_per_token), _gb(x.pcie_bytes_per_token), _tps(x.tokens_per_s))
                for x in r.policies]
        lines += [_row("hit rates", f"fractions of all expert reads, {how}"), "",
                  table(prow, ["policy", "HBM hit", "host hit", "NVMe", "NVMe bytes/token", "PCIe bytes/token",
                               "tokens/s"]), ""]
        best = r.policy(r.best_policy)
        ratio = "" if r.best_over_belady is None else f"; HBM hit rate {r.best_over_belady:.4f} of Belady's"
        lines += [
            _row("best policy", f"{r.best_policy} (highest tokens/s ceiling){ratio}"),
            _row("NVMe", f"{_gb(best.nvme_bytes_per_token)} per token; node read {_gb(d.nvme_read_bw)}/s"),
            _row("tokens/s", _headline(best, r.dense_stream_s)),
        ]
    lines += [_row("warning", n[len("warning: "):]) if n.startswith("warning: ") else _row("note", n)
              for n in p.notes]
    return "\n".join(lines)


def summary_dict(p) -> dict:
    """``--json``: the plan without its large arrays."""
    d = p.to_dict()
    for key in ("placement", "cache"):
        d.pop(key, None)
    per = d["model"].pop("per_expert_bytes", None)
    if per is not None:   # [layers][experts]: summarised, like the arrays left out
        table = p.model.bytes_table()
        d["model"]["per_expert_bytes_summary"] = {"min": int(table.min()), "max": int(table.max()),
                                                  "mean": float(table.mean()), "total": int(table.sum())}
    return d


def plan_from_options(src, *, devices, device_file, nvme, host_dram, reserve_kv, reserve_act, format_id, loads,
                      trace, heldout, redundant, slots_per_gpu, mode, dense, model_id, seed, requant_report=None,
                      pp_partition=None, **_ignored):
    """What the command runs, from its parsed options (``src`` may also be a
    ``MoEGeometry``: the docs examples are checked this way without a checkpoint)."""
    import dataclasses

    ds, dev_notes = api.device_set(devices, device_file, nvme=nvme, host_dram=host_dram, reserve_kv=reserve_kv,
                                   reserve_act=reserve_act)
    p = api.plan(src, ds, format=format_id, requant_report=requant_report, loads=loads, trace=trace,
                 heldout=heldout, redundant=redundant, slots_per_gpu=slots_per_gpu, mode=mode, dense=dense,
                 model_id=model_id, seed=seed, pp_partition=pp_partition)
    return dataclasses.replace(p, notes=tuple(p.notes) + tuple(dev_notes)) if dev_notes else p


@click.command("plan")
@source_argument
@hub_option
@click.option("--devices", "devices", metavar="SPEC", help="Device set: COUNTxNAME (64xGB200, 2xRTX-5090) "
              "or NODESxGPUSxNAME (2x8xH100); docs/devices.md.")
@click.option("--device-file", type=click.Path(dir_okay=False), help="Device-set file (.json / .toml).")
@click.option("--nvme", metavar="SPEC", help="NVMe drives per node: COUNTxGBPS[@CAPACITY], e.g. 2x14@4TB.")
@click.option("--host-dram", metavar="SIZE", help="Host DRAM per node, with a unit (512GB). Default: the preset's "
              "(128 GB per RTX 5090, 256 GB per H100/H200/B200, 960 GB per GB200 tray; docs/devices.md).")
@click.option("--reserve-kv", metavar="SIZE|PCT", help="HBM per GPU kept for the KV cache: a size (4GB) or a share "
              "of HBM (8%). Default 8%, with --reserve-act 2%: 10% of HBM stays free.")
@click.option("--reserve-act", metavar="SIZE|PCT", help="HBM per GPU kept for activations (default 2%).")
@click.option("--format", "format_id", default=None,
              help="On-device expert format (sets the bytes per expert); see `k3ckpt formats`. 'stored': each "
                   "expert as SRC stores it. Default: mxfp4-pack-quantized, or 'stored' when SRC's experts are "
                   "stored in several formats (a --target-bpw requant output).")
@click.option("--requant-report", type=click.Path(), metavar="FILE|DIR",
              help="Bytes per expert as this requant report (requant_report.json or its folder) wrote them, "
                   "for SRC the report was made from (or its output); implies --format stored.")
@click.option("--loads", type=click.Path(dir_okay=False), help="Per-expert loads [moe_layers, experts]: "
              ".npy, .json or .csv (default: synthetic).")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Routing trace [tokens, moe_layers, top_k] .npy from the planning window: co-activation for "
                   "placement (experts whose loads move together are spread over GPUs) and the cache simulation.")
@click.option("--heldout", type=click.Path(dir_okay=False), help="Held-out trace for traffic and cache "
              "simulation (default: --trace).")
@click.option("--redundant", type=int, help="Redundant expert slots per layer (placement mode).")
@click.option("--slots-per-gpu", type=int, help="Expert slots per GPU (placement mode).")
@click.option("--mode", type=click.Choice(["auto", "placement", "cache"]), default="auto", show_default=True,
              help="placement (every expert in HBM, EPLB arrays) or cache (HBM / host DRAM / NVMe tiers); auto "
                   "picks placement when the experts fit.")
@click.option("--pp-partition", metavar="N,N,...", help="Cache mode: decoder layers per GPU (dense ones included), "
              "as VLLM_PP_LAYER_PARTITION; set the same variable for vLLM. Default: vLLM's own split "
              "(get_pp_indices).")
@click.option("--dense", type=click.Choice(["hbm", "host"]), default="hbm", show_default=True,
              help="Where the non-expert weights live.")
@click.option("--model-id", help="Model name recorded in the plan (default: the hub id, the config's name, else the "
              "model family the profile detects, as inspect shows it).")
@click.option("--seed", type=int, default=1, show_default=True, help="Seed of the synthetic loads and trace.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the plan here (plan.json).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (the plan without its arrays).")
def command(src, devices, device_file, nvme, host_dram, reserve_kv, reserve_act, format_id, requant_report, loads,
            trace, heldout, redundant, slots_per_gpu, mode, pp_partition, dense, model_id, seed, output, as_json):
    """Place the experts of SRC on a device set, or lay out an expert cache.

    SRC is a checkpoint folder, a .safetensors file or an hf:// URL (headers only
    are read). With every expert fitting in HBM the plan is a placement
    (EPLB-compatible arrays); otherwise an HBM / host-DRAM / NVMe cache with
    simulated hit rates.

    Examples:

    \b
      k3ckpt plan K3 --devices 64xGB200 -o plan.json
      k3ckpt plan K3 --devices 2xRTX-5090 --nvme 2x14@4TB --host-dram 512GB --dense host -o plan.json
    """
    p = plan_from_options(src, devices=devices, device_file=device_file, nvme=nvme, host_dram=host_dram,
                          reserve_kv=reserve_kv, reserve_act=reserve_act, format_id=format_id,
                          requant_report=requant_report, loads=loads, trace=trace, heldout=heldout,
                          redundant=redundant, slots_per_gpu=slots_per_gpu, mode=mode, dense=dense,
                          model_id=model_id, seed=seed, pp_partition=pp_partition)
    if output:
        api.save_plan(p, output)
    if as_json:
        out = summary_dict(p)
        out["output"] = str(output) if output else None
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(render_plan(p))
        click.echo(f"\nwrote {output}" if output else "\n(plan not written; give -o plan.json)")
