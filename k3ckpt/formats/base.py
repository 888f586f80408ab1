"""The format table and registry, and the base class that does the shape work.

Every on-disk weight format is one ``Format`` subclass with a ``FormatInfo``
row: its id (the string users see, e.g. ``mxfp4-pack-quantized``), block size,
bytes per block written as a sum of named fields (``1 + 16`` for MXFP4), and
the tensors it stores.  Defining the subclass registers it; the rows of all
registered formats are *the* table (``list_formats``, ``format_table_markdown``).

Most formats store only per-block parts (their size scales with the weight).
Some also store a few fixed-shape tensors per weight (MX2's level sets and
exponent base): ``FormatInfo.tensor_parts``.  The base class treats both kinds
alike in ``part_specs``, ``tensor_names``, ``match_name`` and the decode
contract; the rows hook receives tensor parts unreshaped.

The base class turns any ``[..., K]`` tensor into ``[rows, K]`` (and each
stored part into ``[rows, bytes-per-row]``), checks shapes and dtypes against
the format's part list, and checks what the block-level hooks return.  A
format implements only ``_decode_rows`` and (if it can encode) ``_encode_rows``.
"""

from __future__ import annotations

import functools
import inspect
import importlib
import math
from dataclasses import dataclass
from typing import ClassVar, Mapping

import numpy as np

from ..errors import NotFoundError, ShapeError, UnsupportedError, UsageError
from ..io.dtypes import lookup as lookup_dtype
from ..io.dtypes import value_dtype
from . import ids


@dataclass(frozen=True)
class Part:
    """One tensor a format stores, described per block of logical elements.

    ``per_block`` is the trailing shape one block adds: ``(a, *rest)`` means a
    row of ``n`` blocks is stored as ``[n * a, *rest]``.  Examples: MXFP4 codes
    ``(16,)`` -> ``[..., K/2]``; gpt-oss blocks ``(1, 16)`` -> ``[..., K/32, 16]``;
    E8M0 scales ``(1,)`` -> ``[..., K/32]``.
    """

    role: str                    # key in the parts dict: "packed", "scale", "blocks", ...
    suffix: str                  # added to the tensor's base name on disk (".weight_packed", "_blocks", "")
    dtype: str                   # safetensors dtype string of the stored tensor ("U8", "BF16")
    per_block: tuple[int, ...]   # trailing shape per block, see above

    def __post_init__(self) -> None:
        assert self.per_block and all(int(d) > 0 for d in self.per_block), self
        lookup_dtype(self.dtype).itemsize  # noqa: B018  (refuses sub-byte dtypes)

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype of the raw stored elements (uint16 for BF16, uint8 for F8)."""
        return np.dtype(lookup_dtype(self.dtype).storage)

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.per_block) * lookup_dtype(self.dtype).itemsize

    def trailing(self, nblocks: int) -> tuple[int, ...]:
        return (nblocks * self.per_block[0], *self.per_block[1:])


@dataclass(frozen=True)
class PartSpec:
    """A concrete stored tensor for one logical shape (what writers create)."""

    role: str
    suffix: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * lookup_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class FormatInfo:
    """One row of the format table."""

    id: str                               # on-disk / CLI string
    title: str                            # one line for tables
    block: int                            # logical elements per block (along the last axis)
    fields: tuple[tuple[str, int], ...]   # (field, bytes) per block; bytes_per_block is their sum
    parts: tuple[Part, ...]               # stored tensors; parts[0] fixes the logical shape
    can_encode: bool
    can_decode: bool
    bf16_exact: bool                      # decode(out=bfloat16) loses nothing
    spec: str                             # docs page (and anchor) a decoder can be written from
    tensor_parts: tuple[PartSpec, ...] = ()   # fixed-shape tensors stored once per weight (not per block)
    # What it can do beyond decode/encode, declared here so planners and workers ask the table:
    mxfp4_codes: bool = False             # encodes straight from MXFP4 codes (``from_mxfp4``)
    methods: tuple[str, ...] = ()         # encoder methods, the first the default (``moet-w2:keep-scales``)
    ggml_type: str | None = None          # the GGUF type holding the same bytes (then a GGUF can hold it)
    weighted: bool = False                # its encoder weighs columns by an importance matrix (``--imatrix``)
    # How a checkpoint's quantization_config names it (``formats.recognise``): ``quant_method``, or
    # ``quant_method/format`` (compressed-tensors' format, fp8's ``block``, ModelOpt's algorithm)
    declared_as: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.id and self.id == self.id.strip().lower(), self.id
        assert self.block >= 1 and self.fields and self.parts, self
        roles = [p.role for p in self.parts] + [t.role for t in self.tensor_parts]
        assert len(set(roles)) == len(roles), self
        assert all(isinstance(t, PartSpec) and t.suffix for t in self.tensor_parts), self
        # The stored parts must hold exactly the bytes the fields add up to.
        assert sum(p.bytes_per_block for p in self.parts) == self.bytes_per_block, self

    @property
    def bytes_per_block(self) -> int:
        return sum(n for _, n in self.fields)

    @property
    def encodes_from(self) -> tuple[str, ...]:
        """What k3ckpt encodes this format from: ``floats`` and/or ``mxfp4-codes``."""
        return (("floats",) if self.can_encode else ()) + (("mxfp4-codes",) if self.mxfp4_codes else ())

    @property
    def containers(self) -> tuple[str, ...]:
        """The files that can hold it: k3ckpt writes every format into safetensors; GGUF
        holds the ones a ggml type stores byte for byte."""
        return ("safetensors",) + (("gguf",) if self.ggml_type else ())

    @property
    def bits_per_weight(self) -> float:
        """Bits per logical weight from the per-block parts (``tensor_bytes`` come on top, per weight)."""
        return 8 * self.bytes_per_block / self.block

    @property
    def tensor_bytes(self) -> int:
        """Bytes stored once per weight whatever its size (the tensor parts)."""
        return sum(t.nbytes for t in self.tensor_parts)

    @functools.cached_property   # asked for every weight of a plan (frozen dataclass: cached in __dict__)
    def roles(self) -> tuple[str, ...]:
        """Every stored part's role: block parts, then tensor parts."""
        return tuple(p.role for p in self.parts) + tuple(t.role for t in self.tensor_parts)

    @property
    def fields_text(self) -> str:
        """The bytes per block as a sum, e.g. ``"1 + 16"``."""
        return " + ".join(str(n) for _, n in self.fields)

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "title": self.title,
            "block": self.block,
            "fields": [[name, n] for name, n in self.fields],
            "bytes_per_block": self.bytes_per_block,
            "bits_per_weight": self.bits_per_weight,
            "parts": [
                {"role": p.role, "suffix": p.suffix, "dtype": p.dtype, "per_block": list(p.per_block)}
                for p in self.parts
            ],
            "tensor_parts": [
                {"role": t.role, "suffix": t.suffix, "dtype": t.dtype, "shape": list(t.shape)}
                for t in self.tensor_parts
            ],
            "tensor_bytes": self.tensor_bytes,
            "can_encode": self.can_encode,
            "can_decode": self.can_decode,
            "bf16_exact": self.bf16_exact,
            "encodes_from": list(self.encodes_from),
            "methods": list(self.methods),
            "containers": list(self.containers),
            "ggml_type": self.ggml_type,
            "weighted": self.weighted,
            "spec": self.spec,
        }


_REGISTRY: dict[str, "Format"] = {}


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def output_dtype(out) -> np.dtype:
    """Normalise a decode output choice: float32 or bfloat16 (strings allowed)."""
    aliases = {"float32": np.float32, "f32": np.float32, "bfloat16": None, "bf16": None}
    if isinstance(out, str):
        if out not in aliases:
            raise UsageError(f"decode output must be float32 or bfloat16, got {out!r}")
        return np.dtype(np.float32) if aliases[out] is not None else _bfloat16()
    try:
        dt = np.dtype(out)
    except TypeError:
        raise UsageError(f"decode output must be float32 or bfloat16, got {out!r}") from None
    if dt == np.float32 or dt == _bfloat16():
        return dt
    raise UsageError(f"decode output must be float32 or bfloat16, got {dt}")


def first_nonfinite(x) -> int:
    """Flat index of the first NaN/Inf in ``x``, -1 if none (numba-compilable:
    formats njit it so an encoder can name the bad element without a full isfinite pass)."""
    flat = x.reshape(-1)
    for i in range(flat.shape[0]):
        if not np.isfinite(flat[i]):
            return i
    return -1


def as_float32_input(x, *, name: str | None = None) -> np.ndarray:
    """A C-contiguous float32 view/copy of encoder input.

    float16 and bfloat16 widen exactly; float64 is rounded to float32 first
    (RNE), so encoders are defined on float32 values.
    """
    x = np.asarray(x)
    if x.dtype != np.float32:
        if not (x.dtype.kind == "f" or x.dtype == _bfloat16()):
            raise ShapeError(f"encoder input must be floating point, found dtype {x.dtype}", tensor=name)
        x = x.astype(np.float32)
    return np.ascontiguousarray(x)


@functools.cache
def _suffixes_longest_first(fmt: Format) -> tuple[tuple[str, str], ...]:
    """(suffix, role) of every part, longest suffix first and an empty one last (``match_name``,
    called for every tensor of a checkpoint: K3 has half a million).  Keyed by the registry's
    one instance per format, which hashes by identity."""
    info = fmt.info
    suffixes = [(p.suffix, p.role) for p in info.parts] + [(t.suffix, t.role) for t in info.tensor_parts]
    return tuple(sorted(suffixes, key=lambda sr: -len(sr[0])))


@functools.lru_cache(maxsize=4096)
def _part_specs(fmt: Format, shape: tuple[int, ...]) -> tuple[tuple[str, PartSpec], ...]:
    """``part_specs`` of a checked shape; cached because a checkpoint repeats a few shapes
    across hundreds of thousands of weights."""
    info = fmt.info
    lead, nblocks = shape[:-1], shape[-1] // info.block
    specs = [(p.role, PartSpec(p.role, p.suffix, p.dtype, lead + p.trailing(nblocks))) for p in info.parts]
    return tuple(specs + [(t.role, t) for t in info.tensor_parts])


class Format:
    """Base of all formats.  Subclasses set ``info`` and implement the row hooks.

    A subclass without its own ``info`` is a family base (shared code) and is
    not registered.  Formats are stateless: the registry holds one instance each.
    """

    info: ClassVar[FormatInfo]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        info = cls.__dict__.get("info")
        if info is None:
            return
        assert info.id not in _REGISTRY, f"format id {info.id!r} registered twice"
        claimed = {d for other in _REGISTRY.values() for d in other.info.declared_as}
        assert not claimed & set(info.declared_as), (info.id, info.declared_as)   # one format per declaration
        # the table and the class agree on what the format can do
        assert info.mxfp4_codes == callable(getattr(cls, "from_mxfp4", None)), info.id
        assert bool(info.methods) == (info.mxfp4_codes and "method" in inspect.signature(cls.from_mxfp4).parameters), \
            info.id
        _REGISTRY[info.id] = cls()

    #: the ``k3ckpt.requant`` module holding this format's encoders when they live there: a
    #: hook loaded on first use, so ``formats`` never imports ``requant`` (requant imports formats)
    encoder: ClassVar[str | None] = None

    #: ``module:function`` in ``k3ckpt.requant`` doing requant's whole per-weight pass from MXFP4
    #: codes in one kernel (parts and report numbers), where the format has one
    one_pass: ClassVar[str | None] = None

    def encoder_module(self):
        if self.encoder is None:
            raise UnsupportedError(f"{self.info.id} has no encoder in k3ckpt.requant")
        return importlib.import_module(f"k3ckpt.requant.{self.encoder}")

    def one_pass_requant(self):
        """The ``one_pass`` hook (imported now), or None."""
        if self.one_pass is None:
            return None
        module, _, fn = self.one_pass.partition(":")
        return getattr(importlib.import_module(f"k3ckpt.requant.{module}"), fn)

    def check_method(self, method: str | None, *, name: str | None = None) -> str | None:
        """``method`` if this format has it (None: the default, or None for a format without methods)."""
        if not self.info.methods:
            if method is not None:
                raise UsageError(f"{self.info.id} has no methods, found {method!r}", tensor=name)
            return None
        if method is None:
            return self.info.methods[0]
        if method not in self.info.methods:
            raise UsageError(f"{self.info.id} method must be one of {sorted(self.info.methods)}, found {method!r}",
                             tensor=name)
        return method

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"<format {self.info.id}>"

    # ----------------------------------------------------------------- description
    def check_logical_shape(self, shape, *, name: str | None = None) -> tuple[int, ...]:
        """Validate a logical ``[..., K]`` shape (K a multiple of the block)."""
        shape = tuple(int(d) for d in shape)
        if not shape:
            raise ShapeError(f"{self.id} needs at least one dimension, found a scalar", tensor=name)
        if any(d < 0 for d in shape):
            raise ShapeError(f"negative dimension in shape {list(shape)}", tensor=name)
        if shape[-1] % self.info.block:
            raise ShapeError(
                f"{self.id} stores blocks of {self.info.block} along the last axis; "
                f"shape {list(shape)} has K = {shape[-1]}, not a multiple of {self.info.block}",
                tensor=name,
            )
        return shape

    def part_specs(self, shape, *, name: str | None = None) -> dict[str, PartSpec]:
        """The tensors this format stores for logical shape ``[..., K]``, by role."""
        shape = self.check_logical_shape(shape, name=name)
        return dict(_part_specs(self, shape))

    def tensor_names(self, base: str) -> dict[str, str]:
        """On-disk tensor names of the parts of weight ``base``, by role
        (``"...w1"`` -> ``{"packed": "...w1.weight_packed", "scale": "...w1.weight_scale"}``)."""
        names = {p.role: base + p.suffix for p in self.info.parts}
        names.update((t.role, base + t.suffix) for t in self.info.tensor_parts)
        return names

    def match_name(self, tensor_name: str) -> tuple[str, str] | None:
        """``(base, role)`` if ``tensor_name`` is one of this format's parts by its
        suffix (the longest matching suffix wins), else None.  A part with an
        empty suffix matches any name."""
        for suffix, role in _suffixes_longest_first(self):
            if not suffix:
                return tensor_name, role
            if tensor_name.endswith(suffix) and len(tensor_name) > len(suffix):
                return tensor_name[: -len(suffix)], role
        return None

    def sample_parts(self, shape, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Random stored bytes that form a valid encoding of logical ``shape`` (tests, benchmarks).

        Any bytes are valid in a per-block part; formats whose tensor parts
        have a restricted domain override ``_sample_tensor_part``."""
        parts = {}
        for role, spec in self.part_specs(shape).items():
            if any(t.role == role for t in self.info.tensor_parts):
                parts[role] = self._sample_tensor_part(spec, rng)
                continue
            storage = np.dtype(lookup_dtype(spec.dtype).storage)
            raw = rng.integers(0, 256, spec.nbytes, dtype=np.uint8)
            parts[role] = raw.view(storage).reshape(spec.shape)
        return parts

    def _sample_tensor_part(self, spec: PartSpec, rng: np.random.Generator) -> np.ndarray:
        storage = np.dtype(lookup_dtype(spec.dtype).storage)
        return rng.integers(0, 256, spec.nbytes, dtype=np.uint8).view(storage).reshape(spec.shape)

    def check_roles(self, parts: Mapping[str, np.ndarray], *, name: str | None = None) -> None:
        """``parts`` is a dict holding exactly this format's part roles (UsageError otherwise)."""
        roles = list(self.info.roles)
        if not isinstance(parts, Mapping):
            raise UsageError(f"{self.id} parts must be a dict keyed by {roles}, got {type(parts).__name__}")
        missing = [r for r in roles if r not in parts]
        extra = sorted(set(parts) - set(roles))
        if missing or extra:
            raise UsageError(
                f"{self.id} stores parts {roles}; missing {missing}, unexpected {extra}", tensor=name
            )

    def logical_shape(self, parts: Mapping[str, np.ndarray], *, name: str | None = None) -> tuple[int, ...]:
        """The logical ``[..., K]`` shape that ``parts`` encode; refuses inconsistent parts."""
        self.check_roles(parts, name=name)
        first = self.info.parts[0]
        shape = tuple(np.shape(parts[first.role]))
        ntrail = len(first.per_block)
        found = shape[-ntrail:] if len(shape) >= ntrail else shape
        if (
            len(shape) < ntrail
            or found[1:] != first.per_block[1:]
            or found[0] % first.per_block[0]
        ):
            want = ", ".join([f"n*{first.per_block[0]}", *map(str, first.per_block[1:])])
            raise ShapeError(
                f"{self.id} part {first.role!r} must end in [{want}], found shape {list(shape)}", tensor=name
            )
        logical = shape[:-ntrail] + (found[0] // first.per_block[0] * self.info.block,)
        specs = self.part_specs(logical, name=name)
        for role, spec in specs.items():
            arr = parts[role]
            got = tuple(np.shape(arr))
            if got != spec.shape:
                what = "per-tensor part" if role not in (p.role for p in self.info.parts) else "part"
                raise ShapeError(
                    f"{self.id} {what} {role!r}: expected shape {list(spec.shape)} for logical shape "
                    f"{list(logical)}, found {list(got)}",
                    tensor=name,
                )
            self._storage(arr, self._part(role), name)
        return logical

    # ------------------------------------------------------------------- decode
    def decode(self, parts: Mapping[str, np.ndarray], *, out=np.float32, name: str | None = None) -> np.ndarray:
        """Logical values of ``parts`` as float32 (or bfloat16) ``[..., K]`` (fast kernel)."""
        return self._decode(parts, out, name, reference=False)

    def reference_decode(
        self, parts: Mapping[str, np.ndarray], *, out=np.float32, name: str | None = None
    ) -> np.ndarray:
        """Same contract as ``decode``, computed by the readable numpy reference."""
        return self._decode(parts, out, name, reference=True)

    def _decode(self, parts, out, name, *, reference: bool) -> np.ndarray:
        if not self.info.can_decode:
            raise UnsupportedError(f"format {self.id} cannot be decoded", tensor=name)
        out_dt = output_dtype(out)
        shape = self.logical_shape(parts, name=name)
        rows = self._rows(parts, shape, name)
        k = shape[-1]
        res = self._decode_rows(rows, k, reference=reference, bf16=out_dt != np.float32)
        nrows = math.prod(shape[:-1])
        assert res.shape == (nrows, k), (self.id, res.shape, nrows, k)
        if res.dtype != out_dt:
            assert res.dtype == np.float32, res.dtype
            with np.errstate(invalid="ignore"):  # NaN stays NaN; numpy warns needlessly
                res = res.astype(out_dt)  # float32 -> bfloat16 rounds to nearest even (ml_dtypes)
        return res.reshape(shape)

    def _decode_rows(self, rows: dict[str, np.ndarray], k: int, *, reference: bool, bf16: bool) -> np.ndarray:
        """Hook: parts as C-contiguous ``[rows, bytes-per-row]`` arrays -> ``[rows, k]``.

        Return float32, or bfloat16 when ``bf16`` is asked for and the format
        can produce it directly; the base converts float32 otherwise.
        """
        raise NotImplementedError

    # ------------------------------------------------------------------- encode
    def encode(self, x: np.ndarray, *, name: str | None = None) -> dict[str, np.ndarray]:
        """Store ``x`` (``[..., K]``, floating point) in this format; parts keyed by role."""
        return self._encode(x, name, reference=False)

    def reference_encode(self, x: np.ndarray, *, name: str | None = None) -> dict[str, np.ndarray]:
        """Same contract as ``encode``, computed by the readable numpy reference."""
        return self._encode(x, name, reference=True)

    def _encode(self, x, name, *, reference: bool) -> dict[str, np.ndarray]:
        if not self.info.can_encode:
            raise UnsupportedError(f"format {self.id} is decode-only", tensor=name)
        x = as_float32_input(x, name=name)
        shape = self.check_logical_shape(x.shape, name=name)
        rows = x.reshape(math.prod(shape[:-1]), shape[-1])
        got = self._encode_rows(rows, reference=reference, name=name, shape=shape)
        return self._shape_parts(got, shape)

    def _encode_rows(
        self, x: np.ndarray, *, reference: bool, name: str | None, shape: tuple[int, ...]
    ) -> dict[str, np.ndarray]:
        """Hook: float32 ``[rows, K]`` -> parts as ``[rows, bytes-per-row]`` storage arrays.

        ``shape`` is the logical shape (for error messages in logical coordinates).
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    def _part(self, role: str) -> Part | PartSpec:
        for p in self.info.parts:
            if p.role == role:
                return p
        for t in self.info.tensor_parts:
            if t.role == role:
                return t
        raise KeyError(role)

    def _storage(self, arr, part: Part | PartSpec, name: str | None) -> np.ndarray:
        """``arr`` viewed as the part's raw storage dtype (value dtypes such as
        bfloat16 are accepted and viewed, never converted)."""
        arr = np.asarray(arr)
        want = np.dtype(lookup_dtype(part.dtype).storage)
        if arr.dtype == want:
            return arr
        value = lookup_dtype(part.dtype).value
        if value is not None and arr.dtype == value_dtype(part.dtype) and arr.dtype.itemsize == want.itemsize:
            return arr.view(want)
        raise ShapeError(
            f"{self.id} part {part.role!r} must be {part.dtype} ({want}), found dtype {arr.dtype}", tensor=name
        )

    def _rows(self, parts, shape: tuple[int, ...], name) -> dict[str, np.ndarray]:
        nrows = math.prod(shape[:-1])
        nblocks = shape[-1] // self.info.block
        rows = {}
        for p in self.info.parts:
            arr = np.ascontiguousarray(self._storage(parts[p.role], p, name))
            rows[p.role] = arr.reshape(nrows, math.prod(p.trailing(nblocks)))
        for t in self.info.tensor_parts:  # fixed shape, handed over as stored
            rows[t.role] = np.ascontiguousarray(self._storage(parts[t.role], t, name))
        return rows

    def _shape_parts(self, got: dict[str, np.ndarray], shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        specs = self.part_specs(shape)
        assert set(got) == set(specs), (self.id, sorted(got))
        out = {}
        for role, spec in specs.items():
            arr = got[role]
            assert arr.dtype == np.dtype(lookup_dtype(spec.dtype).storage), (self.id, role, arr.dtype)
            out[role] = arr.reshape(spec.shape)
        return out


_BUILTIN_LOADED = False


def _load_builtin() -> None:
    # Importing the package imports every built-in format module (they register
    # on import); numba stays unimported until a kernel first runs.  Once is
    # enough: a plan for K3 asks for formats half a million times.
    global _BUILTIN_LOADED
    if not _BUILTIN_LOADED:
        importlib.import_module(__package__)
        _BUILTIN_LOADED = True


def get_format(format_id: str) -> Format:
    """The registered format with this id; unknown ids list what exists."""
    _load_builtin()
    try:
        return _REGISTRY[format_id]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_REGISTRY))
        raise NotFoundError(f"unknown format {format_id!r} (known formats: {known})") from None


# Other spellings users bring: llama.cpp's type names (llama-quantize, convert_hf_to_gguf.py
# --outtype) and the short name requant has always taken.  Matched case-insensitively, with
# '-' and '_' alike; a name that is a registered id with its "gguf-" left off also matches.
FORMAT_ALIASES: dict[str, str] = {
    "mxfp4": ids.MXFP4_PACK,       # k3ckpt requant's MXFP4 output (docs/requant.md)
    "mxfp4-moe": ids.GGUF_MXFP4,   # llama-quantize MXFP4_MOE
    "fp4": ids.NVFP4,
}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def is_target(fmt: Format) -> bool:
    """Whether k3ckpt can write ``fmt`` (an encoder, or a transcode from MXFP4 codes)."""
    return bool(fmt.info.encodes_from)


def find_format(name: str, *, option: str = "--format", targets: bool = False) -> Format:
    """The format a user means by ``name``: a registered id in any case (``MOET-W2``),
    a llama.cpp type name (``IQ2_XS``, ``iq2_xs`` -> ``gguf-iq2_xs``) or an alias
    (``FORMAT_ALIASES``).  ``targets``: only formats k3ckpt can write.

    Raises:
        UsageError: one line naming ``option``, with "did you mean" and the ids
            there are; for a decode-only format asked as a target, says so.
    """
    import difflib

    _load_builtin()
    by_key = {_key(fid): fid for fid in _REGISTRY}
    by_key.update((k, v) for k, v in ((_key(k), v) for k, v in FORMAT_ALIASES.items()) if k not in by_key)
    by_key.update((k[len("gguf-"):], fid) for k, fid in list(by_key.items())
                  if k.startswith("gguf-") and k[len("gguf-"):] not in by_key)
    fid = by_key.get(_key(name)) if isinstance(name, str) and name.strip() else None
    offered = sorted(f for f in _REGISTRY if not targets or is_target(_REGISTRY[f]))
    if fid is None:
        close = difflib.get_close_matches(_key(name) if isinstance(name, str) else "", list(by_key), n=3,
                                          cutoff=0.6)
        guesses = list(dict.fromkeys(by_key[k] for k in close if by_key[k] in offered))
        hint = f"did you mean {' or '.join(guesses)}? " if guesses else ""
        raise UsageError(f"unknown {option} {name!r} ({hint}known formats: {', '.join(offered)})")
    fmt = _REGISTRY[fid]
    if targets and not is_target(fmt):
        raise UsageError(f"{option} {fid} is decode-only: k3ckpt reads it but cannot write it "
                         f"(formats it writes: {', '.join(offered)})")
    return fmt


def target_format(name: str, *, option: str = "--format") -> Format:
    """``find_format`` for an output format: refuses decode-only ones (``fp8-block``)."""
    return find_format(name, option=option, targets=True)


def canonical_format_spec(spec: str, *, option: str = "--format") -> str:
    """A ``--format`` value with its format part spelled as the registry's id
    (``IQ2_XS`` -> ``gguf-iq2_xs``, ``MoeT-W2:keep-scales`` -> ``moet-w2:keep-scales``);
    ``keep`` passes.  Raises ``UsageError`` as ``target_format`` does."""
    if not isinstance(spec, str) or spec.strip() == "keep":
        return spec
    fid, sep, method = spec.strip().partition(":")
    return target_format(fid, option=option).id + sep + method


def list_formats() -> tuple[FormatInfo, ...]:
    """The format table: every registered format's row, sorted by id."""
    _load_builtin()
    return tuple(_REGISTRY[k].info for k in sorted(_REGISTRY))


def format_table_markdown() -> str:
    """The format table as markdown (docs/formats/README.md embeds this text)."""
    lines = [
        "| id | block | bytes per block | bits/weight | encode | stored tensors | spec |",
        "|---|---|---|---|---|---|---|",
    ]
    for info in list_formats():
        stored = "; ".join(
            [f"`{p.role}` {p.dtype} [..., {_trailing_text(p, info.block)}]" for p in info.parts]
            + [f"`{t.role}` {t.dtype} {list(t.shape)} per weight" for t in info.tensor_parts]
        )
        lines.append(
            f"| `{info.id}` | {info.block} | {_bytes_text(info)} "
            f"| {_bpw_text(info)} | {'yes' if info.can_encode else 'no'} | {stored} "
            f"| [{info.spec.split('/')[-1]}]({info.spec.split('/')[-1]}) |"
        )
    return "\n".join(lines)


def _bpw_text(info: FormatInfo) -> str:
    if info.tensor_bytes:
        return f"{info.bits_per_weight:g} + {info.tensor_bytes} B per weight"
    return f"{info.bits_per_weight:g}"


def _bytes_text(info: FormatInfo) -> str:
    if len(info.fields) == 1:
        return str(info.bytes_per_block)
    return f"{info.fields_text} = {info.bytes_per_block}"


def _trailing_text(p: Part, block: int) -> str:
    a = p.per_block[0]
    k = "K" if block == 1 else f"K/{block}"
    first = k if a == 1 else (f"K*{a}" if block == 1 else f"K/{block}*{a}")
    if block > 1 and a > 1 and block % a == 0:
        first = f"K/{block // a}"
    return ", ".join([first, *map(str, p.per_block[1:])])
