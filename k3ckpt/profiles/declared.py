"""Which tensors a k3ckpt-written config declares in which format.

``k3ckpt requant`` writes a ``quantization_config`` whose groups name a format
and the logical weights stored in it (``k3ckpt.checkpoint.qconfig``).  The stored
suffixes cannot tell moet-w2 from MXFP4 (both ``.weight_packed`` U8 +
``.weight_scale`` U8), nor a gguf-iq2_xs ``.weight_packed`` from MXFP4 codes;
the config's targets can.  ``declared_parts`` maps each such tensor to its
format and part role; the profile uses it before the suffix-and-dtype rules,
and the header is still checked against it (``check_declared``).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from .roles import QUANTIZED_STORAGE

# The literal form ``targets_for`` writes for a single weight: re:^<escaped name>$
_META = re.compile(r"\\(.)|[.^$*+?{}\[\]|()]")


def _literal(pattern: str) -> str | None:
    """The one name an anchored pattern matches when it is an escaped literal, else None."""
    if not (pattern.startswith("^") and pattern.endswith("$")) or pattern.endswith("\\$"):
        return None
    body = pattern[1:-1]
    out: list[str] = []
    pos = 0
    for m in _META.finditer(body):
        if m.group(1) is None:   # an unescaped metacharacter: a real regex
            return None
        out.append(body[pos:m.start()])
        out.append(m.group(1))
        pos = m.end()
    out.append(body[pos:])
    return "".join(out)


def declared_parts(config: Mapping | None, names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``{tensor name: (format id, part role)}`` for every tensor of ``names`` that a
    k3ckpt ``quantization_config`` group targets; ``{}`` for any other config.

    Groups naming a format this build does not know are left out (their tensors
    are classified by suffix and dtype).  Literal targets (a mixed ``--target-bpw``
    output lists weights one by one) are a set lookup, so the cost is one suffix
    test per name plus a regex match only for template patterns."""
    from ..checkpoint.qconfig import declared_groups, logical_weight_name

    declared = declared_groups(config)
    if not declared:   # not a k3ckpt output: spare the format registry's import
        return {}
    from ..errors import K3ckptError
    from ..formats import get_format

    groups = []
    for fid, pats in declared:
        try:
            fmt = get_format(fid)
        except K3ckptError:
            continue
        literals, regexes = set(), []
        for p in pats:
            lit = _literal(p.pattern)
            if lit is None:
                regexes.append(p)
            else:
                literals.add(lit)
        info = fmt.info
        first = info.parts[0].suffix
        suffixes = [(p.suffix, p.role) for p in info.parts] + [(t.suffix, t.role) for t in info.tensor_parts]
        suffixes.sort(key=lambda sr: -len(sr[0]))
        groups.append((fid, first, suffixes, literals, regexes))
    if not groups:
        return {}
    out: dict[str, tuple[str, str]] = {}
    for name in names:
        for fid, first, suffixes, literals, regexes in groups:
            for suffix, role in suffixes:
                if suffix and not (name.endswith(suffix) and len(name) > len(suffix)):
                    continue
                w = logical_weight_name(name[: len(name) - len(suffix)] if suffix else name, first)
                if w in literals or any(p.fullmatch(w) for p in regexes):
                    out[name] = (fid, role)
                break   # the longest suffix that fits decides the role, as in Format.match_name
            if name in out:
                break
    return out


def header_disagrees(fid: str, role: str, dtype: str) -> bool:
    """Whether a tensor the config declares as part ``role`` of ``fid`` has another dtype
    in the header (the config then misdescribes the file; inspect says so)."""
    from ..formats import get_format

    info = get_format(fid).info
    want = {p.role: p.dtype for p in info.parts}
    want.update((t.role, t.dtype) for t in info.tensor_parts)
    return want.get(role, dtype) != dtype and not (want.get(role) == "I64" and dtype == "I32")


def coded_params(storage: str, part: str, numel: int) -> int | None:
    """Logical weights in a tensor of ``numel`` stored elements that holds the codes
    of a registered format (its ``parts[0]``: ``packed`` or ``blocks``), from the
    format table: ``numel * block / elements per block`` (2 per byte for MXFP4,
    4 for moet-w2, 256 per 74 bytes for IQ2_XS).  None for any other tensor, and for
    the storages the suffix rules name (``roles.QUANTIZED_STORAGE``): their callers
    count those by dtype, which spares ``inspect`` of a source checkpoint the
    format registry's import."""
    if part not in ("packed", "blocks") or storage in QUANTIZED_STORAGE:
        return None
    first = _first_part(storage)
    if first is None or part != first[0] or part not in ("packed", "blocks"):
        return None
    return numel * first[1] // first[2]


_FIRST: dict[str, tuple[str, int, int] | None] = {}


def _first_part(fid: str) -> tuple[str, int, int] | None:
    """(role, block, stored elements per block) of a format's first part; None if not registered."""
    hit = _FIRST.get(fid, False)
    if hit is False:
        from ..errors import K3ckptError
        from ..formats import get_format

        try:
            info = get_format(fid).info
        except K3ckptError:
            hit = None
        else:
            p = info.parts[0]
            n = 1
            for d in p.per_block:
                n *= d
            hit = (p.role, info.block, n)
        _FIRST[fid] = hit
    return hit
