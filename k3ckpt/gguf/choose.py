"""Each GGUF tensor's ggml type: ``--expert-type``, ``--tensor-type``, ``--fallback-type``, ``--target-bpw``.

An architecture module plans every tensor with the converter's types (the routed
experts as F32, which every row size holds); ``assign_types`` then gives the
experts ``--expert-type``, applies the ``REGEX=TYPE`` overrides (first match wins,
on the GGUF name or any source name; tensors of two or more dimensions only, as
llama-quantize's ``--tensor-type``), and checks that each type's blocks divide the
tensor's rows. A type that does not fit is an error naming the types that do,
unless ``--fallback-type`` was given and fits: then that tensor takes it and the
result says so. Nothing is ever changed silently.

``--target-bpw X`` chooses each stacked expert tensor's type (one layer's
projection, the unit a GGUF type applies to) from ``--target-types`` (default: the
whole family k3ckpt encodes, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, Q2_K, IQ3_XXS, and for an MXFP4
source its lossless MXFP4 repack): each is measured in every type on a sample of
its experts (importance-weighted when ``--imatrix`` covers every tensor), and
``requant.allocate.allocate_choices`` takes the upgrades with the most error removed
per extra byte while the routed experts' average stays at or below ``X``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from ..errors import ShapeError, UsageError
from . import container as C
from .tensors import IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_XXS, MXFP4, Q2_K, Planned

SAMPLE_EXPERTS = 8      # experts measured per stacked tensor for --target-bpw (evenly spaced)
# --target-types' default: every type k3ckpt encodes an expert into, cheapest first, and the
# lossless repack of an MXFP4 source
TARGET_FAMILY = (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, Q2_K, IQ3_XXS, MXFP4)


@dataclass(frozen=True)
class TypeChoice:
    """What ``assign_types`` decided beyond the plain ``--expert-type`` / converter types."""

    overridden: tuple[tuple[str, str], ...] = ()     # (GGUF tensor, type) set by --tensor-type
    fallbacks: tuple[tuple[str, str, str], ...] = ()  # (GGUF tensor, wanted type, type written)
    allocation: object | None = None                 # requant.allocate.Allocation for --target-bpw

    def to_dict(self) -> dict:
        alloc = self.allocation
        return {"overridden": [list(o) for o in self.overridden], "fallbacks": [list(f) for f in self.fallbacks],
                "allocation": None if alloc is None else alloc.to_dict()}


def parse_tensor_types(items: Iterable, types: dict[str, int]) -> tuple[tuple[re.Pattern, int, str], ...]:
    """``["REGEX=TYPE", ...]`` (or ``(regex, type)`` pairs) -> (pattern, ggml type, spelling)."""
    out = []
    for it in items or ():
        if isinstance(it, str):
            rx, sep, t = it.rpartition("=")
            if not sep or not rx:
                raise UsageError(f"--tensor-type must be REGEX=TYPE, found {it!r}")
        else:
            rx, t = it
        try:
            pattern = re.compile(rx)
        except re.error as e:
            raise UsageError(f"bad --tensor-type regular expression {rx!r}: {e}") from None
        key = str(t).strip().lower()
        if key not in types:
            raise UsageError(f"--tensor-type {it!r}: {t!r} is not one of {', '.join(sorted(types))}")
        out.append((pattern, types[key], key))
    return tuple(out)


def fits(ggml_type: int, row: int) -> bool:
    """Whether rows of ``row`` values split into ``ggml_type``'s blocks."""
    return row % C.type_sizes(ggml_type)[0] == 0


def _retyped(p: Planned, ggml_type: int) -> Planned:
    if ggml_type == p.info.ggml_type:
        return p
    return replace(p, info=C.TensorInfo(p.info.name, ggml_type, p.info.shape))


def assign_types(planned: Sequence[Planned], *, expert_type: int, overrides=(), fallback_type: int | None = None,
                 types: dict[str, int]) -> tuple[list[Planned], TypeChoice]:
    """``planned`` with its final types (see the module docstring); ``types``: spelling -> ggml type,
    for messages. ``ShapeError`` for a type its tensor's rows cannot hold, before anything is written."""
    names = {v: k for k, v in types.items()}
    used = [False] * len(overrides)
    out, overridden, fallbacks = [], [], []
    for p in planned:
        t = expert_type if p.recipe.kind == "experts" else p.info.ggml_type
        if len(p.info.shape) >= 2:
            for i, (pattern, ot, spelling) in enumerate(overrides):
                if any(pattern.search(n) for n in (p.info.name, *p.recipe.sources)):
                    used[i] = True
                    t = ot
                    overridden.append((p.info.name, spelling))
                    break
        row = p.info.shape[-1]
        if not fits(t, row):
            if fallback_type is None or not fits(fallback_type, row):
                ok = [n for n, v in sorted(types.items()) if fits(v, row)]
                tried = f"; --fallback-type {names.get(fallback_type)} does not fit either" if fallback_type else ""
                raise ShapeError(f"{p.info.name}: rows of {row} values do not split into {names.get(t, t)} blocks of "
                                 f"{C.type_sizes(t)[0]}{tried}; types that fit: {', '.join(ok)} "
                                 "(--tensor-type, or --fallback-type TYPE to use one where it does not fit)")
            fallbacks.append((p.info.name, names.get(t, str(t)), names.get(fallback_type, str(fallback_type))))
            t = fallback_type
        out.append(_retyped(p, t))
    unused = [overrides[i][0].pattern for i, u in enumerate(used) if not u]
    if unused:
        raise UsageError(f"--tensor-type {unused[0]!r} matches no tensor of two or more dimensions "
                         "(patterns are searched in GGUF and source names)")
    return out, TypeChoice(tuple(overridden), tuple(fallbacks))


def _sample(n: int, k: int) -> list[int]:
    """``min(n, k)`` expert indices spread evenly over ``0 .. n-1``, both ends included."""
    m = min(n, k)
    return sorted({round(i * (n - 1) / max(1, m - 1)) for i in range(m)})


def allocate_experts(ckpt, planned: Sequence[Planned], target_bpw: float, *, types: Sequence[int] | None = None,
                     pinned: Iterable[str] = (), importance=None, sample: int = SAMPLE_EXPERTS,
                     progress: bool = False) -> tuple[list[Planned], object]:
    """``--target-bpw``: each stacked expert tensor takes one of ``types`` (default
    ``TARGET_FAMILY``; MXFP4 only from MXFP4 experts) so that the routed experts' average is at
    most ``target_bpw``, with the least measured error. Tensors in ``pinned`` (named by
    ``--tensor-type``) keep their type and count at their size; a tensor none of ``types`` fits
    keeps its own. ``importance`` (``--imatrix``): errors weighted by it when it covers every
    measured tensor."""
    from tqdm import tqdm

    from ..requant.allocate import Allocation, Item, Option, allocate_choices
    from .pool import expert_importance
    from .produce import expert_piece

    pinned = set(pinned)
    experts = [p for p in planned if p.recipe.kind == "experts"]
    mxfp4_source = all(p.source_dtype == "MXFP4" for p in experts)
    if types is None:
        types = tuple(t for t in TARGET_FAMILY if t != MXFP4 or mxfp4_source)
    elif MXFP4 in types and not mxfp4_source:
        raise UsageError("--target-types mxfp4 is a lossless repack, so it needs MXFP4 experts (Kimi K3, "
                         "gpt-oss); leave it out for this source")
    free = [p for p in experts if p.info.name not in pinned and p.info.ggml_type != MXFP4]
    params = sum(math.prod(p.info.shape) for p in experts)
    fixed_bits = 8 * sum(p.info.nbytes for p in experts if p not in free)
    free_params = sum(math.prod(p.info.shape) for p in free)
    if not free_params:
        raise UsageError("--target-bpw has no expert tensor to choose a type for (all are set by --tensor-type)")
    # the budget over every routed expert, less what the pinned tensors take, spread over the free ones
    free_target = (target_bpw * params - fixed_bits) / free_params
    measured = {}          # (tensor, type) -> (plain sse, weighted sse or None), scaled to all its experts
    for p in tqdm(free, desc="measure", unit="tensor", disable=not progress):
        picks = _sample(p.recipe.arg, sample)
        for t in [t for t in types if fits(t, p.info.shape[-1])] or [p.info.ggml_type]:
            plain, weighted = 0.0, 0.0
            if t != MXFP4:                       # MXFP4 from MXFP4: the same values, no error
                for e in picks:
                    r = expert_piece(ckpt, _retyped(p, t), e, measure=True,
                                     imatrix=expert_importance(importance, p, e)).result
                    plain += r.stats.count * r.stats.err_rms ** 2
                    weighted = None if weighted is None or r.weighted is None else weighted + r.weighted[1]
            scale = p.recipe.arg / len(picks)
            measured[p.info.name, t] = (plain * scale, None if weighted is None else weighted * scale)
    use_weighted = importance is not None and all(w is not None for _, w in measured.values())
    options: dict[str, list] = {}
    for (name, t), (plain, weighted) in measured.items():
        options.setdefault(name, []).append((t, weighted if use_weighted else plain))
    by_name = {p.info.name: p for p in free}
    items = [Item(name, math.prod(by_name[name].info.shape),
                  tuple(Option(C.type_name(t), C.TensorInfo(name, t, by_name[name].info.shape).nbytes, sse)
                        for t, sse in opts))
             for name, opts in options.items()]
    try:
        chosen, _, sse = allocate_choices(items, free_target, what="the expert types")
    except UsageError:
        low = (fixed_bits + sum(8 * min(o.bytes for o in i.options) for i in items)) / params
        raise UsageError(f"--target-bpw {target_bpw} is below what the expert types need ({low:.4f} bpw)") from None
    by_label = {C.type_name(t): t for t in {t for _, t in measured}}
    planned = [_retyped(p, by_label[chosen[p.info.name].label]) if p.info.name in chosen else p for p in planned]
    total = 8 * sum(p.info.nbytes for p in planned if p.recipe.kind == "experts") / params
    keep = frozenset(n for n, o in chosen.items() if o.label == C.type_name(MXFP4))
    return planned, Allocation(keep, float(target_bpw), total, sse,
                               types=tuple(sorted((n, o.label) for n, o in chosen.items())), weighted=use_weighted)
