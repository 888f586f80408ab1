"""``k3ckpt inspect SRC``: the report of ``k3ckpt.api.inspect`` as text or JSON."""

from __future__ import annotations

import sys

import click

from .. import api
from ..errors import InvalidFileError
from .render import echo_json, human_bytes, human_count, table
from .source import hub_option, source_argument


def _ranges(layers) -> str:
    """[1,2,3,5] -> '1-3, 5'."""
    out, run = [], []
    for i in list(layers) + [None]:
        if run and (i is None or i != run[-1] + 1):
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        if i is not None:
            run.append(i)
    return ", ".join(out) or "-"


def _layers(ids) -> str:
    """() -> 'none', (0,) -> 'layer 0', (1, 2, 3) -> 'layers 1-3': never a bare '0' that reads as none."""
    ids = list(ids)
    if not ids:
        return "none"
    return f"layer {ids[0]}" if len(ids) == 1 else f"layers {_ranges(ids)}"


def render_report(r, *, tensors=None) -> str:
    """The report as text; warnings are not in it (the command prints them on stderr)."""
    lines = [
        f"source        {r.source}",
        f"model         {r.display_name} (profile {r.profile}, model_type {r.model_type or '-'})",
    ]
    if r.num_layers is not None:
        attn = ", ".join(f"{n} {k}" for k, n in sorted(r.attention_layers.items()))
        lines += [
            f"layers        {r.num_layers} ({attn}); dense MLP: {_layers(r.dense_layers)}; "
            f"MoE: {_layers(r.moe_layers)}",
            f"experts       {r.experts_per_layer} routed per MoE layer, top-{r.top_k}, "
            f"{r.shared_experts} shared; {r.routed_experts:,} routed experts in the headers",
        ]
    active = "-" if r.params_active is None else human_count(r.params_active)
    lines += [
        f"parameters    {human_count(r.params_total)} total, {active} active per token",
        f"tensors       {r.tensor_count:,} in {len(r.shards)} shard(s), {human_bytes(r.total_bytes)} "
        f"({r.total_bytes:,} B)",
        f"expert bytes  {human_bytes(r.routed_expert_bytes)} ({r.routed_expert_bytes:,} B) in routed experts",
        "",
    ]
    for title, buckets in (("role", r.by_role), ("storage", r.by_storage)):
        rows = [(b.key, f"{b.tensors:,}", human_count(b.params), human_bytes(b.bytes), f"{b.bytes:,}",
                 "-" if b.bits_per_weight is None else f"{b.bits_per_weight:.3f}") for b in buckets]
        lines += [table(rows, [f"by {title}", "tensors", "params", "size", "bytes", "bits/weight"]), ""]
    sizes = [s.size for s in r.shards]
    if sizes:
        lines.append(f"shards        {len(sizes)}: smallest {human_bytes(min(sizes))}, largest "
                     f"{human_bytes(max(sizes))}, total {human_bytes(sum(sizes))}")
    if r.unrecognised:
        shown = ", ".join(r.unrecognised[:5]) + (" ..." if len(r.unrecognised) > 5 else "")
        lines.append(f"unrecognised  {len(r.unrecognised)} tensor(s) with role 'other': {shown}")
    hub = r.extra.get("hub") if r.extra else None
    if hub:
        lines.append(f"hub           {hub.get('repo_id', '')}@{hub.get('commit', '')} via {hub.get('endpoint', '')}; "
                     f"fetched {hub.get('bytes_fetched', 0):,} B")
    if r.scan is not None:
        lines += ["", r.scan.render()]
    if tensors is not None:
        lines += ["", table(tensors, ["tensor", "dtype", "shape", "role", "storage", "bytes", "shard"],
                            align="llllrrl")]
    return "\n".join(lines)


def render_gguf_report(r, *, tensors=None) -> str:
    """A GGUF's report (``GGUFInspectReport``) in the safetensors report's layout."""
    def opt(v):
        return "-" if v is None else f"{v:,}" if isinstance(v, int) else str(v)

    ft = "-" if r.file_type is None else f"{r.file_type} ({r.file_type_name or 'unknown'})"
    sizes = [f.size for f in r.files]
    lines = [
        f"source        {r.source}",
        f"model         {r.model_name or '-'} (GGUF v{r.gguf_version}, architecture {r.architecture or '-'}, "
        f"file_type {ft})",
        f"layers        {opt(r.block_count)} blocks, embedding {opt(r.embedding_length)}, "
        f"context {opt(r.context_length)}",
        f"experts       {opt(r.expert_count)} routed, top-{opt(r.expert_used_count)}, "
        f"{opt(r.expert_shared_count)} shared",
        f"vocabulary    {opt(r.vocab_size)} tokens ({r.tokenizer or '-'}); chat template "
        f"{'present' if r.chat_template else 'absent'}; {r.kv_count} metadata keys",
        f"parameters    {human_count(r.params_total)}",
        f"tensors       {r.tensor_count:,} in {len(r.files)} file(s), {human_bytes(r.total_bytes)} "
        f"({r.total_bytes:,} B)",
        "",
    ]
    for title, buckets in (("ggml type", r.by_type), ("role", r.by_role)):
        rows = [(b.key, f"{b.tensors:,}", human_count(b.params), human_bytes(b.bytes), f"{b.bytes:,}",
                 "-" if b.bits_per_weight is None else f"{b.bits_per_weight:.3f}") for b in buckets]
        lines += [table(rows, [f"by {title}", "tensors", "params", "size", "bytes", "bits/weight"]), ""]
    lines.append(f"files         {len(sizes)}: smallest {human_bytes(min(sizes))}, largest {human_bytes(max(sizes))}, "
                 f"total {human_bytes(sum(sizes))}")
    if tensors is not None:
        lines += ["", table(tensors, ["tensor", "ggml type", "shape", "role", "params", "bytes", "file"],
                            align="llllrrl")]
    return "\n".join(lines)


@click.command("inspect", epilog="""\b
Examples:
  k3ckpt inspect /models/Kimi-K3                    # headers only: seconds even for the full K3
  k3ckpt inspect out/ --json --strict | jq .by_storage   # exit 2 if anything is missing
  k3ckpt inspect Kimi-K3-IQ2_XS-00001-of-00020.gguf     # a GGUF: all its splits, by ggml type and role""")
@source_argument
@hub_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (docs/inspect-json.md).")
@click.option("--list-tensors", "list_tensors", is_flag=True,
              help="Also list every tensor with its dtype, shape, role, storage and shard.")
@click.option("--tensors", "old_list_tensors", is_flag=True, hidden=True,
              help="Deprecated spelling of --list-tensors (dequant's --tensors takes a regex).")
@click.option("--scan", is_flag=True, help="Read the data too: scale histograms, NaN/Inf, zero codes, amax.")
@click.option("--strict", is_flag=True,
              help="Exit 2 when there are warnings (e.g. MoE layers without experts, no tensors, config and "
                   "headers disagree); the report is printed first.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar, no warnings on stderr.")
def command(src, as_json, list_tensors, old_list_tensors, scan, strict, quiet):
    """Report what the checkpoint SRC holds, from its headers alone.

    SRC is a checkpoint folder (with or without model.safetensors.index.json),
    a single .safetensors file, or hf://ORG/NAME.  A numbered shard set with a
    shard missing is refused; MoE layers without their experts and an empty
    checkpoint are warnings (on stderr and in --json's "warnings"), which
    requant, dequant, shard and plan refuse.

    SRC may also be a .gguf file, or any split of a GGUF set (the other splits
    are found beside it, as llama.cpp names them): its metadata and tensors by
    ggml type and role, from the headers.
    """
    if old_list_tensors:
        click.echo("k3ckpt: warning: inspect --tensors is now --list-tensors", err=True)
    list_tensors = list_tensors or old_list_tensors
    progress = scan and not quiet and sys.stderr.isatty()
    report = api.inspect(src, scan=scan, tensors=list_tensors, progress=progress)
    if as_json:
        echo_json(report.to_json())
    elif isinstance(report, api.GGUFInspectReport):
        rows = None if report.tensors is None else [
            (t.name, t.ggml_type, "x".join(map(str, t.shape)), t.role, f"{t.params:,}", f"{t.bytes:,}", t.file)
            for t in report.tensors]
        click.echo(render_gguf_report(report, tensors=rows))
    else:
        rows = None if report.tensors is None else [
            (t.name, t.dtype, "x".join(map(str, t.shape)) or "scalar", t.role, t.storage, f"{t.bytes:,}", t.shard)
            for t in report.tensors]
        click.echo(render_report(report, tensors=rows))
    if not quiet:
        for w in report.warnings:
            click.echo(f"k3ckpt: warning: {w}", err=True)
    if strict and report.warnings:
        raise InvalidFileError(f"{len(report.warnings)} warning(s) with --strict: {report.warnings[0]}")
