"""The bytes of one planned GGUF tensor, from the source checkpoint, in pieces.

A routed-expert tensor comes one expert at a time (``expert_piece``: a K3 layer's
is 2.85 GB at IQ2_XS), everything else whole. Conversions follow llama.cpp's converter:
floats go through float32, BF16 -> BF16 and F32 -> F32 keep their bytes, Q8_0
is the ``gguf`` package's own quantizer (the one the converter calls), MXFP4
experts are repacked losslessly (``formats.gguf_mxfp4.pair_to_gguf``) or decoded
and encoded by k3ckpt's encoders (IQ2_XS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..errors import UnsupportedError
from .container import type_id as ggml_type_id, type_name
from .tensors import BF16, F16, F32, MXFP4, Q8_0, Planned

CHUNK_BYTES = 64 << 20   # source bytes read at a time for a tensor copied row by row
DECODED = ("F8_BLOCK", "INT4_PACK")     # quantized sources _load returns as float32

# ggml type -> the registered format that writes ggml's block bytes (the registry's ``FormatInfo.ggml_type``,
# the plain float types aside): from an MXFP4 expert's codes, and from floats (with the part holding the bytes)
_PLAIN = (F32, F16, BF16)


def _block_formats() -> dict[int, object]:
    from ..formats import list_formats

    by_type = {ggml_type_id(info.ggml_type): info for info in list_formats() if info.ggml_type}
    return {t: info for t, info in by_type.items() if t not in _PLAIN}


_FORMATS = _block_formats()
_FROM_MXFP4 = {t: info.id for t, info in _FORMATS.items() if info.mxfp4_codes}
_FROM_FLOAT = {t: (info.id, info.parts[0].role) for t, info in _FORMATS.items()}


def _as_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return raw.astype(np.float32, copy=False)
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return raw.view(np.float16).astype(np.float32)
    raise UnsupportedError(f"no float conversion for a {dtype} tensor")


def float_bytes(x: np.ndarray, ggml_type: int, imatrix=None) -> bytes:
    """float32 ``x`` (rows along the last axis) as ``ggml_type``'s bytes; ``imatrix``: importance
    per column for a weighted encoder (``FormatInfo.weighted``), else unused."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if ggml_type == F32:
        return x.tobytes()
    if ggml_type == F16:
        return x.astype(np.float16).tobytes()
    import gguf

    if ggml_type in (BF16, Q8_0):
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType(ggml_type)).tobytes()
    if ggml_type in _FROM_FLOAT:
        from ..formats import get_format

        fid, part = _FROM_FLOAT[ggml_type]
        fmt = get_format(fid)
        if imatrix is not None and fmt.info.weighted:
            return fmt.from_float(x, imatrix=imatrix)[part].tobytes()
        return fmt.encode(x)[part].tobytes()
    raise UnsupportedError(f"k3ckpt does not encode {type_name(ggml_type)} yet")


def _load(ckpt, sources: tuple[str, ...], src_dtype: str) -> np.ndarray:
    """A source tensor as stored, or float32 for a quantized pair: block FP8 (weight * its 128 x 128
    scale, as the converter dequantizes it: one float32 product) and pack-quantized INT4 (nibble - 8
    times its group's scale, exact in float32, as the converter's ``dequant_packed``)."""
    if src_dtype == "F8_BLOCK":
        from ..formats.fp8_block import decode_fp8_block

        return decode_fp8_block(ckpt.read_raw(sources[0]), ckpt.read_raw(sources[1]), name=sources[0])
    if src_dtype == "INT4_PACK":
        from ..formats.int4_pack import decode_int4

        return decode_int4(ckpt.read_raw(sources[0]), ckpt.read_raw(sources[1]), name=sources[0])
    return ckpt.read_raw(sources[0])


def _copy_bytes(raw: np.ndarray, src_dtype: str, ggml_type: int) -> bytes:
    if src_dtype in DECODED:
        return float_bytes(raw, ggml_type)       # already decoded by _load
    if (src_dtype, ggml_type) in (("BF16", BF16), ("F32", F32), ("F16", F16)):
        return np.ascontiguousarray(raw).tobytes()          # the source's bytes, as the converter keeps them
    return float_bytes(_as_f32(raw, src_dtype), ggml_type)


def _expert(ckpt, srcs: tuple[str, ...], src_dtype: str, ggml_type: int,
            want_ref: bool = False, imatrix=None) -> tuple[bytes, np.ndarray | None]:
    """One expert's bytes and, with ``want_ref``, the float32 source values they stand for."""
    if src_dtype != "MXFP4":
        raw = _load(ckpt, srcs, src_dtype)
        ref = (raw if src_dtype in DECODED else _as_f32(raw, src_dtype)) if want_ref else None
        if imatrix is not None and ggml_type in _FROM_FLOAT:
            return float_bytes(raw if src_dtype in DECODED else _as_f32(raw, src_dtype), ggml_type, imatrix), ref
        return _copy_bytes(raw, src_dtype, ggml_type), ref
    return _pair_expert(ckpt.read_raw(srcs[0]), ckpt.read_raw(srcs[1]), srcs[0], ggml_type, want_ref, imatrix)


# gpt-oss fused experts: which rows of each expert a recipe takes (gate_up_proj interleaves gate, up)
_FUSED_ROWS = {"all": slice(None), "even": slice(0, None, 2), "odd": slice(1, None, 2)}


def fused_pair(ckpt, r, expert: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert ``expert``'s MXFP4 codes ``[rows, K/2]`` and scales ``[rows, K/32]`` from gpt-oss's
    fused ``_blocks`` ``[E, 2I or H, K/32, 16]`` / ``_scales``, its ``r.rows`` rows only (the
    blocks are the pair layout's bytes, ``formats.gptoss``); one expert is read, not the tensor."""
    from ..formats.gptoss import blocks_to_packed

    i = r.first + expert
    n = ckpt.tensors[r.sources[0]].shape[0] if hasattr(ckpt, "tensors") else r.first + r.arg
    if not (0 <= expert < r.arg and r.first + r.arg <= n):
        raise UnsupportedError(f"{r.sources[0]}: expert {expert} of a recipe for experts {r.first}.."
                               f"{r.first + r.arg - 1}, the tensor has {n}")
    read_rows = getattr(ckpt, "read_rows", None)
    blocks, scales = (read_rows(s, i, i + 1)[0] if read_rows else ckpt.read_raw(s)[i] for s in r.sources)
    rows = _FUSED_ROWS[r.rows]
    return blocks_to_packed(np.ascontiguousarray(blocks[rows])), np.ascontiguousarray(scales[rows])


def _pair_expert(packed: np.ndarray, scale: np.ndarray, name: str, ggml_type: int,
                 want_ref: bool = False, imatrix=None) -> tuple[bytes, np.ndarray | None]:
    """An MXFP4 expert's bytes (and, with ``want_ref``, its decoded values), from codes already read:
    a lossless repack, k3ckpt's encoder of the codes, or decoded and re-encoded."""
    from ..formats import get_format
    from ..formats.gguf_mxfp4 import pair_to_gguf
    from ..formats.mxfp4 import decode_pair

    x = decode_pair(packed, scale, name=name) if want_ref or ggml_type not in (MXFP4, *_FROM_MXFP4) else None
    if ggml_type == MXFP4:
        return pair_to_gguf(packed, scale, name=name).tobytes(), x
    if ggml_type in _FROM_MXFP4:
        fmt = get_format(_FROM_MXFP4[ggml_type])
        weights = {"imatrix": imatrix} if imatrix is not None and fmt.info.weighted else {}
        return fmt.from_mxfp4(packed, scale, name=name, **weights)["packed"].tobytes(), x
    return float_bytes(x, ggml_type, imatrix), x


def decode_ggml(data: bytes, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of ``data``, a ``ggml_type`` tensor of numpy ``shape`` (rows last): the decoder
    of the k3ckpt format that encodes the type (``_FROM_FLOAT``), the ``gguf`` package's for the rest."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if ggml_type == F32:
        return raw.view(np.float32).reshape(shape)
    if ggml_type in _FROM_FLOAT:
        from ..formats import get_format

        fid, part = _FROM_FLOAT[ggml_type]
        rows = int(np.prod(shape[:-1]))
        return get_format(fid).decode({part: raw.reshape(rows, len(data) // rows)}).reshape(shape)
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).reshape(shape).astype(np.float32)


@dataclass(frozen=True)
class ExpertPiece:
    """One routed expert's bytes in a stacked expert tensor and, when measured, its row of the
    error report (``requant.results.TensorResult``: our bytes decoded back against the source's
    own values)."""

    expert: int
    data: bytes
    result: object | None = None


PROJECTIONS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down", "ffn_gate_up_exps": "gate_up"}


def expert_piece(ckpt, p: Planned, expert: int, *, measure: bool = False, number: int | None = None,
                 imatrix=None) -> ExpertPiece:
    """Expert ``expert`` of planned expert tensor ``p``; ``measure``: also its error against the
    source values (decoded MXFP4 / FP8 / INT4, or the float weights), from our bytes decoded back.
    ``number``: the expert's number in the report when ``p`` is a one-expert cut of its tensor.
    ``imatrix``: the expert's importance per column (``--imatrix``): a weighted encoder weighs its
    error by it, and the report row carries the weighted error."""
    r, t = p.recipe, p.info.ggml_type
    if r.rows:                                       # gpt-oss: every expert in one fused tensor
        srcs = r.sources
        packed, scale = fused_pair(ckpt, r, expert)
        data, ref = _pair_expert(packed, scale, f"{srcs[0]}[{r.first + expert}]", t, want_ref=measure,
                                 imatrix=imatrix)
    else:
        per = len(r.sources) // r.arg
        srcs = r.sources[expert * per:(expert + 1) * per]
        data, ref = _expert(ckpt, srcs, p.source_dtype, t, want_ref=measure, imatrix=imatrix)
    if not measure:
        return ExpertPiece(expert, data)
    from ..requant.results import TensorResult
    from ..requant.worker import _error, _weighted

    decoded = decode_ggml(data, t, p.info.shape[1:])
    stats, row_bias = _error(ref, decoded)
    projection = PROJECTIONS.get(p.info.name.split(".")[2])
    if r.rows:
        number = r.first + expert if number is None else number
        name = f"{srcs[0].removesuffix('_blocks')}.{number}.{projection}"    # one fused tensor holds them all
    else:
        number = expert if number is None else number
        name = srcs[0].removesuffix("_packed")      # the source's weight, as requant reports name it
    zeros = float(np.count_nonzero(ref == 0)) / ref.size if ref.size else 0.0
    return ExpertPiece(expert, data, TensorResult(
        name=name, layer=p.layer, expert=number, projection=projection,
        format=f"gguf-{type_name(t).lower()}", method=None, params=int(ref.size), bytes=len(data), stats=stats,
        max_row_bias=row_bias, source_zero_fraction=zeros, code_histogram=(), scale_changes=None,
        weighted=_weighted(ref, decoded, imatrix)))


def tensor_pieces(ckpt, p: Planned) -> Iterator[bytes]:
    """The bytes of planned tensor ``p``, in order."""
    r, t = p.recipe, p.info.ggml_type
    if r.kind == "experts":
        for e in range(r.arg):
            yield expert_piece(ckpt, p, e).data
        return
    entries = [ckpt.tensors[s] for s in r.sources]
    if r.kind == "copy":            # row chunks: K3's embedding and output are 2.35 GB each in BF16
        e, src = entries[0], r.sources[0]
        if p.source_dtype == "F8_BLOCK":        # decoded whole: scales span 128-row blocks
            yield _copy_bytes(_load(ckpt, r.sources, p.source_dtype), p.source_dtype, t)
            return
        if len(e.shape) < 2:
            yield _copy_bytes(ckpt.read_raw(src), e.dtype, t)
            return
        rows = e.shape[0]
        step = max(1, CHUNK_BYTES * rows // max(1, e.nbytes))
        for r0 in range(0, rows, step):
            yield _copy_bytes(ckpt.read_rows(src, r0, min(rows, r0 + step)), e.dtype, t)
        return
    if r.kind in ("fuse", "neg_exp"):
        raws = [ckpt.read_raw(s) for s in r.sources]
    if r.kind == "fuse":        # <x>_res_norm * <x>_res_proj, in float32 as the converter multiplies them
        a, b = (_as_f32(x, e.dtype).reshape(-1) for x, e in zip(raws, entries))
        yield float_bytes(a * b, t)
    elif r.kind == "neg_exp":
        # float64 then rounded: numpy's float32 exp is off by an ulp for about 40% of inputs (SIMD
        # paths); the rounded double is the correctly rounded value torch's exp also aims at
        a = _as_f32(raws[0], entries[0].dtype).reshape(-1)[:r.arg].astype(np.float64)
        yield float_bytes((-np.exp(a)).astype(np.float32), t)
    elif r.kind in ("k_b", "v_b"):
        heads, src_dtype = r.arg, p.source_dtype
        whole = _load(ckpt, r.sources, src_dtype)
        raw = whole.reshape(heads, -1, whole.shape[-1])           # [heads, nope + v, kv_lora]
        nope = p.info.shape[2] if r.kind == "k_b" else raw.shape[1] - p.info.shape[1]
        part = raw[:, :nope, :].transpose(0, 2, 1) if r.kind == "k_b" else raw[:, nope:, :]
        yield _copy_bytes(np.ascontiguousarray(part), src_dtype, t)
    elif r.kind == "deinterleave":  # gpt-oss gate_up_proj_bias [E, 2I]: gate the even entries, up the odd
        raw = ckpt.read_raw(r.sources[0])
        yield _copy_bytes(np.ascontiguousarray(raw[..., r.arg::2]), entries[0].dtype, t)
    else:
        raise AssertionError(f"unknown recipe {r.kind!r}")
