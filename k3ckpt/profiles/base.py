"""The Profile base class: a registry of model families and a fast classifier.

Classification works on a name *template*: every dotted component that is a
bare integer becomes ``#`` (``layers.12.block_sparse_moe.experts.5.w1.weight_packed``
-> ``layers.#.block_sparse_moe.experts.#.w1.weight_packed``; ``w1`` keeps its
digit).  A K3 checkpoint has ~120 templates for 497,220 names, so the ordered
regex rules run once per (template, dtype) and the result is cached; each call
then costs one regex pass to pull out the indices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from ..errors import NotFoundError
from .geometry import ModelGeometry
from .roles import Role, TensorRole, split_part, storage_of

# an integer that is a whole dotted component (the dot before it is consumed, so
# split() keeps it out of the text pieces and ".#".join() restores it)
_INDEX = re.compile(r"\.(\d+)(?![^.])")
_INDEX_LINES = re.compile(r"\.(\d+)(?![^.\n])")   # the same over names joined by newlines

# FFN projection names -> the projection they are.
PROJECTIONS: dict[str, str] = {
    "w1": "gate", "w3": "up", "w2": "down",                       # Mixtral / Kimi naming
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up",
    "gate": "gate", "up": "up", "down": "down", "gate_up": "gate_up",
}


@dataclass(frozen=True)
class Rule:
    """``pattern`` is searched in the template; the first rule that matches wins.
    ``role`` None means attention, placed by the layer's kind.  A named group
    ``proj`` gives the projection through ``PROJECTIONS``."""

    pattern: re.Pattern[str]
    role: Role | None
    projection: str | None = None


def rule(pattern: str, role: Role | None, projection: str | None = None) -> Rule:
    return Rule(re.compile(pattern), role, projection)


# Attention tensors whose names say which kind they are, whatever the config says.
_MLA_NAMES = re.compile(r"\.(?:q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|q_a_layernorm|kv_a_layernorm)\.")
_KDA_NAMES = re.compile(r"\.(?:f_a_proj|f_b_proj|b_proj|[qkv]_conv1d|o_norm)\.|\.(?:A_log|dt_bias)$")
_ATTN_ROLE = {"mla": Role.ATTN_MLA, "kda": Role.ATTN_KDA}

# Generic Hugging Face naming, used by every profile after its own rules.
GENERIC_RULES: tuple[Rule, ...] = (
    rule(r"^(?:model\.)?(?:vision_tower|vision_model|visual|vision_encoder|mm_projector|multi_modal_projector)\.",
         Role.VISION),
    # per-expert weights; also as k3ckpt requant writes formats whose parts add no ".weight"
    # (plain dtypes and gguf-mxfp4: "experts.0.w1"; gpt-oss-mxfp4: "experts.0.w1_blocks")
    rule(r"\.experts\.#\.(?P<proj>w[123]|gate_proj|up_proj|down_proj|gate_up_proj)(?:\.|_blocks$|_scales$|$)",
         Role.ROUTED_EXPERT),
    # fused all-expert tensors: gpt-oss *_blocks/_scales/_bias, transformers' stacked experts
    rule(r"\.experts\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(?:_blocks|_scales|_bias|\.weight|\.bias)?$",
         Role.ROUTED_EXPERT),
    rule(r"\.shared_experts?\.(?P<proj>w[123]|gate_proj|up_proj|down_proj|gate_up_proj)\.", Role.SHARED_EXPERT),
    rule(r"\.shared_expert_gate\.", Role.SHARED_EXPERT),
    rule(r"\.(?:mlp|block_sparse_moe|moe|feed_forward)\.(?:gate|router)\.", Role.ROUTER),
    rule(r"\.(?:mlp|feed_forward)\.(?P<proj>w[123]|gate_proj|up_proj|down_proj|gate_up_proj)\.", Role.DENSE_MLP),
    rule(r"\.(?:mlp|feed_forward)\.(?:fc1|fc2|c_fc|c_proj)\.", Role.DENSE_MLP),
    rule(r"\.(?:self_attn|self_attention|attention|attn|linear_attn)\.", None),
    rule(r"(?:^|\.)(?:embed_tokens|wte|word_embeddings|tok_embeddings)\.", Role.EMBEDDING),
    rule(r"(?:^|\.)lm_head\.", Role.LM_HEAD),
    rule(r"(?:^|\.)(?:[A-Za-z_]*norm[A-Za-z_]*|ln_f|ln_#)\.(?:weight|bias)$", Role.NORM),
)


def _role_maker():
    """``TensorRole(...)`` without the frozen-dataclass ``__init__`` overhead: the
    slot setters directly (half the cost; this runs once per tensor name)."""
    new = object.__new__
    setters = [getattr(TensorRole, f).__set__ for f in
               ("role", "layer", "expert", "projection", "weight", "part", "storage")]
    s_role, s_layer, s_expert, s_proj, s_weight, s_part, s_storage = setters

    def make(role, layer, expert, projection, weight, part, storage):
        r = new(TensorRole)
        s_role(r, role)
        s_layer(r, layer)
        s_expert(r, expert)
        s_proj(r, projection)
        s_weight(r, weight)
        s_part(r, part)
        s_storage(r, storage)
        return r

    return make


_make_role = _role_maker()


@dataclass(frozen=True, slots=True, eq=False)
class _Entry:
    """Everything about a (template, dtype) that does not depend on the indices.
    (Compared by identity: there is one per template, and it keys hot dicts.)"""

    role: Role | None
    fallback: Role          # attention role when the layer's kind is unknown
    projection: str | None
    layer_at: int           # index of the layer number in the split pieces, 0 if none
    expert_at: int
    part: str
    cut: int
    storage: str


@dataclass(frozen=True)
class Profile:
    """A model family: how its tensor names map to roles, and its geometry.

    Subclasses set ``id``, ``display_name``, ``rules`` (tried before the
    generic ones), ``default_quant`` and ``geometry_from``; they register
    themselves by ``id``.  ``quant`` is the config's quantization hint (or the
    family default), used only where suffix and dtype leave the storage open.
    """

    geometry: ModelGeometry | None = None
    quant: str | None = None
    # tensor name -> (format id, part role) that a k3ckpt config declares (profiles.declared);
    # it decides before suffix and dtype, which cannot tell moet-w2 from MXFP4
    declared: Mapping[str, tuple[str, str]] = field(default_factory=dict, repr=False, compare=False, hash=False)
    _cache: dict[tuple[tuple[str, ...], str], _Entry] = field(default_factory=dict, init=False, repr=False,
                                                  compare=False, hash=False)

    id: ClassVar[str] = "generic"
    display_name: ClassVar[str] = "Generic (name patterns)"
    # the model's short name for reports and plans ("Kimi K3"); None: the family is unknown
    model_name: ClassVar[str | None] = None
    rules: ClassVar[tuple[Rule, ...]] = ()
    default_quant: ClassVar[str | None] = None
    registry: ClassVar[dict[str, type[Profile]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        assert cls.id not in Profile.registry or Profile.registry[cls.id] is cls, cls.id
        Profile.registry[cls.id] = cls

    # -- construction ----------------------------------------------------------

    @classmethod
    def geometry_from(cls, config: Mapping[str, Any]) -> ModelGeometry | None:
        from ..errors import InvalidFileError
        from .geometry import generic_geometry

        try:
            return generic_geometry(config)
        except InvalidFileError:  # an unknown model's config may lack the keys; names still classify
            return None

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, *, quant: str | None = None,
                    declared: Mapping[str, tuple[str, str]] | None = None) -> Profile:
        """The profile for ``config``; ``quant`` is a storage hint found elsewhere
        (tensor names), used when the config declares none; ``declared`` see ``Profile.declared``."""
        from .geometry import quant_hint

        declared = declared or {}
        if not config:
            return cls(geometry=None, quant=quant or cls.default_quant, declared=declared)
        return cls(geometry=cls.geometry_from(config), quant=quant_hint(config) or quant or cls.default_quant,
                   declared=declared)

    # -- classification --------------------------------------------------------

    def locate(self, name: str, dtype: str) -> tuple[_Entry, int | None, int | None]:
        """What ``classify`` knows about the name's template, and its layer and
        expert numbers, without building a ``TensorRole`` (the cheap half, for
        walks over every tensor: names sharing template, dtype and layer share
        a role)."""
        # One regex pass splits text from indices: [text, idx, text, idx, text].
        pieces = _INDEX.split(name)
        entry = self._template_entry(tuple(pieces[0::2]), dtype)
        return (entry, int(pieces[entry.layer_at]) if entry.layer_at else None,
                int(pieces[entry.expert_at]) if entry.expert_at else None)

    def locate_many(self, names: list[str], dtype_of: np.ndarray, dtypes: Sequence[str]
                    ) -> tuple[list[_Entry], np.ndarray, np.ndarray, np.ndarray]:
        """``locate`` over many names at once, name ``i`` having dtype
        ``dtypes[dtype_of[i]]``: the distinct entries, and per name the index of
        its entry and its layer and expert numbers, as int64 arrays (-1 for
        none).  One pass over all names (numba, or two regex passes for fewer
        names) replaces the per-name Python work: a K3's 497,220 names in a
        fraction of a second."""
        n = len(names)
        dtype_of = np.asarray(dtype_of, dtype=np.int64)
        if dtype_of.shape != (n,):
            raise ValueError(f"locate_many needs one dtype index per name ({n} names, {dtype_of.shape} indices)")
        blob = "\n".join(names)
        found = _templates_scanned(blob, n) if n >= _SCAN_MIN and blob.isascii() else None
        if found is None:
            found = _templates_regex(blob, n)
        if found is None:   # names holding the separators or huge numbers: one by one
            located = [self.locate(nm, dtypes[d]) for nm, d in zip(names, dtype_of.tolist())]
            index: dict[int, int] = {}
            which = [index.setdefault(id(e), len(index)) for e, _, _ in located]
            distinct = list({id(e): e for e, _, _ in located}.values())
            return (distinct, np.array(which, dtype=np.int64),
                    _int_column([-1 if v is None else v for _, v, _ in located]),
                    _int_column([-1 if v is None else v for _, _, v in located]))
        templates, tid, numbers = found
        firsts, ids_arr = np.unique(tid * len(dtypes) + dtype_of, return_index=True, return_inverse=True)[1:]
        ids_arr = ids_arr.reshape(-1)
        entries = [self._template_entry(tuple(templates[tid[i]].split("\x00")), dtypes[dtype_of[i]])
                   for i in firsts.tolist()]
        rows = np.arange(n)
        out = []
        for attr in ("layer_at", "expert_at"):
            at = np.array([getattr(e, attr) for e in entries], dtype=np.int64)[ids_arr]
            # pieces[2k + 1] is the name's k-th number
            out.append(np.where(at > 0, numbers[rows, np.maximum(at - 1, 0) // 2], -1))
        return entries, ids_arr, out[0], out[1]

    def _template_entry(self, pieces: tuple[str, ...], dtype: str) -> _Entry:
        key = (pieces, dtype)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = self._entry(".#".join(pieces), dtype)
        return entry

    def classify(self, name: str, dtype: str) -> TensorRole:
        """The role, indices, part and storage of one tensor from its name and header dtype."""
        entry, layer, expert = self.locate(name, dtype)
        role = entry.role
        if role is None:
            kind = self.geometry.attention.get(layer) if (self.geometry and layer is not None) else None
            role = _ATTN_ROLE.get(kind, Role.ATTN_OTHER) if kind else entry.fallback
        part, storage = entry.part, entry.storage
        hit = self.declared.get(name) if self.declared else None
        if hit is not None:
            storage, part = hit
        return _make_role(role, layer, expert, entry.projection,
                          name[: len(name) - entry.cut] if entry.cut else name, part, storage)

    def classify_all(self, tensors: Mapping[str, Any]) -> dict[str, TensorRole]:
        """``classify`` over a mapping of name -> dtype string or header entry (with ``.dtype``)."""
        return {n: self.classify(n, _dtype_of(v)) for n, v in tensors.items()}

    def _entry(self, template: str, dtype: str) -> _Entry:
        comps = template.split(".")
        holes = [i for i, c in enumerate(comps) if c == "#"]
        layer_pos = expert_pos = -1
        for k, i in enumerate(holes):
            if i > 0 and comps[i - 1] in ("layers", "h", "blocks") and layer_pos < 0 and not _is_vision(template):
                layer_pos = k
            elif i > 0 and comps[i - 1] == "experts" and expert_pos < 0:
                expert_pos = k
        part, cut = split_part(comps[-1])
        role: Role | None = Role.OTHER
        projection = None
        for r in (*self.rules, *GENERIC_RULES):
            m = r.pattern.search(template)
            if m:
                role = r.role
                proj = m.groupdict().get("proj")
                projection = r.projection or (PROJECTIONS.get(proj) if proj else None)
                break
        fallback = Role.ATTN_OTHER
        if role is None:
            if _MLA_NAMES.search(template):
                role = fallback = Role.ATTN_MLA
            elif _KDA_NAMES.search(template):
                role = fallback = Role.ATTN_KDA
        if role is not None and role not in (Role.ROUTED_EXPERT,):
            expert_pos = -1  # only routed experts carry an expert index
        # k-th integer of the name sits at pieces[2k + 1] of _INDEX.split()
        return _Entry(role, fallback, projection, 2 * layer_pos + 1 if layer_pos >= 0 else 0,
                      2 * expert_pos + 1 if expert_pos >= 0 else 0, part, cut, storage_of(part, dtype, self.quant))


def _int_column(values: list[int]) -> np.ndarray:
    """int64, or Python ints (object) when a hostile name holds a number beyond it."""
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        return np.array(values, dtype=object)


_SCAN_MIN = 50_000   # fewer names: the regex passes are quick and spare numba's import


def _templates_regex(blob: str, n: int) -> tuple[list[str], np.ndarray, np.ndarray] | None:
    """(distinct templates, template index per name, numbers [n, k]) by regex passes
    over the names joined by newlines; None if a name holds a separator."""
    if "\x00" in blob or blob.count("\n") != n - 1:
        return None
    try:
        flat = np.array(_INDEX_LINES.findall(blob), dtype=np.int64)
    except (OverflowError, ValueError):
        return None
    tmpl = _INDEX_LINES.sub("\x00", blob).split("\n")
    index: dict[str, int] = {}
    tid = np.array([index.setdefault(t, len(index)) for t in tmpl], dtype=np.int64)
    templates = list(index)
    holes = np.array([t.count("\x00") for t in templates], dtype=np.int64)[tid]
    width = max(int(holes.max()), 1)
    numbers = np.zeros((n, width), dtype=np.int64)
    row = np.repeat(np.arange(n), holes)
    col = np.arange(len(flat)) - np.repeat(np.cumsum(holes) - holes, holes)
    numbers[row, col] = flat
    return templates, tid, numbers


def _templates_scanned(blob: str, n: int) -> tuple[list[str], np.ndarray, np.ndarray] | None:
    """As ``_templates_regex``, by one numba pass (ASCII names)."""
    from ._templates import MAX_NUMBERS, scan_templates

    ok, tid, first, tmpl, tspan, numbers, count = scan_templates(np.frombuffer(blob.encode("ascii"), np.uint8), n)
    if not ok or (len(count) and int(count.max()) > MAX_NUMBERS):
        return None
    templates = [tmpl[a:b].tobytes().decode("ascii") for a, b in tspan[first].tolist()]
    return templates, tid, numbers


def _is_vision(template: str) -> bool:
    return GENERIC_RULES[0].pattern.search(template) is not None


def _dtype_of(v: Any) -> str:
    if isinstance(v, str):
        return v
    dt = getattr(v, "dtype", None)
    if isinstance(dt, str):
        return dt
    if isinstance(v, (tuple, list)) and v and isinstance(v[0], str):
        return v[0]
    raise TypeError(f"expected a dtype string or an entry with .dtype, got {type(v).__name__}")


class GenericProfile(Profile):
    """Unknown models: generic Hugging Face name patterns; anything else is OTHER."""

    id: ClassVar[str] = "generic"
    display_name: ClassVar[str] = "Generic (name patterns)"


def get_profile(profile_id: str, config: Mapping[str, Any] | None = None, *, quant: str | None = None,
                declared: Mapping[str, tuple[str, str]] | None = None) -> Profile:
    """A registered profile by id, built from ``config`` when given (``quant``, ``declared``: see
    ``Profile.from_config``)."""
    try:
        cls = Profile.registry[profile_id]
    except KeyError:
        known = ", ".join(sorted(Profile.registry))
        raise NotFoundError(f"no model profile {profile_id!r} (known: {known})") from None
    return cls.from_config(config, quant=quant, declared=declared)
