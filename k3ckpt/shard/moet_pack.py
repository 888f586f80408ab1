"""The vLLM-Moet runtime's NVMe expert pack: 2-bit code planes, scale planes, rows, naming.

Spec: docs/formats/moet-pack.md (re-derived from vLLM-Moet ``moe_w2_planes.py``
and ``moe_w2_store.py``, pack version 2, ABI ``tsym4-e8m0-fragmajor-a32-v2``).

* Codes and scales come from MXFP4 through the runtime's own load-time map
  (``k3ckpt.requant.moet.encode_keep_scales``: nibble -> code, scales verbatim).
* A matrix ``[N, K]`` becomes a fragment-major code plane (``N*K/4`` bytes; 16-row
  x 64-k tiles, row tiles outer) and a scale plane (``N*K/32`` bytes; 16-row groups).
* An expert's row ("slot") is ``codes13 | sc13 | codes2 | sc2`` where ``w13`` stacks
  gate rows over up rows (``N13 = 2*I``, ``K13 = H``) and ``w2`` is down (``N2 = H``,
  ``K2 = I``); rows sit at ``(layer_key * E + e) * stride`` in a sparse file of
  ``n_layers * E * stride`` bytes, ``stride`` = slot bytes rounded up to 4 KiB.
* The file name carries the first 20 hex digits of the sha256 of the identity.

Every permutation here is a numpy reshape/transpose; ``code_byte_offset`` and
``scale_byte_offset`` are the closed forms of MOET.md section 3 for tests.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError, UsageError

__all__ = [
    "ALIGN", "PACK_VERSION", "QUANTIZER_ABI", "ZERO_MODES", "code_byte_offset", "scale_byte_offset",
    "pack_fragment_major", "unpack_fragment_major", "codes_plane_from_mxfp4", "codes_plane_from_mxfp4_reference",
    "pack_scales", "unpack_scales", "SlotGeometry", "PackIdentity", "build_slot", "split_slot", "slot_values",
    "expected_codes_from_mxfp4", "expected_values_from_mxfp4", "tp_slice_expert", "codes_scales_from_f64",
]

QUANTIZER_ABI = "tsym4-e8m0-fragmajor-a32-v2"   # moe_w2_planes.py L38
PACK_VERSION = 2                                 # moe_w2_store.py _PACK_VERSION
ALIGN = 4096                                     # moe_w2_store.py _ALIGN
ZERO_MODES = ("auto", "sign", "alt")             # VLLM_MOE_W2_ZERO_MODE; identity only on the MXFP4 path
LEVELS = np.array([-4.0, -1.0, 1.0, 4.0])        # code -> level in E2M1 units (moe_w2_planes.py L11-13)


# ------------------------------------------------------------- closed forms
def code_byte_offset(r: int, k: int, K: int) -> tuple[int, int]:
    """(byte, bit shift) of 2-bit code (r, k) in a fragment-major plane of width K (MOET.md section 3)."""
    byte = ((((r // 16) * (K // 64) + k // 64) * 32 + (r % 8) * 4 + (k % 16) // 4) * 8
            + ((r % 16) // 8) * 4 + ((k % 64) // 32) * 2 + (k % 32) // 16)
    return byte, 2 * (k % 4)


def scale_byte_offset(r: int, ks: int, K: int) -> int:
    """Byte of scale (row r, 32-block ks) in the scale plane of a width-K matrix (``pack_scales`` L388-396)."""
    return ((r // 16) * (K // 32) + ks) * 16 + r % 16


# ------------------------------------------------------------- permutations
def _check_nk(n: int, k: int, what: str) -> None:
    if n % 16 or k % 64 or n <= 0 or k <= 0:
        raise ShapeError(f"{what}: the runtime's planes need N % 16 == 0 and K % 64 == 0, found N={n}, K={k}")


def pack_fragment_major(codes: np.ndarray) -> np.ndarray:
    """Row-major 2-bit codes U8 ``[N, K/4]`` (column 4j+t in bits 2t of byte j) -> plane U8 ``[N*K/4]``.

    Both layouts keep four consecutive k in one byte with the lowest k in bits 0-1,
    so the plane is a permutation of whole bytes.  With r = 16*rt + 8*rh + g and
    byte column c = 16*kt + 8*kb + 4*kh + t, the plane index is
    ``(((rt*K/64 + kt)*32 + g*4 + t)*8 + rh*4 + kb*2 + kh``.
    """
    c = np.asarray(codes)
    if c.dtype != np.uint8 or c.ndim != 2:
        raise ShapeError(f"codes must be uint8 [N, K/4], found {c.dtype} {list(c.shape)}")
    n, k = c.shape[0], 4 * c.shape[1]
    _check_nk(n, k, "code plane")
    v = c.reshape(n // 16, 2, 8, k // 64, 2, 2, 4)          # rt, rh, g, kt, kb, kh, t
    return np.ascontiguousarray(v.transpose(0, 3, 2, 6, 1, 4, 5)).reshape(-1)


def unpack_fragment_major(plane: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of ``pack_fragment_major``: plane U8 ``[N*K/4]`` -> row-major codes U8 ``[N, K/4]``."""
    _check_nk(n, k, "code plane")
    p = np.asarray(plane, dtype=np.uint8).reshape(-1)
    if p.size != n * k // 4:
        raise ShapeError(f"code plane of [{n}, {k}] needs {n * k // 4} bytes, found {p.size}")
    v = p.reshape(n // 16, k // 64, 8, 4, 2, 2, 2)          # rt, kt, g, t, rh, kb, kh
    return np.ascontiguousarray(v.transpose(0, 4, 2, 1, 5, 6, 3)).reshape(n, k // 4)


def pack_scales(scale: np.ndarray) -> np.ndarray:
    """E8M0 scales U8 ``[N, K/32]`` -> scale plane U8 ``[N*K/32]`` (16-row groups outer, then blocks)."""
    s = np.asarray(scale)
    if s.dtype != np.uint8 or s.ndim != 2:
        raise ShapeError(f"scales must be uint8 [N, K/32], found {s.dtype} {list(s.shape)}")
    n, k = s.shape[0], 32 * s.shape[1]
    _check_nk(n, k, "scale plane")
    return np.ascontiguousarray(s.reshape(n // 16, 16, k // 32).transpose(0, 2, 1)).reshape(-1)


def unpack_scales(plane: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of ``pack_scales``."""
    _check_nk(n, k, "scale plane")
    p = np.asarray(plane, dtype=np.uint8).reshape(-1)
    if p.size != n * k // 32:
        raise ShapeError(f"scale plane of [{n}, {k}] needs {n * k // 32} bytes, found {p.size}")
    return np.ascontiguousarray(p.reshape(n // 16, k // 32, 16).transpose(0, 2, 1)).reshape(n, k // 32)


# ------------------------------------------ MXFP4 -> code plane in one pass
def _codes_plane_kernel(packed, lut, out):
    # packed [N, K/2] u8; lut: MXFP4 byte -> two codes (4 bits); out [N*K/4] u8.
    # Same index formula as pack_fragment_major, applied while encoding.
    n = packed.shape[0]
    cols = packed.shape[1] // 2
    ktiles = cols // 16
    for r in range(n):
        rbase = (r // 16) * ktiles
        low = ((r % 16) // 8) * 4
        g4 = (r % 8) * 4
        for c in range(cols):
            v = lut[packed[r, 2 * c]] | (lut[packed[r, 2 * c + 1]] << 4)
            out[((rbase + c // 16) * 32 + g4 + c % 4) * 8 + low + ((c // 8) % 2) * 2 + (c // 4) % 2] = v


@functools.cache
def _kernels():
    from .._numba import njit

    return njit(_codes_plane_kernel)


def codes_plane_from_mxfp4(packed: np.ndarray) -> np.ndarray:
    """MXFP4 packed U8 ``[N, K/2]`` -> fragment-major code plane U8 ``[N*K/4]`` through the runtime's
    nibble map (numba, one pass; equals ``codes_plane_from_mxfp4_reference``)."""
    from ..requant.moet import KEEP_LUT

    p = np.ascontiguousarray(packed, dtype=np.uint8)
    if p.ndim != 2:
        raise ShapeError(f"MXFP4 packed must be [N, K/2], found {list(p.shape)}")
    _check_nk(p.shape[0], 2 * p.shape[1], "code plane")
    out = np.empty(p.shape[0] * p.shape[1] // 2, np.uint8)
    _kernels()(p, KEEP_LUT, out)
    return out


def codes_plane_from_mxfp4_reference(packed: np.ndarray) -> np.ndarray:
    """Numpy twin of ``codes_plane_from_mxfp4``: keep-scales codes, then ``pack_fragment_major``."""
    from ..requant.moet import KEEP_LUT

    p = np.ascontiguousarray(packed, dtype=np.uint8)
    return pack_fragment_major((KEEP_LUT[p[:, 0::2]] | (KEEP_LUT[p[:, 1::2]] << 4)).astype(np.uint8))


# ------------------------------------------ float sources (NVFP4, FP8)
_MAG_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def codes_scales_from_f64(w: np.ndarray, zero_mode: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """The runtime's float64 path (``_f64_to_codes_scales``, MOET.md section 1) for sources that
    are not MXFP4: exactly dequantized values ``w [N, K]`` -> (codes U8 ``[N, K]``, scales U8 ``[N, K/32]``).

    Per row and 32-block: exponent = round-half-even(log2(amax / 6 + 1e-30)) clamped to
    [-127, 127] (-127 when amax is 0), byte = exponent + 127; u = w / 2^exponent; E2M1
    magnitude index by ``torch.bucketize(|u|, bounds, right=False)`` (a value on a midpoint
    takes the lower magnitude), sign = signbit(u), then the runtime's nibble map.  Zero
    mode: ``sign`` keeps the sign bit of exact zeros, ``alt`` gives an exact zero at odd k
    the negative sign and at even k the positive one, ``auto`` is ``alt`` when fewer than
    5% of the matrix's exact zeros carry the minority sign, else ``sign``.
    Exact zeros are taken as source values equal to zero [U: not re-checked whether the
    runtime also counts values that round to magnitude 0].  Reference code only (numpy).
    """
    from ..requant.moet import NIBBLE_TO_CODE

    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] % 32:
        raise ShapeError(f"values must be [N, K] with K a multiple of 32, found {list(w.shape)}")
    if zero_mode not in ZERO_MODES:
        raise UsageError(f"zero_mode must be one of {', '.join(ZERO_MODES)}, found {zero_mode!r}")
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    exp = np.clip(np.round(np.log2(amax / 6 + 1e-30)), -127, 127)   # np.round is half-even
    exp[amax == 0] = -127
    u = blocks / np.ldexp(1.0, exp.astype(np.int64))[..., None]
    mag = np.searchsorted(_MAG_BOUNDS, np.abs(u), side="left")      # == bucketize(right=False)
    neg = np.signbit(u)
    zero = blocks == 0
    if zero_mode != "sign" and zero.any():
        nz_neg = int(np.count_nonzero(neg & zero))
        minority = min(nz_neg, int(np.count_nonzero(zero)) - nz_neg)
        if zero_mode == "alt" or minority < 0.05 * np.count_nonzero(zero):
            odd = (np.arange(k).reshape(k // 32, 32) % 2 == 1)[None]
            neg = np.where(zero, odd, neg)
    nib = (neg.astype(np.uint8) << 3) | mag.astype(np.uint8)
    return NIBBLE_TO_CODE[nib].reshape(n, k), (exp + 127).astype(np.uint8)


# ---------------------------------------------------------------- geometry
@dataclass(frozen=True)
class SlotGeometry:
    """One expert row: ``w13`` is ``[n13, k13]`` (gate rows, then up rows), ``w2`` is ``[n2, k2]``."""

    n13: int
    k13: int
    n2: int
    k2: int

    def __post_init__(self):
        for what in ("n13", "k13", "n2", "k2"):
            v = getattr(self, what)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise UsageError(f"SlotGeometry.{what} must be a positive integer, found {v!r}")
            object.__setattr__(self, what, int(v))
        if self.n13 % 2:
            raise ShapeError(f"w13 rows {self.n13} must be even (gate and up halves)")
        _check_nk(self.n13, self.k13, "w13")
        _check_nk(self.n2, self.k2, "w2")

    @classmethod
    def for_expert(cls, intermediate: int, hidden: int, tp: int = 1) -> SlotGeometry:
        """The runtime's per-TP-rank shapes: I_r = I / tp; w13 [2*I_r, H], w2 [H, I_r]."""
        if not isinstance(tp, int) or tp < 1 or intermediate % tp:
            raise UsageError(f"tp must be a positive integer dividing the expert width {intermediate}, found {tp!r}")
        i_r = intermediate // tp
        return cls(2 * i_r, hidden, hidden, i_r)

    @property
    def parts(self) -> tuple[tuple[str, int], ...]:
        """(name, bytes) of the slot's four planes, in order."""
        return (("codes13", self.n13 * self.k13 // 4), ("sc13", self.n13 * self.k13 // 32),
                ("codes2", self.n2 * self.k2 // 4), ("sc2", self.n2 * self.k2 // 32))

    @property
    def slot_bytes(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def stride(self) -> int:
        return -(-self.slot_bytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class PackIdentity:
    """Everything the runtime hashes into a pack's name and checks in its sidecar."""

    ckpt_id: str
    zero_mode: str
    tag: str
    n_layers: int
    E: int
    slot_bytes: int
    stride: int
    quantizer_abi: str = QUANTIZER_ABI

    def __post_init__(self):
        if not isinstance(self.ckpt_id, str) or not self.ckpt_id:
            raise UsageError("the pack needs a non-empty ckpt_id (the runtime rejects a pack without one)")
        if self.zero_mode not in ZERO_MODES:
            raise UsageError(f"zero_mode must be one of {', '.join(ZERO_MODES)}, found {self.zero_mode!r}")
        if not isinstance(self.tag, str) or not self.tag or any(c in self.tag for c in "/\\\x00") \
                or self.tag.startswith("."):
            raise UsageError(f"pack tag must be a plain file-name word, found {self.tag!r}")
        for what in ("n_layers", "E", "slot_bytes", "stride"):
            v = getattr(self, what)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise UsageError(f"PackIdentity.{what} must be a positive integer, found {v!r}")
            object.__setattr__(self, what, int(v))
        if self.stride % ALIGN or self.stride < self.slot_bytes:
            raise UsageError(f"stride {self.stride} must be a multiple of {ALIGN} and hold {self.slot_bytes} bytes")

    def key_json(self) -> str:
        """The compact JSON the runtime hashes (sort_keys, separators ',' ':'; moe_w2_store.py L128-156)."""
        d = {"ckpt_id": self.ckpt_id, "zero_mode": self.zero_mode, "quantizer_abi": self.quantizer_abi,
             "tag": self.tag, "n_layers": self.n_layers, "E": self.E, "slot_bytes": self.slot_bytes,
             "stride": self.stride}
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @property
    def key20(self) -> str:
        return hashlib.sha256(self.key_json().encode("utf-8")).hexdigest()[:20]

    def stem(self, rank: int = 0, world: int = 1, pp: tuple[int, int] | None = None) -> str:
        """``<tag>.v2.<key20>.rank<r>of<w>[.pp<p>of<q>]`` (add ``.pack`` / ``.json`` / ``.lock``)."""
        if not 0 <= rank < world:
            raise UsageError(f"rank {rank} is not in [0, {world})")
        s = f"{self.tag}.v{PACK_VERSION}.{self.key20}.rank{rank}of{world}"
        if pp is not None:
            p, q = pp
            if not 0 <= p < q:
                raise UsageError(f"pp stage {p} is not in [0, {q})")
            s += f".pp{p}of{q}"
        return s

    @property
    def file_size(self) -> int:
        return self.n_layers * self.E * self.stride

    def row_offset(self, layer_key: int, expert: int) -> int:
        if not (0 <= layer_key < self.n_layers and 0 <= expert < self.E):
            raise UsageError(f"row (layer_key {layer_key}, expert {expert}) is outside "
                             f"[0, {self.n_layers}) x [0, {self.E})")
        return (layer_key * self.E + expert) * self.stride

    def sidecar(self, layers) -> dict:
        """The ``.json`` sidecar for a pack whose rows of ``layers`` (layer keys) are written."""
        keys = sorted({int(x) for x in layers})
        if keys and (keys[0] < 0 or keys[-1] >= self.n_layers):
            raise UsageError(f"layer keys must lie in [0, {self.n_layers})")
        return {"E": self.E, "ckpt_id": self.ckpt_id, "layers": keys, "n_layers": self.n_layers,
                "quantizer_abi": self.quantizer_abi, "slot_bytes": self.slot_bytes, "stride": self.stride,
                "tag": self.tag, "version": PACK_VERSION, "zero_mode": self.zero_mode}

    def sidecar_bytes(self, layers) -> bytes:
        return json.dumps(self.sidecar(layers), sort_keys=True).encode("utf-8")


# -------------------------------------------------------------------- slots
def tp_slice_expert(gate, up, down, rank: int, tp: int):
    """One TP rank's share of an MXFP4 expert: gate/up rows and down columns ``[rank*I_r, (rank+1)*I_r)``.

    ``gate``/``up`` are (packed U8 [I, H/2], scale U8 [I, H/32]); ``down`` is
    (packed U8 [H, I/2], scale U8 [H, I/32]).
    """
    if tp == 1:
        return gate, up, down
    inter = gate[0].shape[0]
    if inter % tp or (inter // tp) % 64:
        raise ShapeError(f"expert width {inter} does not split into {tp} TP ranks of a multiple of 64")
    i_r = inter // tp
    a, b = rank * i_r, (rank + 1) * i_r
    return ((gate[0][a:b], gate[1][a:b]), (up[0][a:b], up[1][a:b]),
            (down[0][:, a // 2: b // 2], down[1][:, a // 32: b // 32]))


def build_slot(geom: SlotGeometry, gate, up, down, *, reference: bool = False) -> np.ndarray:
    """The slot bytes (U8 ``[slot_bytes]``) of one expert from its MXFP4 (packed, scale) pairs.

    Codes by the runtime's own nibble map (``KEEP_LUT`` of ``encode_keep_scales``), scales
    kept; ``reference=True`` computes it with ``encode_keep_scales_reference`` and the numpy
    permutations instead of the one-pass kernel.
    """
    from ..requant.moet import encode_keep_scales_reference

    half = geom.n13 // 2
    want = {"gate": (half, geom.k13), "up": (half, geom.k13), "down": (geom.n2, geom.k2)}
    for what, (packed, scale) in (("gate", gate), ("up", up), ("down", down)):
        n, k = want[what]
        if np.shape(packed) != (n, k // 2) or np.shape(scale) != (n, k // 32):
            raise ShapeError(f"{what}: the slot needs MXFP4 packed [{n}, {k // 2}] and scale [{n}, {k // 32}], "
                             f"found {list(np.shape(packed))} and {list(np.shape(scale))}")
    sc13 = np.concatenate([np.asarray(gate[1], np.uint8), np.asarray(up[1], np.uint8)], axis=0)
    if reference or half % 16:
        c = {w: encode_keep_scales_reference(np.ascontiguousarray(p), np.ascontiguousarray(sc), name=w)[0]
             for w, (p, sc) in (("gate", gate), ("up", up), ("down", down))}
        planes13 = pack_fragment_major(np.concatenate([c["gate"], c["up"]], axis=0))
        planes2 = pack_fragment_major(c["down"])
    else:
        # gate rows then up rows: N13/2 is a multiple of 16, so each half is whole row tiles
        planes13 = np.concatenate([codes_plane_from_mxfp4(gate[0]), codes_plane_from_mxfp4(up[0])])
        planes2 = codes_plane_from_mxfp4(down[0])
    out = np.concatenate([planes13, pack_scales(sc13), planes2, pack_scales(np.asarray(down[1], np.uint8))])
    assert out.size == geom.slot_bytes
    return out


def split_slot(geom: SlotGeometry, slot) -> dict[str, np.ndarray]:
    """Slot bytes -> row-major ``codes13 [n13, k13/4]``, ``sc13``, ``codes2 [n2, k2/4]``, ``sc2``."""
    b = np.frombuffer(slot, dtype=np.uint8) if isinstance(slot, (bytes, bytearray, memoryview)) \
        else np.asarray(slot, dtype=np.uint8).reshape(-1)
    if b.size < geom.slot_bytes:
        raise ShapeError(f"slot needs {geom.slot_bytes} bytes, found {b.size}")
    pos, planes = 0, {}
    for name, n in geom.parts:
        planes[name] = b[pos: pos + n]
        pos += n
    return {
        "codes13": unpack_fragment_major(planes["codes13"], geom.n13, geom.k13),
        "sc13": unpack_scales(planes["sc13"], geom.n13, geom.k13),
        "codes2": unpack_fragment_major(planes["codes2"], geom.n2, geom.k2),
        "sc2": unpack_scales(planes["sc2"], geom.n2, geom.k2),
    }


def slot_values(geom: SlotGeometry, slot) -> tuple[np.ndarray, np.ndarray]:
    """Decode a slot: float64 ``w13 [n13, k13]`` and ``w2 [n2, k2]``, w = level[code] * 2^(s - 127)
    (the runtime's ``reference_dequant``; float64 so that no scale overflows), 0xFF -> NaN."""
    from ..formats.moet_w2 import unpack_codes

    p = split_slot(geom, slot)

    def dec(codes, scale):
        f = np.ldexp(1.0, scale.astype(np.int64) - 127)
        f[scale == 0xFF] = np.nan
        return LEVELS[unpack_codes(codes)] * np.repeat(f, 32, axis=1)

    return dec(p["codes13"], p["sc13"]), dec(p["codes2"], p["sc2"])


def expected_codes_from_mxfp4(packed) -> np.ndarray:
    """The runtime's map on MXFP4 nibbles, written independently of the encoder's lookup table:
    |v| <= 2 -> +-1 (codes 2 / 1), |v| >= 3 -> +-4 (codes 3 / 0), sign bit kept (also for -0).
    packed U8 ``[N, K/2]`` (low nibble = even k) -> codes U8 ``[N, K]``."""
    p = np.asarray(packed, dtype=np.uint8)

    def code(nib):
        neg = nib >> 3                        # sign bit
        big = ((nib & 7) + 3) >> 3            # 1 for magnitudes 3, 4, 6 (E2M1 codes 5, 6, 7)
        return ((neg ^ 1) << 1) | (big ^ neg)  # +small 2, +big 3, -small 1, -big 0

    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    out[..., 0::2] = code(p & 15)
    out[..., 1::2] = code(p >> 4)
    return out


def expected_values_from_mxfp4(packed, scale) -> np.ndarray:
    """What the runtime's map makes of MXFP4 (packed U8 [N, K/2], scale [N, K/32]), written
    independently of the encoder: |v| <= 2 -> 1, |v| >= 3 -> 4, sign bit kept (also for -0),
    times 2^(scale - 127); scale 0xFF -> NaN.  float64 ``[N, K]``."""
    p = np.asarray(packed, dtype=np.uint8)
    s = np.asarray(scale, dtype=np.uint8)
    nib = np.stack([p & 15, p >> 4], axis=-1).reshape(p.shape[0], -1)
    mag = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[nib & 7]
    level = np.where(mag <= 2.0, 1.0, 4.0) * np.where(nib & 8, -1.0, 1.0)
    f = np.ldexp(1.0, s.astype(np.int64) - 127)
    f[s == 0xFF] = np.nan
    return level * np.repeat(f, 32, axis=1)
