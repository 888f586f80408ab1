"""k3ckpt MX2 (``k3ckpt-mx2``): 2.25 bpw, four per-tensor level sets, FP4-tensor-core decodable.

Stored per weight ``[..., K]`` (spec: docs/formats/mx2.md):

- ``.weight_packed``   U8 ``[..., K/4]``: 2-bit codes, column 4j + t in bits
  2t..2t+1 of byte j; code 0 -> -b, 1 -> -a, 2 -> +a, 3 -> +b;
- ``.weight_scale``    U8 ``[..., K/32]``: block byte = selector << 6 | offset;
- ``.weight_levels``   U8 ``[4, 2]``: per selector the E2M1 magnitude codes
  (1..7) of (a, b), a < b;
- ``.weight_exp_base`` U8 ``[1]``: exponent base, an E8M0 byte 0..254.

value = +-E2M1(a or b) * 2^(exp_base + offset - 127).  Offset 63, or
exp_base + offset > 254, makes the block NaN (E8M0 0xFF).  A 16-entry table
maps (selector, code) to an E2M1 nibble and the scale byte is one add, so
``to_mxfp4`` is lossless and an FP4 kernel can consume MX2 directly.

Exactly 2.25 bits per weight (8 code bits + one block byte per 32), plus 9
bytes per tensor.  The encoder from MXFP4 is ``k3ckpt.requant.mx2``;
``MX2.from_mxfp4`` reaches it.
"""

from __future__ import annotations

import functools
import types
import numpy as np

from ..errors import InvalidFileError, ShapeError
from .base import Format, FormatInfo, Part, PartSpec
from .e2m1 import BLOCK, E2M1_VALUES, E8M0_F32
from .moet_w2 import check_w2, unpack_codes
from . import ids

__all__ = [
    "E2M1_CODE",
    "MX2",
    "OFFSET_NAN",
    "TENSOR_PARTS",
    "check_side",
    "decode_mx2",
    "decode_mx2_ref",
    "e8m0_table",
    "nibble_table",
    "to_mxfp4",
]

E2M1_CODE = {0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}
"""Nonzero E2M1 magnitude -> its code: the grid the level sets come from."""

OFFSET_BITS = 6
OFFSET_NAN = 63
"""Exponent offset that marks a NaN block (encoders write the whole byte 0xFF)."""

TENSOR_PARTS = (
    PartSpec("levels", ".weight_levels", "U8", (4, 2)),
    PartSpec("exp_base", ".weight_exp_base", "U8", (1,)),
)
"""Per-tensor parts: same shape for every weight (``FormatInfo.tensor_parts``)."""


# --------------------------------------------------------------------- kernels
def _decode_kernel(codes, block, vals, e8, e8m0, out):
    # codes [M, K/4] u8, block [M, K/32] u8, vals [16] f32 = value of (sel << 2 | code),
    # e8 [256] u8 = block byte -> E8M0 byte, out [M, K] f32.
    for r in range(codes.shape[0]):
        crow = codes[r]
        orow = out[r]
        for blk in range(block.shape[1]):
            bb = block[r, blk]
            f = e8m0[e8[bb]]
            sel4 = (bb >> 6) * 4
            for j in range(8):
                b = crow[blk * 8 + j]
                k = blk * 32 + 4 * j
                orow[k] = vals[sel4 + (b & 3)] * f
                orow[k + 1] = vals[sel4 + ((b >> 2) & 3)] * f
                orow[k + 2] = vals[sel4 + ((b >> 4) & 3)] * f
                orow[k + 3] = vals[sel4 + (b >> 6)] * f


@functools.cache
def _kernels() -> types.SimpleNamespace:
    from .._numba import njit

    return types.SimpleNamespace(decode=njit(_decode_kernel))


# ----------------------------------------------------------------- functions
def check_side(levels, exp_base, *, name: str | None = None) -> tuple[np.ndarray, int]:
    """Validate the per-tensor parts; return levels U8 [4, 2] and the base as an int."""
    levels = np.asarray(levels)
    exp_base = np.asarray(exp_base)
    if levels.dtype != np.uint8 or levels.shape != (4, 2):
        raise ShapeError(f"MX2 levels must be uint8 [4, 2], found {levels.dtype} {list(levels.shape)}", tensor=name)
    if exp_base.dtype != np.uint8 or exp_base.shape != (1,):
        raise ShapeError(f"MX2 exp_base must be uint8 [1], found {exp_base.dtype} {list(exp_base.shape)}", tensor=name)
    a = levels[:, 0].astype(np.int64)
    b = levels[:, 1].astype(np.int64)
    if not ((1 <= a) & (a < b) & (b <= 7)).all():
        raise InvalidFileError(
            f"MX2 levels rows must be E2M1 magnitude codes 1 <= a < b <= 7, found {levels.tolist()}", tensor=name
        )
    if int(exp_base[0]) > 254:
        raise InvalidFileError(
            f"MX2 exp_base must be an E8M0 byte 0..254 (0xFF is NaN), found {int(exp_base[0])}", tensor=name
        )
    return levels, int(exp_base[0])


def nibble_table(levels: np.ndarray) -> np.ndarray:
    """(selector << 2 | code) -> E2M1 nibble: codes 0..3 = -b, -a, +a, +b of the selector's set."""
    t = np.empty(16, np.uint8)
    for sel in range(4):
        a, b = int(levels[sel, 0]), int(levels[sel, 1])
        t[4 * sel: 4 * sel + 4] = (8 | b, 8 | a, a, b)
    return t


def e8m0_table(base: int) -> np.ndarray:
    """Block byte -> E8M0 scale byte base + (byte & 63); 0xFF (NaN) for offset 63 or a sum past 254."""
    off = np.arange(256) & (2 ** OFFSET_BITS - 1)
    e = base + off
    return np.where((off == OFFSET_NAN) | (e > 254), 255, e).astype(np.uint8)


def decode_mx2(packed, scale, levels, exp_base, *, name: str | None = None) -> np.ndarray:
    """MX2 -> float32 ``[..., K]`` (numba, one thread); NaN blocks decode to NaN."""
    c, s, shape = check_w2(packed, scale, name=name)
    lv, base = check_side(levels, exp_base, name=name)
    out = np.empty((c.shape[0], shape[-1]), np.float32)
    _kernels().decode(c, s, E2M1_VALUES[nibble_table(lv)], e8m0_table(base), E8M0_F32, out)
    return out.reshape(shape)


def decode_mx2_ref(packed, scale, levels, exp_base, *, name: str | None = None) -> np.ndarray:
    """Numpy reference of ``decode_mx2``: through the lossless MXFP4 view, float64 products, one cast."""
    c, s, shape = check_w2(packed, scale, name=name)
    lv, base = check_side(levels, exp_base, name=name)
    sel = np.repeat(s >> 6, BLOCK, axis=1).astype(np.int64)
    values = E2M1_VALUES.astype(np.float64)[nibble_table(lv)[4 * sel + unpack_codes(c)]]
    e = e8m0_table(base)[s]
    sc = np.ldexp(1.0, e.astype(np.int64) - 127)
    sc[e == 0xFF] = np.nan
    with np.errstate(over="ignore", invalid="ignore"):
        out = (values * np.repeat(sc, BLOCK, axis=1)).astype(np.float32)
    return out.reshape(shape)


def to_mxfp4(packed, scale, levels, exp_base, *, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Lossless MX2 -> MXFP4 pair layout (packed U8 ``[..., K/2]``, scale U8 ``[..., K/32]``)."""
    c, s, shape = check_w2(packed, scale, name=name)
    lv, base = check_side(levels, exp_base, name=name)
    sel = np.repeat(s >> 6, BLOCK, axis=1).astype(np.int64)
    nib = nibble_table(lv)[4 * sel + unpack_codes(c)]
    out = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    lead = shape[:-1]
    return out.reshape(lead + (shape[-1] // 2,)), e8m0_table(base)[s].reshape(lead + (shape[-1] // BLOCK,))


# -------------------------------------------------------------------- format
class MX2(Format):
    """``k3ckpt-mx2``: per-block selector + exponent offset, four per-tensor E2M1 level sets.

    Besides the per-block parts it stores ``TENSOR_PARTS`` (levels, exp_base)
    as the registry's per-tensor parts (``FormatInfo.tensor_parts``), so
    ``part_specs``, ``tensor_names``, ``match_name`` and the decode contract
    include them.
    """

    info = FormatInfo(
        id=ids.MX2,
        title="k3ckpt MX2 2.25 bpw: 2-bit codes, per-block selector of 4 E2M1 level sets + exponent offset",
        block=BLOCK,
        fields=(("selector + exponent offset", 1), ("2-bit codes", 8)),
        parts=(
            Part("packed", ".weight_packed", "U8", (8,)),
            Part("scale", ".weight_scale", "U8", (1,)),
        ),
        can_encode=False,
        can_decode=True,
        bf16_exact=True,
        spec="docs/formats/mx2.md#stored-tensors",
        mxfp4_codes=True,
        tensor_parts=TENSOR_PARTS,
    )
    encoder = "mx2"

    def _sample_tensor_part(self, spec: PartSpec, rng: np.random.Generator) -> np.ndarray:
        # Valid side data only: levels rows 1 <= a < b <= 7, exp_base an E8M0 byte 0..254.
        if spec.role == "levels":
            rows = [sorted(rng.choice(np.arange(1, 8), 2, replace=False)) for _ in range(4)]
            return np.array(rows, np.uint8)
        assert spec.role == "exp_base", spec
        return np.array([rng.integers(0, 255)], np.uint8)

    def _decode_rows(self, rows, k, *, reference, bf16):
        dec = decode_mx2_ref if reference else decode_mx2
        return dec(rows["packed"], rows["scale"], rows["levels"], rows["exp_base"])

    def from_mxfp4(self, packed, scale, *, name: str | None = None) -> dict[str, np.ndarray]:
        """Requantize MXFP4 pair-layout ``packed`` / ``scale`` to MX2 parts (numba; exact least squares)."""
        return self.encoder_module().encode(packed, scale, name=name)[0]

    def reference_from_mxfp4(self, packed, scale, *, name: str | None = None) -> dict[str, np.ndarray]:
        """Same contract as ``from_mxfp4``, computed by the numpy reference."""
        return self.encoder_module().encode_reference(packed, scale, name=name)[0]
