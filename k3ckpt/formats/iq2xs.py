"""llama.cpp IQ2_XS (``gguf-iq2_xs``): 2.3125 bpw, 256-weight super-blocks on the E8-lattice grid.

Stored per weight ``[..., K]`` (K a multiple of 256; spec: docs/formats/iq2xs.md)
as one tensor ``.weight_packed`` U8 ``[..., K/256*74]``: each row is its
super-blocks in order, each the 74 bytes of GGML's ``block_iq2_xs``
(ggml-common.h), little-endian:

- bytes 0-1: ``d``, fp16;
- bytes 2-65: ``qs``, 32 x u16; ``qs[g]`` covers weights 8g .. 8g+7: bits 0-8
  index the 512-entry grid (8 values each from {8, 25, 43}), bits 9-15 index
  the 128-entry sign table (8 sign bits with an even count of minus signs);
- bytes 66-73: ``scales``, 4 bits per 16 weights: weights 16m .. 16m+15 use
  the low nibble of byte 66 + m/2 for even m, the high nibble for odd m.

value = fp32(fp32(fp32(d * (0.5 + s)) * 0.25) * grid[idx][j]) * (sign bit j ? -1 : +1)

in float32, in that order: what llama.cpp's ``dequantize_row_iq2_xs`` and
gguf-py's ``IQ2_XS.dequantize_blocks`` compute, so ``gguf.quants.dequantize``
of a row's bytes equals our decode bit for bit.

The grid and sign tables are llama.cpp's data: they are read at run time from
the ``gguf`` package (``gguf.quants.IQ2_XS.grid``, ``IQ2_XXS.ksigns``), never
copied here, which keeps us byte-compatible with whatever llama.cpp ships.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np

from ..errors import ShapeError
from .base import Format, FormatInfo, Part

__all__ = [
    "BLOCK_BYTES",
    "IQ2XS",
    "QK",
    "check_iq2xs",
    "decode_iq2xs",
    "decode_iq2xs_ref",
    "grid_table",
    "sign_table",
]

QK = 256
BLOCK_BYTES = 2 + 2 * 32 + 8   # fp16 d + 32 x u16 qs + 16 x 4-bit scales = 74
GRID_SIZE = 512


# ------------------------------------------------------------------- tables
@functools.cache
def grid_table() -> np.ndarray:
    """The IQ2_XS grid: uint8 [512, 8] of 8 / 25 / 43 (llama.cpp ``iq2xs_grid``, via gguf-py)."""
    from gguf.quants import IQ2_XS

    IQ2_XS.init_grid()
    grid = np.asarray(IQ2_XS.grid, dtype=np.float32).reshape(GRID_SIZE, 8)
    out = grid.astype(np.uint8)
    assert np.array_equal(out, grid) and set(np.unique(out)) == {8, 25, 43}, "unexpected gguf IQ2_XS grid"
    out.flags.writeable = False
    return out


@functools.cache
def sign_table() -> np.ndarray:
    """The sign table: uint8 [128], bit j set = weight j negative (llama.cpp ``ksigns_iq2xs``, via gguf-py).

    Entry i is i with bit 7 set when i has an odd number of ones, so every
    pattern has an even number of minus signs; the encoder relies on that.
    """
    from gguf.quants import IQ2_XXS

    out = np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8).copy()
    i = np.arange(128)
    parity = np.array([bin(v).count("1") & 1 for v in i])
    assert out.shape == (128,) and np.array_equal(out, i | (parity << 7)), "unexpected gguf ksigns table"
    out.flags.writeable = False
    return out


@functools.cache
def _decode_tables() -> types.SimpleNamespace:
    signs = sign_table()
    t = types.SimpleNamespace(
        grid=grid_table().astype(np.float32),
        # [128, 8] float32 +1 / -1: multiplying (not negating) matches gguf-py and ggml on -0 and NaN.
        signs=np.where((signs[:, None] >> np.arange(8)) & 1, np.float32(-1), np.float32(1)).astype(np.float32),
        f16=np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32),
        half=(np.float32(0.5) + np.arange(16, dtype=np.float32)).astype(np.float32),
    )
    for arr in vars(t).values():
        arr.flags.writeable = False
    return t


# ------------------------------------------------------------------ kernels
def _decode_kernel(packed, grid, signs, f16, half, out):
    # packed [M, nb*74] u8 -> out [M, nb*256] f32; float32 ops in ggml's order.
    quarter = np.float32(0.25)
    for r in range(packed.shape[0]):
        for b in range(packed.shape[1] // 74):
            o = b * 74
            d = f16[np.int64(packed[r, o]) | (np.int64(packed[r, o + 1]) << 8)]
            for ib in range(16):
                sc = (packed[r, o + 66 + ib // 2] >> (4 * (ib & 1))) & 15
                db = (d * half[sc]) * quarter
                for h in range(2):
                    g = 2 * ib + h
                    q = np.int64(packed[r, o + 2 + 2 * g]) | (np.int64(packed[r, o + 3 + 2 * g]) << 8)
                    idx = q & 511
                    sg = q >> 9
                    x0 = b * 256 + 8 * g
                    for j in range(8):
                        out[r, x0 + j] = (db * grid[idx, j]) * signs[sg, j]


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel))


# ---------------------------------------------------------------- functions
def check_iq2xs(packed, *, name: str | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate IQ2_XS bytes U8 ``[..., K/256*74]``; return C-contiguous rows ``[M, K/256*74]`` and ``[..., K]``."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim < 1 or packed.shape[-1] % BLOCK_BYTES:
        raise ShapeError(
            f"IQ2_XS bytes must be uint8 [..., K/256*{BLOCK_BYTES}], found {packed.dtype} {list(packed.shape)}",
            tensor=name,
        )
    m = math.prod(packed.shape[:-1])
    shape = packed.shape[:-1] + (packed.shape[-1] // BLOCK_BYTES * QK,)
    return np.ascontiguousarray(packed).reshape(m, packed.shape[-1]), shape


def decode_iq2xs(packed, *, name: str | None = None) -> np.ndarray:
    """IQ2_XS bytes U8 ``[..., K/256*74]`` -> float32 ``[..., K]`` (numba, one thread)."""
    p, shape = check_iq2xs(packed, name=name)
    t = _decode_tables()
    out = np.empty((p.shape[0], shape[-1]), np.float32)
    _kernels().decode(p, t.grid, t.signs, t.f16, t.half, out)
    return out.reshape(shape)


def decode_iq2xs_ref(packed, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_iq2xs`` (same float32 operations, vectorised)."""
    p, shape = check_iq2xs(packed, name=name)
    t = _decode_tables()
    blocks = p.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)               # [n, 1]
    qs = blocks[:, 2:66].copy().view("<u2").astype(np.int64)               # [n, 32]
    sc = blocks[:, 66:74]
    nib = np.stack([sc & 15, sc >> 4], axis=2).reshape(-1, 16)              # [n, 16], sub-block order
    with np.errstate(invalid="ignore", over="ignore"):                      # inf / NaN d stay inf / NaN
        db = (d * t.half[nib]) * np.float32(0.25)                           # [n, 16] float32
        db = np.repeat(db, 2, axis=1)[:, :, None]                           # [n, 32, 1] per group
        vals = (db * t.grid[qs & 511]) * t.signs[qs >> 9]                   # [n, 32, 8]
    return vals.astype(np.float32).reshape(shape)


# ------------------------------------------------------------------- format
class IQ2XS(Format):
    """``gguf-iq2_xs``: llama.cpp IQ2_XS blocks, row-major, one U8 tensor."""

    info = FormatInfo(
        id="gguf-iq2_xs",
        title="llama.cpp IQ2_XS 2.3125 bpw: fp16 d, 9-bit E8-grid + 7-bit sign per 8, 4-bit scale per 16",
        block=QK,
        fields=(("fp16 d", 2), ("qs: 32 x u16 grid + sign index", 64), ("4-bit scales", 8)),
        parts=(Part("packed", ".weight_packed", "U8", (BLOCK_BYTES,)),),
        can_encode=True,
        can_decode=True,
        bf16_exact=False,   # d * (0.5 + s) / 4 * g carries up to 22 significant bits
        spec="docs/formats/iq2xs.md#stored-tensors",
    )

    def check_logical_shape(self, shape, *, name: str | None = None) -> tuple[int, ...]:
        shape = tuple(int(v) for v in shape)
        if shape and shape[-1] >= 0 and shape[-1] % QK:
            raise ShapeError(
                f"IQ2_XS is not applicable: it stores super-blocks of {QK} weights along the last axis and "
                f"shape {list(shape)} has K = {shape[-1]}, not a multiple of {QK} "
                "(gpt-oss's 2880 is not; K3's 3584 and 3072 are)",
                tensor=name,
            )
        return super().check_logical_shape(shape, name=name)

    def _decode_rows(self, rows, k, *, reference, bf16):
        dec = decode_iq2xs_ref if reference else decode_iq2xs
        return dec(rows["packed"])

    def _encode_rows(self, x, *, reference, name, shape):
        from ..requant import iq2xs

        enc = iq2xs.encode_reference if reference else iq2xs.encode
        return {"packed": enc(x, name=name)}

    def from_float(self, x, *, name: str | None = None) -> dict[str, np.ndarray]:
        """float ``[..., K]`` -> ``{"packed": U8 [..., K/256*74]}`` (numba encoder; same as ``encode``)."""
        return self.encode(x, name=name)

    def from_mxfp4(self, packed, scale, *, name: str | None = None) -> dict[str, np.ndarray]:
        """Requantize MXFP4 pair-layout ``packed`` U8 ``[..., K/2]`` / ``scale`` U8 ``[..., K/32]``:
        decode with the MXFP4 kernel, then encode.  NaN scales (0xFF) raise ``NaNScaleError``."""
        return self._from_mxfp4(packed, scale, name, reference=False)

    def reference_from_mxfp4(self, packed, scale, *, name: str | None = None) -> dict[str, np.ndarray]:
        """Same contract as ``from_mxfp4``, computed by the numpy references."""
        return self._from_mxfp4(packed, scale, name, reference=True)

    def _from_mxfp4(self, packed, scale, name, *, reference: bool) -> dict[str, np.ndarray]:
        from . import mxfp4

        self.check_logical_shape(np.shape(packed)[:-1] + (2 * np.shape(packed)[-1],) if np.ndim(packed) else (),
                                 name=name)
        dec = mxfp4.decode_pair_ref if reference else mxfp4.decode_pair
        x = dec(packed, scale, name=name)
        return self._encode(x, name, reference=reference)
