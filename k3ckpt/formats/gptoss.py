"""MXFP4 in the gpt-oss layout (``gpt-oss-mxfp4``: openai/gpt-oss-20b/120b).

Stored per weight ``[..., N, K]`` (experts first, rows = output features):
``<name>_blocks`` U8 ``[..., N, K/32, 16]`` and ``<name>_scales`` U8
``[..., N, K/32]``.  Within each 16-byte group the low nibble is element 2i
and the high nibble element 2i+1 (gpt-oss ``Checkpoint._get_mxfp4_tensor``),
so the bytes are exactly the pair layout with the last axis split in 16s; the
codecs are the pair-layout kernels on a reshaped view.

``gate_up_proj`` interleaves its two projections by row: even rows are gate,
odd rows are up (also in ``gate_up_proj_bias``); see ``split_gate_up``.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from .base import FormatInfo, Part
from .e2m1 import BLOCK
from .mxfp4 import MXFP4Format
from . import ids

__all__ = ["GptOss", "blocks_to_packed", "packed_to_blocks", "split_gate_up", "interleave_gate_up"]


def blocks_to_packed(blocks: np.ndarray) -> np.ndarray:
    """gpt-oss ``_blocks`` ``[..., K/32, 16]`` -> pair-layout packed ``[..., K/2]`` (same bytes)."""
    blocks = np.asarray(blocks)
    if blocks.ndim < 2 or blocks.shape[-1] != 16:
        raise ShapeError(f"gpt-oss blocks must end in [K/32, 16], found {list(blocks.shape)}")
    return blocks.reshape(blocks.shape[:-2] + (blocks.shape[-2] * 16,))


def packed_to_blocks(packed: np.ndarray) -> np.ndarray:
    """Pair-layout packed ``[..., K/2]`` -> gpt-oss ``_blocks`` ``[..., K/32, 16]`` (same bytes)."""
    packed = np.asarray(packed)
    if packed.ndim < 1 or packed.shape[-1] % 16:
        raise ShapeError(f"packed codes must end in K/2 (a multiple of 16), found {list(packed.shape)}")
    return packed.reshape(packed.shape[:-1] + (packed.shape[-1] // 16, 16))


def split_gate_up(x: np.ndarray, axis: int = -2) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) from an interleaved ``gate_up`` array: even/odd entries along ``axis``.

    ``axis`` is the row (output feature) axis: -2 for decoded ``[E, 2I, H]``
    values and ``_scales``, -3 for ``_blocks`` ``[E, 2I, H/32, 16]``, -1 for
    ``_bias`` ``[E, 2I]``.  Returns views.
    """
    x = np.asarray(x)
    if x.ndim == 0:
        raise ShapeError("gate_up needs a row axis, found a scalar")
    ax = axis % x.ndim if -x.ndim <= axis < x.ndim else None
    if ax is None:
        raise ShapeError(f"axis {axis} out of range for shape {list(x.shape)}")
    if x.shape[ax] % 2:
        raise ShapeError(f"gate_up rows interleave gate and up; axis {axis} has odd length {x.shape[ax]}")
    index = [slice(None)] * x.ndim
    index[ax] = slice(0, None, 2)
    gate = x[tuple(index)]
    index[ax] = slice(1, None, 2)
    return gate, x[tuple(index)]


def interleave_gate_up(gate: np.ndarray, up: np.ndarray, axis: int = -2) -> np.ndarray:
    """Inverse of ``split_gate_up``: row 2i = gate[i], row 2i+1 = up[i] along ``axis``."""
    gate = np.asarray(gate)
    up = np.asarray(up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ShapeError(
            f"gate and up must match: gate {gate.dtype} {list(gate.shape)}, up {up.dtype} {list(up.shape)}"
        )
    if gate.ndim == 0 or not -gate.ndim <= axis < gate.ndim:
        raise ShapeError(f"axis {axis} out of range for shape {list(gate.shape)}")
    ax = axis % gate.ndim
    shape = list(gate.shape)
    shape[ax] *= 2
    out = np.empty(shape, gate.dtype)
    index = [slice(None)] * gate.ndim
    index[ax] = slice(0, None, 2)
    out[tuple(index)] = gate
    index[ax] = slice(1, None, 2)
    out[tuple(index)] = up
    return out


class GptOss(MXFP4Format):
    """gpt-oss ``*_proj_blocks`` / ``*_proj_scales`` (decoded with the pair kernels)."""

    _codes_role = "blocks"
    _scale_role = "scales"

    info = FormatInfo(
        id=ids.GPT_OSS_MXFP4,
        title="MXFP4, gpt-oss blocks/scales layout",
        block=BLOCK,
        fields=(("e8m0 scale", 1), ("e2m1 codes", 16)),
        parts=(
            Part("blocks", "_blocks", "U8", (1, 16)),
            Part("scales", "_scales", "U8", (1,)),
        ),
        can_encode=True,
        can_decode=True,
        bf16_exact=True,
        spec="docs/formats/mxfp4.md#gpt-oss-layout-gpt-oss-mxfp4",
        declared_as=("mxfp4",),   # transformers' gpt-oss config
    )
