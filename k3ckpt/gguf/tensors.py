"""What every GGUF layout shares: ggml type ids, the plan of one tensor, the converter's type rule.

An architecture module (``kimi_k3``, ``deepseek2``) maps source tensors to ``Planned``
GGUF tensors, each with a ``Recipe`` that ``produce`` follows to make its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedError
from . import container as C

# ggml type ids (gguf.GGMLQuantizationType values) this package picks itself
F32, F16, Q8_0, Q2_K, IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ2_S, IQ1_M, BF16, MXFP4 = 0, 1, 8, 10, 16, 17, 18, 19, 22, 29, 30, 39
# a source dtype's own GGUF type when no --outtype is given; block FP8 is decoded and kept as BF16
# (what llama.cpp's converter writes for it with --outtype bf16)
SOURCE_TYPES = {"BF16": BF16, "F16": F16, "F32": F32, "F8_BLOCK": BF16, "INT4_PACK": BF16}
# always float32 in the converter (base.py: the router, the KDA convolutions)
FORCE_F32 = ("ffn_gate_inp.weight", "ssm_conv1d_q.weight", "ssm_conv1d_k.weight", "ssm_conv1d_v.weight")


@dataclass(frozen=True)
class Recipe:
    """How one GGUF tensor is made from source tensors.

    ``kind``: ``copy`` (one tensor, reshaped to ``shape``), ``fuse`` (elementwise
    product of two), ``neg_exp`` (``-exp(x[:n])``), ``k_b`` / ``v_b`` (halves of
    ``kv_b_proj``, ``arg`` heads), ``experts`` (one projection of every routed expert,
    stacked; ``arg`` experts). A block-FP8 source lists its weight then its
    ``weight_scale_inv``.

    gpt-oss fuses every expert of a projection into one ``[E, rows, ...]`` tensor:
    its ``experts`` recipe names that tensor's ``_blocks`` and ``_scales`` once and
    sets ``rows`` to which rows of each expert it takes: ``all``, ``even`` (the gate
    half of ``gate_up_proj``) or ``odd`` (the up half); its ``arg`` experts start at
    ``first`` (0 but for one expert cut out for a worker). ``deinterleave`` takes the
    ``arg``-th of every two entries along the last axis (``gate_up_proj_bias``).
    """

    kind: str
    sources: tuple[str, ...]
    arg: int = 0
    rows: str = ""              # fused experts only: "all", "even" or "odd"
    first: int = 0              # fused experts only: the source index of the recipe's first expert


@dataclass(frozen=True)
class Planned:
    info: C.TensorInfo
    recipe: Recipe
    source_dtype: str      # safetensors dtype of the sources; "MXFP4" / "F8_BLOCK" for pairs
    layer: int | None


def out_type(gguf_name: str, shape: tuple[int, ...], source_dtype: str, outtype: int | None) -> int:
    """llama.cpp converter's rule for non-expert tensors: float32 for 1-D tensors, norms,
    ``FORCE_F32`` and anything not ending in ``.weight``; else ``outtype`` or the source's type."""
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or gguf_name.endswith(FORCE_F32) \
            or not gguf_name.endswith(".weight"):
        return F32
    if outtype is not None:
        return outtype
    try:
        return SOURCE_TYPES[source_dtype]
    except KeyError:
        raise UnsupportedError(f"no GGUF type for a {source_dtype} tensor {gguf_name!r}; pass --outtype") from None


def row_fits(ggml_type: int, n_per_row: int) -> bool:
    """Whether rows of ``n_per_row`` values split into ``ggml_type``'s blocks (ggml's block sizes,
    ``gguf.GGML_QUANT_SIZES``: 32 for Q8_0 and MXFP4, 256 for Q2_K and the IQ types)."""
    return n_per_row % C.type_sizes(ggml_type)[0] == 0


def layer_order(by_layer: dict[int | None, list[Planned]]) -> list[Planned]:
    """The embedding first, then the layers in order, then the output tensors (so a split
    can end on a layer boundary)."""
    glob = by_layer.get(None, [])
    head = [p for p in glob if p.info.name.startswith("token_embd")]
    tail = [p for p in glob if not p.info.name.startswith("token_embd")]
    return head + [p for layer in sorted(k for k in by_layer if k is not None) for p in by_layer[layer]] + tail


def kv_b_halves(src: tuple[str, ...], shape: tuple[int, ...], v_dim: int, nope: int):
    """MLA's ``kv_b_proj`` ``[heads * (nope + v), kv_lora]`` as the converter splits it for the
    absorbed attention: ``attn_k_b`` ``[heads, kv_lora, nope]`` (transposed) and ``attn_v_b``
    ``[heads, v, kv_lora]``; yields (GGUF name suffix, shape, recipe)."""
    rows, k = (int(d) for d in shape)
    heads = rows // (v_dim + nope)
    if heads * (v_dim + nope) != rows:
        raise UnsupportedError(f"{src[0]}: {rows} rows do not split into heads of {nope} + {v_dim}")
    yield "attn_k_b.weight", (heads, k, nope), Recipe("k_b", src, heads)
    yield "attn_v_b.weight", (heads, v_dim, k), Recipe("v_b", src, heads)


class ArchKeys:
    """An architecture's ``ARCH.*`` metadata, built in the converter's terms (``None`` values
    are left out, as the converter leaves out what a config does not give)."""

    def __init__(self, arch: str):
        self.arch = arch
        self.kvs: list[C.KV] = [C.KV("general.architecture", C.STRING, arch)]

    def u32(self, key: str, v) -> None:
        if v is not None:
            self.kvs.append(C.KV(f"{self.arch}.{key}", C.UINT32, int(v)))

    def f32(self, key: str, v) -> None:
        if v is not None:
            self.kvs.append(C.KV(f"{self.arch}.{key}", C.FLOAT32, float(v)))

    def flag(self, key: str, v: bool) -> None:
        self.kvs.append(C.KV(f"{self.arch}.{key}", C.BOOL, bool(v)))

    def add(self, kv: C.KV) -> None:
        self.kvs.append(kv)

    def routing(self, *, experts, used, groups, groups_used, file_type: int) -> None:
        """Routed-expert counts, the sigmoid router (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE 2)
        and the file type."""
        self.u32("expert_count", experts)
        self.u32("expert_used_count", used)
        self.u32("expert_group_count", groups)
        self.u32("expert_group_used_count", groups_used)
        self.u32("expert_gating_func", 2)
        self.add(C.KV("general.file_type", C.UINT32, int(file_type)))

    def mla(self, *, q_lora, kv_lora: int, rope: int, nope: int, v_dim: int) -> None:
        """MLA served as MQA: the cache holds the compressed latent (key kv_lora + rope, value kv_lora);
        the decompressed head sizes are the ``*_mla`` keys."""
        self.u32("attention.q_lora_rank", q_lora)
        self.u32("attention.kv_lora_rank", kv_lora)
        self.u32("rope.dimension_count", rope)
        self.u32("attention.key_length", kv_lora + rope)
        self.u32("attention.value_length", kv_lora)
        self.u32("attention.key_length_mla", nope + rope)
        self.u32("attention.value_length_mla", v_dim)

    def done(self) -> list[C.KV]:
        self.add(C.KV("general.quantization_version", C.UINT32, 2))    # ggml's GGML_QNT_VERSION
        return self.kvs
