"""On-disk weight formats behind one registry (see docs/formats/README.md).

``get_format(id)`` returns a format object with ``decode`` / ``encode`` (numba
kernels) and ``reference_decode`` / ``reference_encode`` (numpy), plus
``part_specs(shape)`` describing the tensors it stores.  ``list_formats()`` is
the format table.  What users type (``--format IQ2_XS``) goes through
``find_format`` (any format) or ``target_format`` (formats k3ckpt writes):
case-insensitive, llama.cpp spellings, "did you mean", one ``UsageError``.  Importing this package registers every built-in format;
numba is imported only when a kernel first runs.  ``ids`` names every built-in
format; ``recognise(quantization_config)`` says which format a checkpoint declares.
"""

from __future__ import annotations

from .base import (FORMAT_ALIASES, Format, FormatInfo, Part, PartSpec, canonical_format_spec, find_format,
                   format_table_markdown, get_format, is_target, list_formats, target_format)
from . import fp8_block, gguf_mxfp4, gptoss, int4_pack, iq2xs, moet_w2, mx2, mxfp4, nvfp4, plain  # noqa: E402,F401  (register the built-in formats)
from . import iq1m, iq1s, iq2s, iq2xxs, iq3xxs, q2_k  # noqa: E402,F401  (llama.cpp quant family)
from .e2m1 import count_nan_scales
from . import ids  # noqa: E402
from .recognise import recognise  # noqa: E402

__all__ = [
    "FORMAT_ALIASES",
    "Format",
    "FormatInfo",
    "Part",
    "PartSpec",
    "canonical_format_spec",
    "count_nan_scales",
    "find_format",
    "format_table_markdown",
    "get_format",
    "is_target",
    "list_formats",
    "ids",
    "recognise",
    "target_format",
]
