"""The ids of the built-in formats, named once.

Code outside ``formats`` names a format through these (``formats.ids.MXFP4_PACK``), never by
typing its id; each format module registers under its constant, and a test holds this list
equal to the registry.  Imports nothing, so any layer may use it.
"""

from __future__ import annotations

# plain dtypes (one element per value; also the storage ids of plain float tensors)
BF16 = "bf16"
F16 = "f16"
F32 = "f32"
FP8_E4M3 = "fp8-e4m3"

# source checkpoints' quantized layouts
MXFP4_PACK = "mxfp4-pack-quantized"       # compressed-tensors MXFP4 (Kimi K3's experts)
GPT_OSS_MXFP4 = "gpt-oss-mxfp4"           # gpt-oss fused *_blocks / *_scales
FP8_BLOCK = "fp8-block"                   # DeepSeek-V3 / Kimi K2 128x128 block FP8
INT4_PACK = "int4-pack-quantized"         # compressed-tensors pack-quantized INT4 (K2-Thinking)
NVFP4 = "nvfp4"                           # NVFP4, compressed-tensors
NVFP4_MODELOPT = "nvfp4-modelopt"         # NVFP4, ModelOpt

# what k3ckpt requant writes
MOET_W2 = "moet-w2"
MX2 = "k3ckpt-mx2"
GGUF_IQ2_XS = "gguf-iq2_xs"
GGUF_IQ2_XXS = "gguf-iq2_xxs"
GGUF_IQ2_S = "gguf-iq2_s"
GGUF_IQ1_S = "gguf-iq1_s"
GGUF_IQ1_M = "gguf-iq1_m"
GGUF_Q2_K = "gguf-q2_k"
GGUF_IQ3_XXS = "gguf-iq3_xxs"
GGUF_MXFP4 = "gguf-mxfp4"

#: every built-in id (a test holds it equal to the registry)
BUILTIN = frozenset({BF16, F16, F32, FP8_E4M3, MXFP4_PACK, GPT_OSS_MXFP4, FP8_BLOCK, INT4_PACK, NVFP4,
                     NVFP4_MODELOPT, MOET_W2, MX2, GGUF_IQ2_XS, GGUF_IQ2_XXS, GGUF_IQ2_S, GGUF_IQ1_S,
                     GGUF_IQ1_M, GGUF_Q2_K, GGUF_IQ3_XXS, GGUF_MXFP4})

#: the safetensors layouts of MXFP4 codes a source checkpoint stores (what requant reads as codes)
MXFP4_LAYOUTS = (MXFP4_PACK, GPT_OSS_MXFP4)
