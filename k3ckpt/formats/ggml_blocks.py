"""What the llama.cpp block formats (``gguf-iq1_s``, ``gguf-iq1_m``, ``gguf-iq2_xs``, ``gguf-iq2_xxs``, ``gguf-iq2_s``,
``gguf-q2_k``, ``gguf-iq3_xxs``) share.

Each stores a weight ``[..., K]`` (K a multiple of 256) as one U8 tensor
``.weight_packed`` ``[..., K/256*B]``: per row its 256-weight super-blocks in
order, ``B`` bytes each, exactly as GGML's ``block_<type>`` (ggml-common.h).
The family base ``GGMLBlockFormat`` does the rest of the ``Format`` plumbing
(shape checks, the decode / encode hooks, ``from_float`` and ``from_mxfp4``);
a format module adds its byte layout: the decode kernel, its numpy reference
and the ``FormatInfo`` row.  The encoders live in ``k3ckpt.requant``.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, ClassVar

import numpy as np

from ..errors import ShapeError, UsageError
from .base import Format, as_float32_input

__all__ = ["GGMLBlockFormat", "QK", "check_blocks", "decode_with", "f16_table", "half_steps", "sign_values"]

QK = 256                   # weights per super-block, every k-quant and i-quant
NOT_APPLICABLE_HINT = "(gpt-oss's 2880 is not; K3's 3584 and 3072 are)"


# ------------------------------------------------------------------- tables
@functools.cache
def f16_table() -> np.ndarray:
    """float32 [65536]: the value of every fp16 bit pattern (little-endian u16 index)."""
    t = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    t.flags.writeable = False
    return t


@functools.cache
def half_steps() -> np.ndarray:
    """float32 [16]: ``0.5 + s`` for the i-quants' 4-bit scales ``s``."""
    t = (np.float32(0.5) + np.arange(16, dtype=np.float32)).astype(np.float32)
    t.flags.writeable = False
    return t


def sign_values(signs: np.ndarray) -> np.ndarray:
    """[128, 8] float32 +1 / -1 of a sign table (bit j set: weight j negative).

    Multiplying by -1 (not negating) matches gguf-py and ggml on -0 and NaN."""
    t = np.where((signs[:, None] >> np.arange(8)) & 1, np.float32(-1), np.float32(1)).astype(np.float32)
    t.flags.writeable = False
    return t


# ---------------------------------------------------------------- functions
def check_blocks(packed, block_bytes: int, label: str, *, name: str | None = None
                 ) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate ``label`` bytes U8 ``[..., K/256*block_bytes]``; return C-contiguous rows
    ``[M, K/256*block_bytes]`` and the logical shape ``[..., K]``."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim < 1 or packed.shape[-1] % block_bytes:
        raise ShapeError(
            f"{label} bytes must be uint8 [..., K/256*{block_bytes}], found {packed.dtype} {list(packed.shape)}",
            tensor=name,
        )
    m = math.prod(packed.shape[:-1])
    shape = packed.shape[:-1] + (packed.shape[-1] // block_bytes * QK,)
    return np.ascontiguousarray(packed).reshape(m, packed.shape[-1]), shape


def decode_with(kernel, rows: np.ndarray, shape: tuple[int, ...], *tables) -> np.ndarray:
    """Run a decode kernel ``kernel(rows, *tables, out)`` into float32 ``[M, K]``; return ``shape``."""
    out = np.empty((rows.shape[0], shape[-1]), np.float32)
    kernel(rows, *tables, out)
    return out.reshape(shape)


# ------------------------------------------------------------------- format
class GGMLBlockFormat(Format):
    """Family base: one U8 part of whole 256-weight super-blocks, encoded by ``k3ckpt.requant.<encoder>``.

    A subclass sets ``info``, ``label`` (ggml's type name, for messages), ``encoder``
    (the requant module with ``encode`` / ``encode_reference``), ``decoders``
    (fast, reference: bytes ``[..., K/256*B]`` -> float32 ``[..., K]``); ``info.weighted``
    says whether the encoder takes an importance matrix.
    """

    label: ClassVar[str]
    decoders: ClassVar[tuple[Callable, Callable]]

    def check_logical_shape(self, shape, *, name: str | None = None) -> tuple[int, ...]:
        shape = tuple(int(v) for v in shape)
        if shape and shape[-1] >= 0 and shape[-1] % QK:
            raise ShapeError(
                f"{self.label} is not applicable: it stores super-blocks of {QK} weights along the last axis and "
                f"shape {list(shape)} has K = {shape[-1]}, not a multiple of {QK} {NOT_APPLICABLE_HINT}",
                tensor=name,
            )
        return super().check_logical_shape(shape, name=name)

    def _decode_rows(self, rows, k, *, reference, bf16):
        return self.decoders[1 if reference else 0](rows["packed"])

    def _encode_fn(self, reference: bool):
        mod = self.encoder_module()
        return mod.encode_reference if reference else mod.encode

    def _run_encoder(self, x, imatrix, name, *, reference: bool) -> dict[str, np.ndarray]:
        if imatrix is None:
            return {"packed": self._encode_fn(reference)(x, name=name)}
        if not self.info.weighted:
            raise UsageError(f"{self.label}'s encoder takes no importance matrix", tensor=name)
        return {"packed": self._encode_fn(reference)(x, imatrix=imatrix, name=name)}

    def _encode_rows(self, x, *, reference, name, shape):
        return self._run_encoder(x, None, name, reference=reference)

    def from_float(self, x, *, imatrix=None, name: str | None = None) -> dict[str, np.ndarray]:
        """float ``[..., K]`` -> ``{"packed": U8 [..., K/256*B]}`` (numba encoder).

        ``imatrix``: float32 ``[K]`` importance per column (``k3ckpt.imatrix``), or None for all ones."""
        x = as_float32_input(x, name=name)
        self.check_logical_shape(x.shape, name=name)
        return self._run_encoder(x, imatrix, name, reference=False)

    def from_mxfp4(self, packed, scale, *, imatrix=None, name: str | None = None) -> dict[str, np.ndarray]:
        """Requantize MXFP4 pair-layout ``packed`` U8 ``[..., K/2]`` / ``scale`` U8 ``[..., K/32]``:
        decode with the MXFP4 kernel, then encode.  NaN scales (0xFF) raise ``NaNScaleError``."""
        return self._from_mxfp4(packed, scale, imatrix, name, reference=False)

    def reference_from_mxfp4(self, packed, scale, *, imatrix=None, name: str | None = None) -> dict[str, np.ndarray]:
        """Same contract as ``from_mxfp4``, computed by the numpy references."""
        return self._from_mxfp4(packed, scale, imatrix, name, reference=True)

    def _from_mxfp4(self, packed, scale, imatrix, name, *, reference: bool) -> dict[str, np.ndarray]:
        from . import mxfp4

        self.check_logical_shape(np.shape(packed)[:-1] + (2 * np.shape(packed)[-1],) if np.ndim(packed) else (),
                                 name=name)
        dec = mxfp4.decode_pair_ref if reference else mxfp4.decode_pair
        return self._run_encoder(dec(packed, scale, name=name), imatrix, name, reference=reference)
