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
import math
import types

import numpy as np

from ..errors import ShapeError
from .base import Format, FormatInfo, Part

__all__ = ["BLOCK_BYTES", "Q2K", "QK", "check_q2k", "code_order", "decode_q2k", "decode_q2k_ref"]

QK = 256
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


@functools.cache
def _f16_table() -> np.ndarray:
    t = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    t.flags.writeable = False
    return t


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
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim < 1 or packed.shape[-1] % BLOCK_BYTES:
        raise ShapeError(
            f"Q2_K bytes must be uint8 [..., K/256*{BLOCK_BYTES}], found {packed.dtype} {list(packed.shape)}",
            tensor=name,
        )
    m = math.prod(packed.shape[:-1])
    shape = packed.shape[:-1] + (packed.shape[-1] // BLOCK_BYTES * QK,)
    return np.ascontiguousarray(packed).reshape(m, packed.shape[-1]), shape


def decode_q2k(packed, *, name: str | None = None) -> np.ndarray:
    """Q2_K bytes U8 ``[..., K/256*84]`` -> float32 ``[..., K]`` (numba, one thread)."""
    p, shape = check_q2k(packed, name=name)
    out = np.empty((p.shape[0], shape[-1]), np.float32)
    _kernels().decode(p, _f16_table(), out)
    return out.reshape(shape)


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
class Q2K(Format):
    """``gguf-q2_k``: llama.cpp Q2_K blocks, row-major, one U8 tensor."""

    info = FormatInfo(
        id="gguf-q2_k",
        title="llama.cpp Q2_K 2.625 bpw: 2-bit codes, 4-bit scale + 4-bit min per 16, fp16 d and dmin",
        block=QK,
        fields=(("4-bit scale + 4-bit min per 16", 16), ("qs: 2-bit codes", 64), ("fp16 d", 2), ("fp16 dmin", 2)),
        parts=(Part("packed", ".weight_packed", "U8", (BLOCK_BYTES,)),),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,   # d * sc * q - dmin * mc carries up to 24 significant bits
        spec="docs/formats/q2_k.md#stored-tensors",
    )

    def check_logical_shape(self, shape, *, name: str | None = None) -> tuple[int, ...]:
        shape = tuple(int(v) for v in shape)
        if shape and shape[-1] >= 0 and shape[-1] % QK:
            raise ShapeError(
                f"Q2_K is not applicable: it stores super-blocks of {QK} weights along the last axis and "
                f"shape {list(shape)} has K = {shape[-1]}, not a multiple of {QK} "
                "(gpt-oss's 2880 is not; K3's 3584 and 3072 are)",
                tensor=name,
            )
        return super().check_logical_shape(shape, name=name)

    def _decode_rows(self, rows, k, *, reference, bf16):
        dec = decode_q2k_ref if reference else decode_q2k
        return dec(rows["packed"])

    def _encode_rows(self, x, *, reference, name, shape):
        from ..requant import q2_k

        enc = q2_k.encode_reference if reference else q2_k.encode
        return {"packed": enc(x, name=name)}

    def from_float(self, x, *, imatrix=None, name: str | None = None) -> dict[str, np.ndarray]:
        """float ``[..., K]`` -> ``{"packed": U8 [..., K/256*84]}`` (numba encoder).

        ``imatrix``: float32 ``[K]`` importance per column (``k3ckpt.imatrix``), or None for all ones."""
        from ..requant import q2_k
        from .base import as_float32_input

        x = as_float32_input(x, name=name)
        self.check_logical_shape(x.shape, name=name)
        return {"packed": q2_k.encode(x, imatrix=imatrix, name=name)}

    def from_mxfp4(self, packed, scale, *, imatrix=None, name: str | None = None) -> dict[str, np.ndarray]:
        """Requantize MXFP4 pair-layout ``packed`` U8 ``[..., K/2]`` / ``scale`` U8 ``[..., K/32]``:
        decode with the MXFP4 kernel, then encode.  NaN scales (0xFF) raise ``NaNScaleError``."""
        return self._from_mxfp4(packed, scale, imatrix, name, reference=False)

    def reference_from_mxfp4(self, packed, scale, *, imatrix=None, name: str | None = None) -> dict[str, np.ndarray]:
        """Same contract as ``from_mxfp4``, computed by the numpy references."""
        return self._from_mxfp4(packed, scale, imatrix, name, reference=True)

    def _from_mxfp4(self, packed, scale, imatrix, name, *, reference: bool) -> dict[str, np.ndarray]:
        from ..requant import q2_k
        from . import mxfp4

        self.check_logical_shape(np.shape(packed)[:-1] + (2 * np.shape(packed)[-1],) if np.ndim(packed) else (),
                                 name=name)
        dec = mxfp4.decode_pair_ref if reference else mxfp4.decode_pair
        x = dec(packed, scale, name=name)
        enc = q2_k.encode_reference if reference else q2_k.encode
        return {"packed": enc(x, imatrix=imatrix, name=name)}
