"""Which stored weights ``k3ckpt requant`` converts, and how it gets their float32 values.

Routed-expert weights may be stored as

- MXFP4: ``mxfp4-pack-quantized`` (Kimi K3 pair layout) or ``gpt-oss-mxfp4``
  (fused ``_blocks`` / ``_scales``); the 2.25-bpw encoders start from their
  codes (``worker.requant_weight``), nothing here decodes them;
- block FP8 (``fp8-block``: DeepSeek-V3, Kimi K2), INT4 ``int4-pack-quantized``
  (Kimi K2-Thinking), NVFP4 (``nvfp4``: compressed-tensors naming,
  ``nvfp4-modelopt``: ModelOpt naming), or plain ``bf16`` / ``f16`` / ``f32``.
  These all take one path: decode to float32 with the registry decoder, then
  encode (``worker.requant_floats``).  Error is measured against those decoded
  values, the source's own.

``find_weights`` groups a checkpoint's tensors into logical weights: the profile
says which tensors belong to routed experts and which logical weight each is a
part of; the parts present decide the storage format (``_format_of``) and the
format's part names give each tensor its role.  ``decode_slice`` turns one
weight -- or one expert of a fused ``[E, ...]`` tensor -- into float32
``[N, K]``, reading and decoding row chunks so its temporaries stay small
(the result itself is one expert tensor, which every encoder needs whole).

Fused float tensors are read in transformers' gpt-oss orientation
``[E, in, out]`` (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]) and
transposed to ``[out, in]``; other fused float layouts are refused rather
than guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..errors import InvalidFileError, ShapeError, UnsupportedError
from ..formats import ids

MXFP4_SOURCES = ids.MXFP4_LAYOUTS
FLOAT_SOURCES = (ids.FP8_BLOCK, ids.INT4_PACK, ids.NVFP4, ids.NVFP4_MODELOPT, ids.BF16, ids.F16, ids.F32)
ACCEPTED = MXFP4_SOURCES + FLOAT_SOURCES
_PLAIN = (ids.BF16, ids.F16, ids.F32)
_CHUNK_BYTES = 16 << 20   # decoded float32 bytes per row chunk
_FP8_TILE = 128


@dataclass(frozen=True, slots=True)
class SourceSlice:
    """Where one weight's values are stored: a whole weight, or one expert of a fused tensor."""

    format: str                            # registry id of the stored weight
    parts: tuple[tuple[str, str], ...]     # (role, source tensor) in the format's role order
    shape: tuple[int, ...]                 # stored logical shape: [N, K], or [E, A, B] when fused
    expert: int | None = None              # index along a fused tensor's expert axis
    transposed: bool = False               # fused [E, in, out]: values are transposed to [out, in]

    def tensor(self, role: str) -> str:
        return dict(self.parts)[role]

    @property
    def out_shape(self) -> tuple[int, int]:
        """The weight's [N, K] (rows = output features) after any transpose."""
        a, b = self.shape[-2:]
        return (b, a) if self.transposed else (a, b)

    def stored_bytes(self, ckpt) -> int:
        """Source bytes this slice stands for (a fused tensor's bytes split evenly over its experts)."""
        total = sum(ckpt.entry(t).nbytes for _, t in self.parts)
        return total // self.shape[0] if self.expert is not None else total


@dataclass(frozen=True, slots=True)
class SourceWeight:
    """A routed-expert weight (or fused all-expert tensor) as found in the source."""

    name: str                              # logical weight name (profile's TensorRole.weight)
    layer: int | None
    expert: int | None                     # None for fused tensors
    projection: str | None
    format: str                            # registry id, one of ACCEPTED
    parts: tuple[tuple[str, str], ...]     # (role, tensor)
    shape: tuple[int, ...]                 # stored logical shape, [N, K] or [E, A, B]
    routed: bool
    transposed: bool = False

    @property
    def fused(self) -> bool:
        """One tensor holds every expert (gpt-oss)."""
        return len(self.shape) == 3 or self.format == ids.GPT_OSS_MXFP4

    @property
    def mxfp4(self) -> bool:
        return self.format in MXFP4_SOURCES

    def part(self, role: str) -> str:
        for r, tensor in self.parts:
            if r == role:
                return tensor
        raise KeyError(role)

    def slice(self, expert: int | None) -> SourceSlice:
        return SourceSlice(self.format, self.parts, self.shape, expert, self.transposed)


# ------------------------------------------------------------------------------------- finding


def _format_of(parts: Mapping[str, tuple[str, str, str]]) -> str | None:
    """The registry id of a group of parts ({profile part: (tensor, dtype, storage)}), None if
    it is not a weight we convert (a bias, an unknown raw tensor, plain FP8 without scales)."""
    storages = {st for _, _, st in parts.values()}
    for fid in (ids.GPT_OSS_MXFP4, ids.MXFP4_PACK):
        if fid in storages:
            return fid
    if ids.FP8_BLOCK in storages or "scale_inv" in parts:
        return ids.FP8_BLOCK
    if ids.INT4_PACK in storages:
        return ids.INT4_PACK
    weight = parts.get("weight")
    if ids.NVFP4_MODELOPT in storages or "scale_2" in parts or (
            ids.NVFP4 in storages and weight is not None and weight[1] == "U8"):
        return ids.NVFP4_MODELOPT   # ModelOpt stores the codes as a plain ``weight`` U8
    if ids.NVFP4 in storages:
        return ids.NVFP4
    if set(parts) == {"weight"} and weight[2] in _PLAIN:
        return weight[2]
    return None


def _roles(fmt, weight: str, tensors: Sequence[str]) -> dict[str, str]:
    """role -> tensor, each tensor placed by the format's part suffixes."""
    out: dict[str, str] = {}
    for t in tensors:
        hit = fmt.match_name(t)
        if hit is None and fmt.id in MXFP4_SOURCES:
            continue   # e.g. a compressed-tensors ``weight_shape`` beside MXFP4 parts: copied unchanged
        if hit is None or hit[1] in out:
            raise UnsupportedError(f"{fmt.id} weight has a tensor k3ckpt does not know how to use "
                                   f"(parts: {sorted(tensors)})", tensor=t)
        out[hit[1]] = t
    missing = [r for r in fmt.info.roles if r not in out]
    if missing:
        have = ", ".join(sorted(tensors))
        raise InvalidFileError(f"{fmt.id} weight lacks its {missing[0]} tensor (found only {have})", tensor=weight)
    return out


def _stored_shape(ckpt, fmt, roles: Mapping[str, str], weight: str) -> tuple[int, ...]:
    """Logical shape from the headers, after checking every per-block part against it."""
    if fmt.id == ids.FP8_BLOCK:
        logical = tuple(ckpt.entry(roles["weight"]).shape)
    else:
        first = fmt.info.parts[0]
        shape = tuple(ckpt.entry(roles[first.role]).shape)
        nt = len(first.per_block)
        if len(shape) < nt or shape[-nt] % first.per_block[0] or shape[len(shape) - nt + 1:] != first.per_block[1:]:
            raise ShapeError(f"{fmt.id} part {first.role!r} {list(shape)} does not fit its blocks", tensor=weight)
        logical = shape[:-nt] + (shape[-nt] // first.per_block[0] * fmt.info.block,)
    if len(logical) not in (2, 3):
        raise ShapeError(f"a routed-expert weight must be [N, K] or fused [E, N, K], found {list(logical)}",
                         tensor=weight)
    specs = fmt.part_specs(logical, name=weight)
    for p in fmt.info.parts:
        e = ckpt.entry(roles[p.role])
        if tuple(e.shape) != specs[p.role].shape or e.dtype != p.dtype:
            raise ShapeError(f"{fmt.id} part {p.role!r}: expected {p.dtype} {list(specs[p.role].shape)} for "
                             f"logical shape {list(logical)}, found {e.dtype} {list(e.shape)}", tensor=roles[p.role])
    return logical


def _model_type(config) -> str | None:
    if not isinstance(config, Mapping):
        return None
    tc = config.get("text_config")
    return config.get("model_type") if not isinstance(tc, Mapping) else tc.get("model_type", config.get("model_type"))


def group_parts(ckpt, profile, extra_rx: Sequence[str] = ()) -> tuple[dict[str, dict], dict[str, tuple]]:
    """The tensors ``find_weights`` looks at, grouped by logical weight: ``{weight: {part:
    (tensor, dtype, storage)}}`` and ``{weight: (layer, expert, projection, routed)}``, in
    first-tensor order.  Routed-expert tensors, and with ``extra_rx`` every MXFP4 tensor;
    biases never.  What ``Profile.classify`` says of each name, computed in one pass over all
    of them (``Profile.locate_many``): a K3 has 497,220 tensors."""
    from ..profiles.roles import Role

    groups: dict[str, dict[str, tuple[str, str, str]]] = {}
    meta: dict[str, tuple] = {}
    names = list(ckpt.tensors)
    dtype_ids: dict[str, int] = {}
    dtype_of = np.array([dtype_ids.setdefault(e.dtype, len(dtype_ids)) for e in ckpt.tensors.values()],
                        dtype=np.int64)
    dtype_names = list(dtype_ids)
    entries, which, layers, experts = profile.locate_many(names, dtype_of, dtype_names)
    wanted = np.array([e.part != "bias" and (e.role == Role.ROUTED_EXPERT or (bool(extra_rx) and e.storage
                                                                             in MXFP4_SOURCES))
                       for e in entries], dtype=bool)
    which_l, layer_l, expert_l, dtype_l = which.tolist(), layers.tolist(), experts.tolist(), dtype_of.tolist()
    for i in np.flatnonzero(wanted[which]).tolist() if len(entries) else ():
        name, e = names[i], entries[which_l[i]]
        weight = name[: len(name) - e.cut] if e.cut else name
        g = groups.setdefault(weight, {})
        if e.part in g:
            raise InvalidFileError(f"two tensors are the {e.part!r} part of one weight: {g[e.part][0]} and {name}",
                                   tensor=weight)
        g[e.part] = (name, dtype_names[dtype_l[i]], e.storage)
        meta.setdefault(weight, (None if layer_l[i] < 0 else layer_l[i], None if expert_l[i] < 0 else expert_l[i],
                                 e.projection, e.role == Role.ROUTED_EXPERT))
    return groups, meta


def find_weights(ckpt, extra_rx: Sequence[str] = ()) -> list[SourceWeight]:
    """Every routed-expert weight of ``ckpt`` in a format of ``ACCEPTED`` (in first-tensor
    order), plus non-routed MXFP4 weights whose logical name one of ``extra_rx`` finds.

    Refuses weights with missing or surplus parts, parts whose shapes disagree, and
    fused float tensors outside gpt-oss (their orientation is not knowable from names)."""
    from ..formats import get_format
    from ..profiles import detect

    groups, meta = group_parts(ckpt, detect(ckpt.config, ckpt.tensors.keys()), extra_rx)
    gpt_oss = _model_type(ckpt.config) == "gpt_oss"
    out = []
    for weight, parts in groups.items():
        fid = _format_of(parts)
        layer, expert, projection, routed = meta[weight]
        if fid is None or (not routed and fid not in MXFP4_SOURCES):
            continue
        if not routed and not any(re.search(rx, weight) for rx in extra_rx):
            continue
        if fid in _PLAIN and len(ckpt.entry(parts["weight"][0]).shape) not in (2, 3):
            continue   # a per-expert scalar or vector (e.g. a scale) is not a matrix to convert: copied
        fmt = get_format(fid)
        roles = _roles(fmt, weight, [t for t, _, _ in parts.values()])
        if fid in MXFP4_SOURCES:
            shape = ()   # plan.py checks MXFP4 parts with its own, older messages
        else:
            shape = _stored_shape(ckpt, fmt, roles, weight)
        transposed = False
        if len(shape) == 3:
            if fid not in _PLAIN or not gpt_oss:
                raise UnsupportedError(f"fused {fid} expert tensors {list(shape)} are read only as gpt-oss's "
                                       "[E, in, out] float tensors (transformers GptOssExperts)", tensor=weight)
            transposed = True
        ordered = tuple((r, roles[r]) for r in fmt.info.roles)
        out.append(SourceWeight(weight, layer, expert, projection, fid, ordered, shape, routed, transposed))
    return out


# ------------------------------------------------------------------------------------ decoding


def _rows_step(s: SourceSlice, k: int) -> int:
    step = max(1, _CHUNK_BYTES // (4 * max(k, 1)))
    if s.format == ids.FP8_BLOCK:   # scale rows cover 128 weight rows each
        step = max(_FP8_TILE, step // _FP8_TILE * _FP8_TILE)
    return step


def read_slice(ckpt, s: SourceSlice, r0: int | None = None, r1: int | None = None) -> dict[str, np.ndarray]:
    """The raw stored parts of slice ``s`` by role (rows ``[r0, r1)`` of an unfused weight when given)."""
    from ..formats import get_format

    fmt = get_format(s.format)
    whole = {t.role for t in fmt.info.tensor_parts}
    out = {}
    for role, t in s.parts:
        if s.expert is not None:
            out[role] = ckpt.read_rows(t, s.expert, s.expert + 1)[0]
        elif role in whole or r0 is None:
            out[role] = ckpt.read_raw(t)
        elif s.format == ids.FP8_BLOCK and role == "scale_inv":
            out[role] = ckpt.read_rows(t, r0 // _FP8_TILE, -(-r1 // _FP8_TILE))
        else:
            out[role] = ckpt.read_rows(t, r0, r1)
    return out


def decode_parts(s: SourceSlice, raw: Mapping[str, np.ndarray], *, name: str) -> np.ndarray:
    """float32 ``[N, K]`` of slice ``s`` from its raw parts (as ``read_slice`` returns them)."""
    from ..formats import get_format

    x = get_format(s.format).decode(dict(raw), out=np.float32, name=name)
    if s.transposed:
        x = np.ascontiguousarray(x.T)
    return x


def decode_slice(ckpt, s: SourceSlice, *, name: str) -> np.ndarray:
    """float32 ``[N, K]`` of slice ``s``, read and decoded a row chunk at a time."""
    if s.expert is not None:    # one expert of a fused tensor: bounded by one expert already
        return decode_parts(s, read_slice(ckpt, s), name=name)
    n, k = s.shape
    out = np.empty((n, k), np.float32)
    step = _rows_step(s, k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        out[r0:r1] = decode_parts(s, read_slice(ckpt, s, r0, r1), name=name)
    return out


def join_rows(xs: Sequence[np.ndarray]) -> np.ndarray:
    """One slice as is; gate and up interleaved by row (gpt-oss's ``gate_up_proj``: row 2i is
    gate row i, row 2i+1 up row i)."""
    if len(xs) == 1:
        return xs[0]
    from ..formats.gptoss import interleave_gate_up

    gate, up = xs
    return interleave_gate_up(gate, up, axis=-2)


__all__ = ["ACCEPTED", "FLOAT_SOURCES", "MXFP4_SOURCES", "SourceSlice", "SourceWeight", "decode_parts",
           "decode_slice", "find_weights", "join_rows", "read_slice"]
