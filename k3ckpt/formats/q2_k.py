"""llama.cpp Q2_K (``gguf-q2_k``): 2.625 bpw, 256-weight super-blocks of 16 affine sub-blocks.

Stored per weight ``[..., K]`` (K a multiple of 256; spec: docs/formats/q2_k.md)
as one tensor ``.weight_packed`` U8 ``[..., K/256*84]``: each row is its
super-blocks in order, each the 84 bytes of GGML's ``block_q2_K``
(ggml-common.h), little-endian:

- bytes 0-15: ``scales``, one byte per sub-block of 16 weights: low nibble the
  scale ``sc``, high nibble the min ``mc``;
- bytes 16-79: ``qs``, 2-bit codes: weight ``128 h + 32 j + l`` (h < 2, j < 4,
  l < 32) is bits ``2j .. 2j+1`` of byte ``16 + 32 h + l``; it belongs to
  sub-block ``8 h + 2 j + l // 16``;
- bytes 80-81: ``d``, fp16;  bytes 82-83: ``dmin``, fp16.

value = fp32(fp32(fp32(d * sc) * q) - fp32(dmin * mc))

in float32, in that order: what gguf-py's ``Q2_K.dequantize_blocks`` and
llama.cpp's ``dequantize_row_q2_K`` compute (``d * sc`` and ``(d * sc) * q``
are exact: 11 + 4 + 2 significant bits), so ``gguf.quants.dequantize`` of a
row's bytes equals our decode bit for bit.
"""

from __future__ import annotations

import functools
import types

import numpy as np

from .base import FormatInfo, Part
from .ggml_blocks import QK, GGMLBlockFormat, check_blocks, decode_with, f16_table
from . import ids

__all__ = ["BLOCK_BYTES", "Q2K", "QK", "check_q2k", "code_order", "decode_q2k", "decode_q2k_ref"]

BLOCK_BYTES = 16 + 64 + 2 + 2   # scale/min nibbles per 16, 2-bit codes, fp16 d, fp16 dmin = 84


@functools.cache
def code_order() -> tuple[np.ndarray, np.ndarray]:
    """``(byte, shift)`` int64 [256]: weight i's code is ``(qs[byte[i]] >> shift[i]) & 3``
    (``qs`` = block bytes 16-79; ggml's ``quantize_row_q2_K`` packing)."""
    i = np.arange(QK)
    byte = 32 * (i // 128) + i % 32
    shift = 2 * ((i % 128) // 32)
    for a in (byte, shift):
        a.flags.writeable = False
    return byte, shift


# ------------------------------------------------------------------ kernels
def _decode_kernel(packed, f16, out):
    # packed [M, nb*84] u8 -> out [M, nb*256] f32; float32 ops in ggml's order.
    for r in range(packed.shape[0]):
        for b in range(packed.shape[1] // 84):
            o = b * 84
            d = f16[np.int64(packed[r, o + 80]) | (np.int64(packed[r, o + 81]) << 8)]
            dmin = f16[np.int64(packed[r, o + 82]) | (np.int64(packed[r, o + 83]) << 8)]
            for h in range(2):
                for j in range(4):
                    for half in range(2):
                        sb = 8 * h + 2 * j + half
                        sc = packed[r, o + sb]
                        dl = d * np.float32(sc & 15)
                        ml = dmin * np.float32(sc >> 4)
                        x0 = b * 256 + 128 * h + 32 * j + 16 * half
                        q0 = o + 16 + 32 * h + 16 * half
                        for l in range(16):
                            q = (packed[r, q0 + l] >> (2 * j)) & 3
                            out[r, x0 + l] = dl * np.float32(q) - ml


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel))


# ---------------------------------------------------------------- functions
def check_q2k(packed, *, name: str | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate Q2_K bytes U8 ``[..., K/256*84]``; return C-contiguous rows ``[M, K/256*84]`` and ``[..., K]``."""
    return check_blocks(packed, BLOCK_BYTES, "Q2_K", name=name)


def decode_q2k(packed, *, name: str | None = None) -> np.ndarray:
    """Q2_K bytes U8 ``[..., K/256*84]`` -> float32 ``[..., K]`` (numba, one thread)."""
    p, shape = check_q2k(packed, name=name)
    return decode_with(_kernels().decode, p, shape, f16_table())


def decode_q2k_ref(packed, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_q2k`` (same float32 operations, vectorised)."""
    p, shape = check_q2k(packed, name=name)
    blocks = p.reshape(-1, BLOCK_BYTES)
    sc = blocks[:, 0:16]
    d = blocks[:, 80:82].copy().view("<f2").astype(np.float32)              # [n, 1]
    dmin = blocks[:, 82:84].copy().view("<f2").astype(np.float32)
    byte, shift = code_order()
    q = ((blocks[:, 16 + byte] >> shift.astype(np.uint8)) & 3).astype(np.float32)   # [n, 256]
    with np.errstate(invalid="ignore", over="ignore"):                       # inf / NaN d stay inf / NaN
        dl = d * (sc & 15).astype(np.float32)                                # [n, 16]
        ml = dmin * (sc >> 4).astype(np.float32)
        vals = np.repeat(dl, 16, axis=1) * q - np.repeat(ml, 16, axis=1)
    return vals.astype(np.float32).reshape(shape)


# ------------------------------------------------------------------- format
class Q2K(GGMLBlockFormat):
    """``gguf-q2_k``: llama.cpp Q2_K blocks, row-major, one U8 tensor."""

    info = FormatInfo(
        id=ids.GGUF_Q2_K,
        title="llama.cpp Q2_K 2.625 bpw: 2-bit codes, 4-bit scale + 4-bit min per 16, fp16 d and dmin",
        block=QK,
        fields=(("4-bit scale + 4-bit min per 16", 16), ("qs: 2-bit codes", 64), ("fp16 d", 2), ("fp16 dmin", 2)),
        parts=(Part("packed", ".weight_packed", "U8", (BLOCK_BYTES,)),),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,   # d * sc * q - dmin * mc carries up to 24 significant bits
        spec="docs/formats/q2_k.md#stored-tensors",
        mxfp4_codes=True,
        ggml_type="Q2_K",
        weighted=True,
    )

    label = "Q2_K"
    encoder = "q2_k"
    decoders = (decode_q2k, decode_q2k_ref)
