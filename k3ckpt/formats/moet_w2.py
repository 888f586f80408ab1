"""Moet-compatible 2.25 bpw (``moet-w2``): codes {-4, -1, +1, +4} x one E8M0 scale per 32.

Stored per weight ``[..., K]`` (row-major, compressed-tensors style; spec:
docs/formats/moet-w2.md):

- ``.weight_packed`` U8 ``[..., K/4]``: four 2-bit codes per byte, column
  4j + t in bits 2t..2t+1 of byte j (lowest column in the lowest bits);
- ``.weight_scale`` U8 ``[..., K/32]``: E8M0, value 2^(byte - 127), 0xFF = NaN.

value = LEVELS[code] * 2^(scale - 127) with code 0 -> -4, 1 -> -1, 2 -> +1,
3 -> +4 in E2M1 units: the levels and scale meaning of the vLLM-Moet runtime
(``moe_w2_planes.py``, ABI "tsym4-e8m0-fragmajor-a32-v2"); only the byte order
differs from its fragment-major GPU planes.  Every value is an E2M1 value
times an E8M0 scale, so ``to_mxfp4`` is lossless (nibbles 0x2, 0x6, 0xA, 0xE).

Encoders from MXFP4 (keep-scales, refit) live in ``k3ckpt.requant.moet``;
``MoetW2.from_mxfp4`` reaches them.  Encoding from floats is not offered.
"""

from __future__ import annotations

import functools
import types

import numpy as np

from ..errors import UsageError
from .base import Format, FormatInfo, Part
from .e2m1 import BLOCK, E8M0_F32, block_rows
from . import ids

__all__ = [
    "CODE_TO_NIBBLE",
    "LEVELS",
    "MoetW2",
    "check_w2",
    "decode_w2",
    "decode_w2_ref",
    "pack_codes",
    "to_mxfp4",
    "unpack_codes",
]

LEVELS = np.array([-4.0, -1.0, 1.0, 4.0], dtype=np.float32)
"""Code -> level in E2M1 units (moe_w2_planes.py L11-13)."""

CODE_TO_NIBBLE = np.array([0xE, 0xA, 0x2, 0x6], dtype=np.uint8)
"""Code -> the E2M1 nibble of the same value (the runtime's ``_CODE_TO_NIBBLE``)."""

LEVELS.flags.writeable = False
CODE_TO_NIBBLE.flags.writeable = False


# --------------------------------------------------------------------- kernels
# Plain functions compiled on first use (see _kernels), so importing this
# module does not import numba.
def _decode_kernel(codes, scale, levels, e8m0, out):
    # codes [M, K/4] u8, scale [M, K/32] u8, out [M, K] f32; one exact product each.
    for r in range(codes.shape[0]):
        crow = codes[r]
        orow = out[r]
        for blk in range(scale.shape[1]):
            f = e8m0[scale[r, blk]]
            for j in range(8):
                b = crow[blk * 8 + j]
                k = blk * 32 + 4 * j
                orow[k] = levels[b & 3] * f
                orow[k + 1] = levels[(b >> 2) & 3] * f
                orow[k + 2] = levels[(b >> 4) & 3] * f
                orow[k + 3] = levels[b >> 6] * f


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel))


# ----------------------------------------------------------------- functions
def check_w2(codes, scale, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Validate 2-bit code arrays: C-contiguous ``[M, K/4]``, ``[M, K/32]`` rows and the logical shape."""
    rows, scales = block_rows(codes, scale, per_byte=4, what="2-bit codes", name=name)
    shape = np.shape(codes)
    return rows, scales, shape[:-1] + (4 * shape[-1],)


def unpack_codes(codes: np.ndarray) -> np.ndarray:
    """U8 ``[..., K/4]`` -> 2-bit codes U8 ``[..., K]`` (column 4j + t from bits 2t..2t+1 of byte j)."""
    c = np.asarray(codes, dtype=np.uint8)
    four = (c[..., None] >> np.array([0, 2, 4, 6], np.uint8)) & np.uint8(3)
    return four.reshape(c.shape[:-1] + (c.shape[-1] * 4,))


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """2-bit codes U8 ``[..., K]`` -> U8 ``[..., K/4]``; inverse of ``unpack_codes``."""
    c = np.asarray(codes)
    if c.ndim < 1 or c.shape[-1] % 4 or c.size and (c.min() < 0 or c.max() > 3):
        raise UsageError(f"codes must be integers 0..3 with K a multiple of 4, found shape {list(c.shape)}")
    q = c.astype(np.uint8).reshape(c.shape[:-1] + (c.shape[-1] // 4, 4))
    return (q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)).astype(np.uint8)


def decode_w2(codes, scale, *, name: str | None = None) -> np.ndarray:
    """Moet 2.25 bpw -> float32 ``[..., K]`` (numba, one thread); a 0xFF scale makes its 32 values NaN."""
    c, s, shape = check_w2(codes, scale, name=name)
    out = np.empty((c.shape[0], shape[-1]), np.float32)
    _kernels().decode(c, s, LEVELS, E8M0_F32, out)
    return out.reshape(shape)


def decode_w2_ref(codes, scale, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_w2`` (float64 products, then one cast; all exact)."""
    c, s, shape = check_w2(codes, scale, name=name)
    values = LEVELS.astype(np.float64)[unpack_codes(c)]
    sc = np.ldexp(1.0, s.astype(np.int64) - 127)
    sc[s == 0xFF] = np.nan
    with np.errstate(over="ignore", invalid="ignore"):
        out = (values * np.repeat(sc, BLOCK, axis=1)).astype(np.float32)
    return out.reshape(shape)


def to_mxfp4(codes, scale, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Lossless Moet -> MXFP4 pair layout (packed U8 ``[..., K/2]``, the same scales)."""
    c, s, shape = check_w2(codes, scale, name=name)
    nib = CODE_TO_NIBBLE[unpack_codes(c)]
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    lead = shape[:-1]
    return packed.reshape(lead + (shape[-1] // 2,)), s.copy().reshape(lead + (shape[-1] // BLOCK,))


# -------------------------------------------------------------------- format
class MoetW2(Format):
    """``moet-w2``: 2-bit codes {-4, -1, +1, +4} under E8M0 block scales (vLLM-Moet levels)."""

    info = FormatInfo(
        id=ids.MOET_W2,
        title="Moet 2.25 bpw: 2-bit codes {-4,-1,1,4} x E8M0 per 32, row-major",
        block=BLOCK,
        fields=(("e8m0 scale", 1), ("2-bit codes", 8)),
        parts=(
            Part("packed", ".weight_packed", "U8", (8,)),
            Part("scale", ".weight_scale", "U8", (1,)),
        ),
        can_encode=False,
        can_decode=True,
        bf16_exact=True,
        spec="docs/formats/moet-w2.md#stored-tensors",
        mxfp4_codes=True,
        methods=("refit", "keep-scales"),   # refit first: the default
    )
    encoder = "moet"
    one_pass = "moet_fused:requant_moet"

    def _decode_rows(self, rows, k, *, reference, bf16):
        dec = decode_w2_ref if reference else decode_w2
        return dec(rows["packed"], rows["scale"])

    def from_mxfp4(self, packed, scale, *, method: str = "refit", name: str | None = None) -> dict[str, np.ndarray]:
        """Requantize MXFP4 pair-layout ``packed`` / ``scale`` (numba): ``method`` is
        ``"refit"`` (least-squares exponent per block) or ``"keep-scales"`` (the runtime's map)."""
        return self._from_mxfp4(packed, scale, method, name, reference=False)

    def reference_from_mxfp4(self, packed, scale, *, method: str = "refit", name: str | None = None):
        """Same contract as ``from_mxfp4``, computed by the numpy reference."""
        return self._from_mxfp4(packed, scale, method, name, reference=True)

    def _from_mxfp4(self, packed, scale, method, name, *, reference):
        moet = self.encoder_module()
        encoders = {
            "refit": (moet.encode_refit, moet.encode_refit_reference),
            "keep-scales": (moet.encode_keep_scales, moet.encode_keep_scales_reference),
        }
        codes, scales = encoders[self.check_method(method, name=name)][1 if reference else 0](packed, scale, name=name)
        return {"packed": codes, "scale": scales}
