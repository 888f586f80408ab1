"""Each GGUF tensor's ggml type: ``--expert-type``, ``--tensor-type``, ``--fallback-type``, ``--target-bpw``.

An architecture module plans every tensor with the converter's types (the routed
experts as F32, which every row size holds); ``assign_types`` then gives the
experts ``--expert-type``, applies the ``REGEX=TYPE`` overrides (first match wins,
on the GGUF name or any source name; tensors of two or more dimensions only, as
llama-quantize's ``--tensor-type``), and checks that each type's blocks divide the
tensor's rows. A type that does not fit is an error naming the types that do,
unless ``--fallback-type`` was given and fits: then that tensor takes it and the
result says so. Nothing is ever changed silently.

``--target-bpw X`` mixes the expert type with a lossless MXFP4 repack of an MXFP4
source: each stacked expert tensor (one layer's projection, the unit a GGUF type
applies to) is measured on a sample of its experts, and ``requant.allocate`` keeps
the tensors with the most error per extra byte in MXFP4 while the routed experts'
average stays at or below ``X``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from ..errors import ShapeError, UsageError
from . import container as C
from .tensors import MXFP4, Planned

SAMPLE_EXPERTS = 8      # experts measured per stacked tensor for --target-bpw (evenly spaced)


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


def allocate_experts(ckpt, planned: Sequence[Planned], target_bpw: float, *, pinned: Iterable[str] = (),
                     sample: int = SAMPLE_EXPERTS, progress: bool = False) -> tuple[list[Planned], object]:
    """``--target-bpw``: keep the stacked expert tensors with the most error per extra byte as
    MXFP4 (a lossless repack) while the routed experts' average is at most ``target_bpw``.
    Tensors in ``pinned`` (named by ``--tensor-type``) keep their type and count at their size."""
    from tqdm import tqdm

    from ..requant.allocate import Candidate, allocate
    from .produce import expert_piece

    pinned = set(pinned)
    experts = [p for p in planned if p.recipe.kind == "experts"]
    if any(p.source_dtype != "MXFP4" for p in experts):
        raise UsageError("--target-bpw mixes the expert type with a lossless MXFP4 repack, so it needs MXFP4 "
                         "experts (Kimi K3, gpt-oss); pick types with --tensor-type instead")
    free = [p for p in experts if p.info.name not in pinned and p.info.ggml_type != MXFP4]
    params = sum(math.prod(p.info.shape) for p in experts)
    fixed_bits = 8 * sum(p.info.nbytes for p in experts if p not in free)
    free_params = sum(math.prod(p.info.shape) for p in free)
    if not free_params:
        raise UsageError("--target-bpw has no expert tensor to choose a type for (all are set by --tensor-type)")
    # the budget over every routed expert, less what the pinned tensors take, spread over the free ones
    free_target = (target_bpw * params - fixed_bits) / free_params
    cands = []
    for p in tqdm(free, desc="measure", unit="tensor", disable=not progress):
        picks = _sample(p.recipe.arg, sample)
        sse = sum(s.count * s.err_rms ** 2 for s in (expert_piece(ckpt, p, e, measure=True).result.stats
                                                    for e in picks))
        kept = C.TensorInfo(p.info.name, MXFP4, p.info.shape)
        cands.append(Candidate(p.info.name, math.prod(p.info.shape), kept.nbytes, p.info.nbytes,
                               sse * p.recipe.arg / len(picks)))
    try:
        alloc = allocate(cands, free_target)
    except UsageError:
        low = (fixed_bits + 8 * sum(p.info.nbytes for p in free)) / params
        raise UsageError(f"--target-bpw {target_bpw} is below what the expert types need ({low:.4f} bpw)") from None
    planned = [_retyped(p, MXFP4) if p.info.name in alloc.keep else p for p in planned]
    total = 8 * sum(p.info.nbytes for p in planned if p.recipe.kind == "experts") / params
    return planned, replace(alloc, target_bpw=float(target_bpw), bpw=total)
