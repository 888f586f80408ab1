"""The safetensors dtype table: one row per dtype string the format knows.

Sizes are in *bits* because F4 and F6 pack below a byte (safetensors >= 0.6,
shape counts elements).  ``storage`` is the numpy dtype we use to view the raw
bytes without interpreting them; ``value`` names the ml_dtypes/numpy type that
gives them meaning (None where numpy has no type for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedError


@dataclass(frozen=True)
class DType:
    name: str          # the safetensors header string
    bits: int          # bits per element
    storage: str       # numpy dtype to view raw bytes (unsigned for floats without numpy type)
    value: str | None  # numpy / ml_dtypes type name giving values, if any

    @property
    def itemsize(self) -> int:
        """Bytes per element for byte-sized dtypes; sub-byte dtypes raise."""
        if self.bits % 8:
            raise UnsupportedError(f"dtype {self.name} packs {self.bits}-bit elements; it has no byte itemsize")
        return self.bits // 8

    def nbytes(self, shape: tuple[int, ...] | list[int]) -> int | None:
        """Exact byte size of a tensor of ``shape`` (Python ints), or None when
        the element count does not end on a byte boundary (safetensors'
        MisalignedSlice)."""
        numel = 1
        for d in shape:
            numel *= int(d)
        total_bits = numel * self.bits
        if total_bits % 8:
            return None
        return total_bits // 8


_TABLE = [
    DType("BOOL", 8, "bool", "bool"),
    DType("U8", 8, "uint8", "uint8"),
    DType("I8", 8, "int8", "int8"),
    DType("U16", 16, "uint16", "uint16"),
    DType("I16", 16, "int16", "int16"),
    DType("U32", 32, "uint32", "uint32"),
    DType("I32", 32, "int32", "int32"),
    DType("U64", 64, "uint64", "uint64"),
    DType("I64", 64, "int64", "int64"),
    DType("F16", 16, "float16", "float16"),
    DType("BF16", 16, "uint16", "bfloat16"),
    DType("F32", 32, "float32", "float32"),
    DType("F64", 64, "float64", "float64"),
    DType("C64", 64, "complex64", "complex64"),
    DType("F8_E4M3", 8, "uint8", "float8_e4m3fn"),
    DType("F8_E5M2", 8, "uint8", "float8_e5m2"),
    DType("F8_E4M3FNUZ", 8, "uint8", "float8_e4m3fnuz"),
    DType("F8_E5M2FNUZ", 8, "uint8", "float8_e5m2fnuz"),
    DType("F8_E8M0", 8, "uint8", "float8_e8m0fnu"),
    DType("F6_E2M3", 6, "uint8", None),
    DType("F6_E3M2", 6, "uint8", None),
    DType("F4", 4, "uint8", None),
]

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}


def lookup(name: str) -> DType:
    """The table row for a safetensors dtype string; unknown strings are refused."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(DTYPES))
        raise UnsupportedError(f"unknown safetensors dtype {name!r} (known: {known})") from None


def value_dtype(name: str) -> np.dtype:
    """The numpy dtype that interprets a dtype's values (ml_dtypes for BF16/F8)."""
    row = lookup(name)
    if row.value is None:
        raise UnsupportedError(f"dtype {name} has no numpy value type; decode it through k3ckpt.formats")
    if hasattr(np, row.value) and row.value not in ("bfloat16",):
        return np.dtype(row.value)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, row.value))


def from_numpy(dtype: np.dtype) -> str:
    """The safetensors dtype string for a numpy (or ml_dtypes) dtype."""
    dtype = np.dtype(dtype)
    for row in _TABLE:
        if row.value == dtype.name and row.bits == dtype.itemsize * 8:
            return row.name
    raise UnsupportedError(f"numpy dtype {dtype} has no safetensors dtype")
