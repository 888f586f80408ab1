"""What a GGUF file (or split set) holds, from its headers alone: ``GGUFInspectReport``.

Tensors are counted by ggml type and by role; a role is read from the tensor's GGUF
name as llama.cpp's tensor map spells it (``blk.N.ffn_gate_exps`` ...), the same for
every architecture.  No tensor data is read.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from ..inspection import Bucket
from .reader import GGUFFile, GGUFSet, type_label

JSON_SCHEMA_VERSION = 1
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_SMALL_ARRAY = 64            # arrays up to this many numbers are shown in full in --json (per-layer lists)


def role_of(name: str) -> str:
    """``routed_expert`` (``*_exps*``), ``shared_expert`` (``*_shexp*``), ``norm``, ``embedding``
    (``token_embd``), ``lm_head`` (``output.*``), ``attention`` (``attn_*``, and ``ssm_*``: K3's
    KDA mixer) or ``other`` (router, dense MLP, latent projections, residual scores)."""
    m = _BLOCK.match(name)
    local = m.group(2) if m else name
    if "_exps" in local:
        return "routed_expert"
    if "_shexp" in local:
        return "shared_expert"
    if "_norm" in local or local.startswith("norm."):
        return "norm"
    if m is None:
        if local.startswith("token_embd"):
            return "embedding"
        if local.startswith("output."):
            return "lm_head"
        return "other"
    if local.startswith(("attn_", "ssm_")) and "_res_score" not in local:
        return "attention"
    return "other"


@dataclass(frozen=True)
class GGUFTensorRow:
    """One tensor as ``inspect --list-tensors`` lists it; ``shape`` in numpy order."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    role: str
    params: int
    bytes: int
    file: str


@dataclass(frozen=True)
class GGUFInspectReport:
    """``api.inspect`` of a ``.gguf`` path (docs/gguf.md, "Reading GGUF")."""

    source: str
    files: tuple[GGUFFile, ...]
    gguf_version: int
    alignment: int
    architecture: str | None
    model_name: str | None             # general.name
    file_type: int | None              # general.file_type (llama_ftype)
    file_type_name: str | None         # its gguf.LlamaFileType name: MOSTLY_IQ2_XS, ...
    context_length: int | None
    block_count: int | None
    embedding_length: int | None
    expert_count: int | None
    expert_used_count: int | None
    expert_shared_count: int | None
    vocab_size: int | None             # ARCH.vocab_size, else the tokenizer's token count
    tokenizer: str | None              # tokenizer.ggml.model
    chat_template: bool
    kv_count: int
    tensor_count: int
    total_bytes: int                   # tensor data
    params_total: int
    by_type: tuple[Bucket, ...]
    by_role: tuple[Bucket, ...]
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)   # key -> {type, value} (big arrays: length)
    warnings: tuple[str, ...] = ()
    tensors: tuple[GGUFTensorRow, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["schema_version"] = JSON_SCHEMA_VERSION
        out["format"] = "gguf"
        for key in ("by_type", "by_role"):
            out[key] = [dict(asdict(b), bits_per_weight=b.bits_per_weight) for b in getattr(self, key)]
        if self.tensors is None:
            del out["tensors"]
        return out


def _summary(gs: GGUFSet) -> dict[str, Any]:
    """Every key with its type; values in full except strings' and big arrays' (their length)."""
    import gguf

    out = {}
    for key, f in gs.kv.items():
        label = type_label(f)
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            n = len(f.data)
            small = n <= _SMALL_ARRAY and not label.endswith("[STRING]")
            out[key] = {"type": label, "length": n, **({"value": f.contents()} if small else {})}
        elif f.types[0] == gguf.GGUFValueType.STRING:
            out[key] = {"type": label, "length": len(f.parts[-1]),
                        **({"value": f.contents()} if len(f.parts[-1]) <= 256 else {})}
        else:
            out[key] = {"type": label, "value": f.contents()}
    return out


def _int(v) -> int | None:
    return None if v is None or isinstance(v, (list, str)) else int(v)


def _buckets(acc: dict[str, list[int]]) -> tuple[Bucket, ...]:
    return tuple(sorted((Bucket(k, *v) for k, v in acc.items()), key=lambda b: (-b.bytes, b.key)))


def inspect_gguf(gs: GGUFSet, *, source: str, tensors: bool = False) -> GGUFInspectReport:
    """Summarise the open GGUF ``gs`` from its headers."""
    import gguf

    arch = gs.architecture
    warnings = []
    if arch is None:
        warnings.append("no general.architecture key: llama.cpp will not load it")

    def arch_key(name: str):
        return None if arch is None else gs.value(f"{arch}.{name}")

    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    by_role: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    rows = []
    for t in gs.tensors.values():
        role = role_of(t.name)
        for acc, key in ((by_type, t.type_name), (by_role, role)):
            acc[key][0] += 1
            acc[key][1] += t.params
            acc[key][2] += t.nbytes
        if tensors:
            rows.append(GGUFTensorRow(t.name, t.type_name, t.shape, role, t.params, t.nbytes, t.file))
    file_type = _int(gs.value("general.file_type"))
    try:
        ft_name = None if file_type is None else gguf.LlamaFileType(file_type).name
    except ValueError:
        ft_name = None
        warnings.append(f"general.file_type {file_type} is not a llama_ftype the gguf package knows")
    vocab = _int(arch_key("vocab_size"))
    if vocab is None:
        vocab = gs.array_len("tokenizer.ggml.tokens")
    return GGUFInspectReport(
        source=source, files=gs.files, gguf_version=gs.version, alignment=gs.alignment, architecture=arch,
        model_name=gs.value("general.name"), file_type=file_type, file_type_name=ft_name,
        context_length=_int(arch_key("context_length")), block_count=_int(arch_key("block_count")),
        embedding_length=_int(arch_key("embedding_length")), expert_count=_int(arch_key("expert_count")),
        expert_used_count=_int(arch_key("expert_used_count")),
        expert_shared_count=_int(arch_key("expert_shared_count")), vocab_size=vocab,
        tokenizer=gs.value("tokenizer.ggml.model"), chat_template="tokenizer.chat_template" in gs.kv,
        kv_count=len(gs.kv), tensor_count=len(gs.tensors), total_bytes=sum(t.nbytes for t in gs.tensors.values()),
        params_total=sum(t.params for t in gs.tensors.values()), by_type=_buckets(by_type),
        by_role=_buckets(by_role), metadata=_summary(gs), warnings=tuple(warnings),
        tensors=tuple(rows) if tensors else None)
