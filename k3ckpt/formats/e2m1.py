"""The two number formats inside every MXFP4 layout: E2M1 elements and E8M0 scales.

OCP Microscaling Formats (MX) v1.0: a block of 32 E2M1 elements shares one E8M0
scale; element value = E2M1(code) * 2^(scale - 127).  This module holds the
exact value tables (numpy only, no numba) that the layout modules share.  See
docs/formats/mxfp4.md for the full spec.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError

BLOCK = 32
"""Elements per MX block (one shared scale)."""

E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF
"""The one E8M0 byte without a value: it makes its whole block NaN."""

# Code = sign (bit 3) | exponent (bits 2-1, bias 1) | mantissa (bit 0).  Code 8 is -0.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
E2M1_VALUES.flags.writeable = False

# Round-to-nearest-even decision points between neighbouring magnitudes, in units
# of the block scale.  A magnitude a maps to code 0 + (number of thresholds it
# passes); at a tie the even code (mantissa bit 0) wins, so the comparison is
# strict (">") where the lower neighbour is even and inclusive (">=") where the
# upper one is.  Above 6 everything saturates to code 7.
RNE_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
RNE_INCLUSIVE = (False, True, False, True, False, True, False)


def e8m0_to_float32(b: np.ndarray) -> np.ndarray:
    """Exact float32 value of E8M0 bytes: 2^(b - 127); 0xFF is NaN.

    Built from bits, not from ``2.0 ** (b - 127)``: byte 0 is 2^-127, a float32
    subnormal (bits 0x00400000), and bytes 1..254 are the normal powers of two
    with exponent field ``b``.
    """
    b = np.asarray(b)
    if b.dtype != np.uint8:
        b = b.astype(np.uint8)
    bits = b.astype(np.uint32) << np.uint32(23)
    bits = np.where(b == 0, np.uint32(0x00400000), bits)
    bits = np.where(b == E8M0_NAN, np.uint32(0x7FC00000), bits)
    return bits.astype(np.uint32).view(np.float32)


E8M0_F32 = e8m0_to_float32(np.arange(256, dtype=np.uint8))
"""Byte -> exact float32 scale (index 255 is NaN)."""
E8M0_F32.flags.writeable = False

# Byte -> value of its low nibble (element 2i) and of its high nibble (element
# 2i+1): one table lookup per nibble in the decode kernels.
NIBBLE_LO_F32 = E2M1_VALUES[np.arange(256) & 0xF].copy()
NIBBLE_HI_F32 = E2M1_VALUES[np.arange(256) >> 4].copy()
NIBBLE_LO_F32.flags.writeable = False
NIBBLE_HI_F32.flags.writeable = False


def count_nan_scales(scales: np.ndarray, *, name: str | None = None) -> int:
    """Number of E8M0 scale bytes equal to 0xFF (NaN): each poisons a block of 32."""
    scales = np.asarray(scales)
    if scales.dtype != np.uint8:
        raise ShapeError(f"E8M0 scales must be uint8, found {scales.dtype}", tensor=name)
    return int(np.count_nonzero(scales == E8M0_NAN))


def block_rows(codes, scale, *, per_byte: int, what: str, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Validate packed codes U8 ``[..., K/per_byte]`` with their E8M0 scale bytes U8
    ``[..., K/32]`` (K a multiple of 32) and return them as C-contiguous rows
    ``[M, K/per_byte]``, ``[M, K/32]``; ShapeError naming ``what`` otherwise."""
    codes = np.asarray(codes)
    scale = np.asarray(scale)
    if codes.dtype != np.uint8 or codes.ndim < 1:
        raise ShapeError(f"{what} must be uint8 [..., K/{per_byte}], found {codes.dtype} {list(codes.shape)}",
                         tensor=name)
    k = per_byte * codes.shape[-1]
    if k % BLOCK or scale.dtype != np.uint8 or scale.shape != codes.shape[:-1] + (k // BLOCK,):
        raise ShapeError(
            f"{what} [..., K/{per_byte}] need K a multiple of {BLOCK} and scales uint8 [..., K/32]; "
            f"found codes {list(codes.shape)}, scale {scale.dtype} {list(scale.shape)}",
            tensor=name,
        )
    m = int(np.prod(codes.shape[:-1], dtype=np.int64))
    return np.ascontiguousarray(codes).reshape(m, k // per_byte), np.ascontiguousarray(scale).reshape(m, k // BLOCK)
