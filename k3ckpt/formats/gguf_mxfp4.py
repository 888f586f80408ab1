"""MXFP4 in GGUF ``block_mxfp4`` (ggml type 39, ``gguf-mxfp4``).

One block of 32 is 17 bytes: the E8M0 scale byte first, then 16 bytes ``qs``
where ``qs[j]`` holds element j in its low nibble and element j+16 in its high
nibble (split order, like Q4_0; llama.cpp ``ggml-common.h``).  A row of K
values is ``K/32 * 17`` bytes.  ggml decodes ``kvalue * 2^(e-128)`` with
doubled kvalues, which equals ``E2M1 * 2^(e-127)`` for every byte but 0xFF,
with two differences: ggml continues the powers of two at 0xFF (numbers, Inf
for big codes) where the OCP spec (and we) give NaN, and its kvalues table
decodes code 8 as +0 where we give -0.

We encode with OCP FLOOR (``mxfp4.encode_pair``) and repack.  The ggml/gguf-py
encoder differs (ties toward zero, +0 for small negatives, no scale clamp:
docs/formats/mxfp4.md), so its bytes are not expected to match ours.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np

from ..errors import ShapeError
from .base import FormatInfo, Part, output_dtype
from .e2m1 import BLOCK, E8M0_F32, NIBBLE_HI_F32, NIBBLE_LO_F32
from .mxfp4 import MXFP4Format, _decode_dst, _pair_rows, e2m1_value_ref
from . import ids

__all__ = [
    "GGUFMXFP4",
    "GGML_TYPE_MXFP4",
    "BLOCK_BYTES",
    "pair_to_gguf",
    "pair_to_gguf_ref",
    "gguf_to_pair",
    "gguf_to_pair_ref",
    "decode_gguf",
    "decode_gguf_ref",
]

GGML_TYPE_MXFP4 = 39
BLOCK_BYTES = 1 + 16  # E8M0 scale byte + 16 bytes of split-order codes


# --------------------------------------------------------------------------- kernels
def _pair_to_gguf_kernel(packed, scale, out):
    # packed [M, nb*16], scale [M, nb] -> out [M, nb*17]
    m = packed.shape[0]
    nb = scale.shape[1]
    for r in range(m):
        pr = packed[r]
        orow = out[r]
        for g in range(nb):
            p0 = g * 16
            o0 = g * 17
            orow[o0] = scale[r, g]
            for j in range(16):
                shift = np.uint8(4 * (j & 1))
                lo = (pr[p0 + (j >> 1)] >> shift) & np.uint8(15)       # element j
                hi = (pr[p0 + 8 + (j >> 1)] >> shift) & np.uint8(15)   # element j + 16
                orow[o0 + 1 + j] = lo | (hi << np.uint8(4))


def _gguf_to_pair_kernel(blocks, packed, scale):
    # blocks [M, nb*17] -> packed [M, nb*16], scale [M, nb]
    m = packed.shape[0]
    nb = scale.shape[1]
    for r in range(m):
        br = blocks[r]
        pr = packed[r]
        for g in range(nb):
            b0 = g * 17
            scale[r, g] = br[b0]
            for i in range(16):
                # pair byte i holds elements 2i, 2i+1; element e sits in qs[e % 16],
                # low nibble when e < 16, high nibble otherwise
                e0 = 2 * i
                e1 = e0 + 1
                c0 = (br[b0 + 1 + (e0 & 15)] >> np.uint8(4 * (e0 >> 4))) & np.uint8(15)
                c1 = (br[b0 + 1 + (e1 & 15)] >> np.uint8(4 * (e1 >> 4))) & np.uint8(15)
                pr[g * 16 + i] = c0 | (c1 << np.uint8(4))


def _decode_gguf_kernel(blocks, lo, hi, sc, out):
    # blocks [M, nb*17] -> out [M, nb*32] f32 (exact products, as in the pair decoder)
    m, k = out.shape
    nb = k // 32
    for r in range(m):
        br = blocks[r]
        orow = out[r]
        for g in range(nb):
            b0 = g * 17
            s = sc[br[b0]]
            o0 = g * 32
            for j in range(16):
                q = br[b0 + 1 + j]
                orow[o0 + j] = lo[q] * s
                orow[o0 + 16 + j] = hi[q] * s


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(
        pair_to_gguf=njit(_pair_to_gguf_kernel),
        gguf_to_pair=njit(_gguf_to_pair_kernel),
        decode=njit(_decode_gguf_kernel),
    )


# ------------------------------------------------------------------ shape checking
def _gguf_rows(blocks, name) -> tuple[np.ndarray, tuple[int, ...]]:
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8:
        raise ShapeError(f"GGUF MXFP4 blocks must be uint8, found dtype {blocks.dtype}", tensor=name)
    if blocks.ndim < 1 or blocks.shape[-1] % BLOCK_BYTES:
        raise ShapeError(
            f"GGUF MXFP4 rows are a multiple of {BLOCK_BYTES} bytes, found shape {list(blocks.shape)}",
            tensor=name,
        )
    shape = blocks.shape[:-1] + (blocks.shape[-1] // BLOCK_BYTES * BLOCK,)
    m = math.prod(shape[:-1])
    return np.ascontiguousarray(blocks).reshape(m, blocks.shape[-1]), shape


# ----------------------------------------------------------------------- converters
def pair_to_gguf(packed, scale, *, name: str | None = None) -> np.ndarray:
    """Pair layout (packed ``[..., K/2]``, scale ``[..., K/32]``) -> GGUF blocks
    ``[..., K/32*17]`` (numba)."""
    p2, s2, shape = _pair_rows(packed, scale, name)
    out = np.empty((p2.shape[0], s2.shape[1] * BLOCK_BYTES), np.uint8)
    _kernels().pair_to_gguf(p2, s2, out)
    return out.reshape(shape[:-1] + (out.shape[1],))


def pair_to_gguf_ref(packed, scale, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``pair_to_gguf``."""
    p2, s2, shape = _pair_rows(packed, scale, name)
    m, nb = s2.shape
    codes = np.empty((m, nb * BLOCK), np.uint8)
    codes[:, 0::2] = p2 & 0x0F
    codes[:, 1::2] = p2 >> 4
    codes = codes.reshape(m, nb, BLOCK)
    out = np.empty((m, nb, BLOCK_BYTES), np.uint8)
    out[:, :, 0] = s2
    out[:, :, 1:] = codes[:, :, :16] | (codes[:, :, 16:] << 4)
    return out.reshape(shape[:-1] + (nb * BLOCK_BYTES,))


def gguf_to_pair(blocks, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """GGUF blocks ``[..., K/32*17]`` -> (packed ``[..., K/2]``, scale ``[..., K/32]``) (numba)."""
    b2, shape = _gguf_rows(blocks, name)
    m, k = b2.shape[0], shape[-1]
    packed = np.empty((m, k // 2), np.uint8)
    scale = np.empty((m, k // BLOCK), np.uint8)
    _kernels().gguf_to_pair(b2, packed, scale)
    return packed.reshape(shape[:-1] + (k // 2,)), scale.reshape(shape[:-1] + (k // BLOCK,))


def gguf_to_pair_ref(blocks, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Numpy reference of ``gguf_to_pair``."""
    b2, shape = _gguf_rows(blocks, name)
    m, k = b2.shape[0], shape[-1]
    b3 = b2.reshape(m, k // BLOCK, BLOCK_BYTES)
    qs = b3[:, :, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(m, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed.reshape(shape[:-1] + (k // 2,)), b3[:, :, 0].copy().reshape(shape[:-1] + (k // BLOCK,))


def decode_gguf(blocks, *, out=np.float32, dst: np.ndarray | None = None, name: str | None = None) -> np.ndarray:
    """GGUF blocks ``[..., K/32*17]`` -> values ``[..., K]`` (numba, one thread).

    Same values as the pair decoder: exact, 0xFF scale -> NaN block (ggml
    itself would give 2^127 there).
    """
    b2, shape = _gguf_rows(blocks, name)
    dt = output_dtype(out)
    m, k = b2.shape[0], shape[-1]
    if dt == np.float32:
        res = _decode_dst(dst, shape, dt, name)
        _kernels().decode(b2, NIBBLE_LO_F32, NIBBLE_HI_F32, E8M0_F32, res.reshape(m, k))
        return res
    # bfloat16: every value is exact in bfloat16, so a float32 pass then a cast is exact.
    res = _decode_dst(dst, shape, dt, name)
    res[...] = decode_gguf(blocks, name=name).astype(dt)
    return res


def decode_gguf_ref(blocks, *, out=np.float32, dst: np.ndarray | None = None, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_gguf``, from the split-order definition."""
    b2, shape = _gguf_rows(blocks, name)
    dt = output_dtype(out)
    res = _decode_dst(dst, shape, dt, name)
    m, k = b2.shape[0], shape[-1]
    b3 = b2.reshape(m, k // BLOCK, BLOCK_BYTES)
    qs = b3[:, :, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # elements 0..15, then 16..31
    sc = np.ldexp(1.0, b3[:, :, 0].astype(np.int64) - 127)
    sc[b3[:, :, 0] == 0xFF] = np.nan
    with np.errstate(over="ignore", invalid="ignore"):
        v = e2m1_value_ref(codes) * sc[:, :, None]
        res.reshape(m, k)[...] = v.reshape(m, k).astype(np.float32).astype(dt)
    return res


# --------------------------------------------------------------------------- format
class GGUFMXFP4(MXFP4Format):
    """GGUF ``block_mxfp4`` rows (as stored in a .gguf tensor of type 39)."""

    info = FormatInfo(
        id=ids.GGUF_MXFP4,
        title="MXFP4, GGUF block_mxfp4 (ggml type 39)",
        block=BLOCK,
        fields=(("e8m0 scale", 1), ("e2m1 codes", 16)),
        parts=(Part("blocks", "", "U8", (BLOCK_BYTES,)),),
        can_encode=True,
        can_decode=True,
        bf16_exact=True,
        spec="docs/formats/mxfp4.md#gguf-layout-gguf-mxfp4",
        ggml_type="MXFP4",
    )

    def _to_pair(self, rows, *, reference):
        return (gguf_to_pair_ref if reference else gguf_to_pair)(rows["blocks"])

    def _from_pair(self, packed, scale, *, reference):
        return {"blocks": (pair_to_gguf_ref if reference else pair_to_gguf)(packed, scale)}

    def _decode_rows(self, rows, k, *, reference, bf16):
        dec = decode_gguf_ref if reference else decode_gguf
        return dec(rows["blocks"], out="bfloat16" if bf16 else np.float32)
