"""A checkpoint's vocabulary as GGUF tokenizer metadata, without running the model's code.

``tokenizer_metadata`` reads Kimi's ``tiktoken.model`` when the folder has one, else a
Hugging Face byte-level BPE ``tokenizer.json`` (gpt-oss); special ids and the chat template
come from the JSON files (``special.special_metadata``).

Kimi K2 and K3 ship ``tiktoken.model`` (one ``base64-token rank`` pair a line) and a
``tokenization_kimi.py`` that the Hub would have us execute; k3ckpt reads the data
files instead.  What llama.cpp's converter derives from that tokenizer
(``conversion/kimi_linear.py``, borrowed by ``kimi_k3.py``) is rebuilt here:

- tokens: each rank's bytes as a GPT-2 byte-level string (``bytes_to_unicode``);
- specials: the ids right after the base tokens (Kimi reserves 256), named by
  ``tokenizer_config.json``'s ``added_tokens_decoder``, ``<|reserved_token_ID|>``
  otherwise, typed CONTROL; ids beyond both are ``[PADID]``, typed UNUSED;
- merges: for every multi-byte token, byte-pair encoding of its bytes with the
  merges of lower rank; when that ends in exactly two parts they are its merge.

From ``tokenizer.json`` (the converter's ``get_vocab_base`` through transformers, read
here from the file): the model's vocabulary and its ``added_tokens`` by id, ids neither
names ``[PADID]`` (UNUSED); added tokens are CONTROL when special or when they look special
(``<|...|>`` and the converter's short list), else USER_DEFINED; the merges as written;
``pre`` from the pre-tokenizer's split pattern (o200k's is llama.cpp's ``gpt-4o``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidFileError, NotFoundError, UnsupportedError
from . import container as C

RESERVED_SPECIALS = 256          # tokenization_kimi.py: num_reserved_special_tokens
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5    # llama.cpp's token types (gguf TokenType)

# tiktoken's o200k split pattern (gpt-4o, gpt-oss's o200k_harmony), as tokenizer.json writes it;
# llama.cpp's "gpt-4o" pre-tokenizer implements exactly this regex (llama-vocab.cpp)
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# tokenizer.json split patterns -> llama.cpp's tokenizer.ggml.pre
PRE_TOKENIZERS = {(O200K_PATTERN,): "gpt-4o"}


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    specials: dict[str, int]

    def __repr__(self) -> str:
        return f"Vocab({len(self.tokens)} tokens, {len(self.merges)} merges, {len(self.specials)} specials)"


def read_tiktoken(path: str | Path) -> list[bytes]:
    """The token bytes of a ``tiktoken.model`` file, indexed by rank (ranks must run 0..n-1)."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise NotFoundError("no tiktoken.model (Kimi's vocabulary file)", file=str(path)) from None
    by_rank: dict[int, bytes] = {}
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise InvalidFileError(f"line {no}: expected 'base64-token rank'", file=str(path)) from None
        if rank in by_rank:
            raise InvalidFileError(f"line {no}: rank {rank} given twice", file=str(path))
        by_rank[rank] = token
    if sorted(by_rank) != list(range(len(by_rank))):
        raise InvalidFileError("ranks do not run 0..n-1 without gaps", file=str(path))
    tokens = [by_rank[r] for r in range(len(by_rank))]
    if len(set(tokens)) != len(tokens):
        raise InvalidFileError("a token appears under two ranks", file=str(path))
    return tokens


@functools.cache
def _byte_strings() -> tuple[str, ...]:
    from gguf.vocab import bytes_to_unicode

    table = bytes_to_unicode()
    return tuple(table[b] for b in range(256))


def byte_level(token: bytes) -> str:
    """GPT-2's reversible byte -> printable character rendering, as llama.cpp's gpt2 vocab stores it."""
    chars = _byte_strings()
    return "".join(chars[b] for b in token)


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Greedy lowest-rank pair merging of ``token``'s bytes, using merges below ``max_rank``."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, at = max_rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


def rebuild_merges(tokens: list[bytes]) -> list[str]:
    """The BPE merges that produce the ranked ``tokens``, as ``"A B"`` byte-level strings."""
    ranks = {t: r for r, t in enumerate(tokens)}
    merges = []
    for r, t in enumerate(tokens):
        if len(t) < 2:
            continue
        parts = _bpe(ranks, t, r)
        if len(parts) == 2:
            merges.append(f"{byte_level(parts[0])} {byte_level(parts[1])}")
    return merges


def special_names(tokenizer_config: dict, base: int) -> dict[int, str]:
    """Special token ids -> names: Kimi's reserved block after the base tokens, named by
    ``added_tokens_decoder`` where it names them."""
    added = tokenizer_config.get("added_tokens_decoder") or {}
    names = {}
    for key, entry in added.items():
        try:
            names[int(key)] = entry["content"]
        except (ValueError, TypeError, KeyError):
            raise InvalidFileError(f"tokenizer_config.json: bad added_tokens_decoder entry {key!r}") from None
    out = {i: names.get(i, f"<|reserved_token_{i}|>") for i in range(base, base + RESERVED_SPECIALS)}
    out.update({i: n for i, n in names.items() if i >= base})
    return out


def kimi_vocab(model_dir: str | Path, vocab_size: int) -> Vocab:
    """Build the vocabulary llama.cpp's ``kimi-k2`` pre-tokenizer expects from a Kimi folder."""
    model_dir = Path(model_dir)
    base = read_tiktoken(model_dir / "tiktoken.model")
    cfg_path = model_dir / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidFileError(f"not JSON: {exc}", file=str(cfg_path)) from None
    specials = special_names(cfg, len(base))
    if len(base) > vocab_size or max(specials, default=0) >= vocab_size:
        raise InvalidFileError(f"tokenizer has {len(base)} base + {len(specials)} special tokens, "
                               f"more than the model's vocab_size {vocab_size}", file=str(model_dir))
    tokens, types = [], []
    for i in range(vocab_size):
        if i < len(base):
            tokens.append(byte_level(base[i]))
            types.append(NORMAL)
        elif i in specials:
            tokens.append(specials[i])
            types.append(CONTROL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    return Vocab(tuple(tokens), tuple(types), tuple(rebuild_merges(base)),
                 {n: i for i, n in specials.items()})


# -- Hugging Face tokenizer.json (byte-level BPE) ------------------------------------------------

# does_token_look_special in the converter (base.py): specials some models leave unmarked
_LOOKS_SPECIAL = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")


def looks_special(token: str) -> bool:
    return (token in _LOOKS_SPECIAL or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def bpe_pre(tokenizer: dict, where: str) -> str:
    """llama.cpp's pre-tokenizer name for a tokenizer.json's ``pre_tokenizer``: its Split regexes
    then a ByteLevel step that adds no regex of its own. The converter names it by hashing a
    probe text's token ids, which needs the real vocabulary; the regexes are what it detects."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    patterns = tuple(st.get("pattern", {}).get("Regex") for st in steps[:-1])
    ok = (steps and steps[-1].get("type") == "ByteLevel" and not steps[-1].get("use_regex", True)
          and all(st.get("type") == "Split" and st.get("behavior") == "Isolated" and not st.get("invert")
                  for st in steps[:-1]))
    if ok and patterns in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[patterns]
    raise UnsupportedError(f"{where}: its pre-tokenizer is not one k3ckpt names for llama.cpp "
                           f"(known: {', '.join(sorted(PRE_TOKENIZERS.values()))})")


def _merges(model: dict, where: str) -> list[str]:
    """The merges as ``"A B"`` strings; pairs (transformers >= 4.45) with a space inside a part
    get it as U+0120's neighbour chr(32 + 256), as gguf.SpecialVocab writes them."""
    merges = model.get("merges") or []
    out = []
    for m in merges:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m):
            out.append(" ".join(part.replace(" ", chr(ord(" ") + 256)) for part in m))
        else:
            raise InvalidFileError(f"a merge is neither 'A B' nor a pair: {m!r}", file=where)
    return out


def bpe_vocab(model_dir: str | Path, vocab_size: int) -> tuple[Vocab, str]:
    """(vocabulary, pre-tokenizer name) from a folder's byte-level BPE ``tokenizer.json``."""
    from .special import read_json

    path = Path(model_dir) / "tokenizer.json"
    tj = read_json(path)
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise UnsupportedError(f"{path}: only byte-level BPE tokenizers (GPT-2 style) are mapped")
    pre = bpe_pre(tj, str(path))
    by_id: dict[int, str] = {}
    for tok, tid in (model.get("vocab") or {}).items():
        if not isinstance(tid, int) or tid < 0 or tid in by_id:
            raise InvalidFileError(f"vocab entry {tok!r}: id {tid!r} is not a new non-negative id", file=str(path))
        by_id[tid] = tok
    added: dict[str, dict] = {}
    for a in tj.get("added_tokens") or []:
        tid, content = a.get("id"), a.get("content")
        if not isinstance(tid, int) or not isinstance(content, str) or tid < 0:
            raise InvalidFileError(f"bad added_tokens entry {a!r}", file=str(path))
        if by_id.get(tid, content) != content:      # transformers' choice between the two is arbitrary
            raise UnsupportedError(f"{path}: added token {content!r} takes id {tid} of {by_id[tid]!r}")
        by_id[tid] = content
        added[content] = a
    if by_id and max(by_id) >= vocab_size:
        raise InvalidFileError(f"token id {max(by_id)} is beyond the model's vocab_size {vocab_size}", file=str(path))
    merges = _merges(model, str(path))
    if not merges:
        raise UnsupportedError(f"{path}: no merges; llama.cpp's gpt2 vocabulary needs them")
    tokens, types = [], []
    for i in range(vocab_size):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif tok in added:
            # the converter re-encodes a non-normalized added token and decodes it back; for a
            # byte-level BPE with the token matched whole that is the token itself
            if added[tok].get("special") or looks_special(tok):
                types.append(CONTROL)
            else:
                tok = tok.replace("\u2581", " ")
                types.append(USER_DEFINED)
            tokens.append(tok)
        else:
            tokens.append(tok)
            types.append(NORMAL)
    return Vocab(tuple(tokens), tuple(types), tuple(merges), {c: a["id"] for c, a in added.items()}), pre


def tokenizer_metadata(model_dir: str | Path, vocab_size: int) -> list[C.KV]:
    """``tokenizer.ggml.*`` keys (and the chat template) for a model folder: Kimi's
    ``tiktoken.model`` when it has one (``pre = kimi-k2``), else its ``tokenizer.json``."""
    from .special import special_metadata

    root = Path(model_dir)
    if (root / "tiktoken.model").is_file():
        v, pre = kimi_vocab(root, vocab_size), "kimi-k2"
    elif (root / "tokenizer.json").is_file():
        v, pre = bpe_vocab(root, vocab_size)
    else:
        raise UnsupportedError(f"{root}: no tiktoken.model or tokenizer.json to read the vocabulary from")
    out = [C.KV("tokenizer.ggml.model", C.STRING, "gpt2"), C.KV("tokenizer.ggml.pre", C.STRING, pre),
           C.KV("tokenizer.ggml.tokens", C.ARRAY, list(v.tokens), C.STRING),
           C.KV("tokenizer.ggml.token_type", C.ARRAY, list(v.token_types), C.INT32)]
    if v.merges:
        out.append(C.KV("tokenizer.ggml.merges", C.ARRAY, list(v.merges), C.STRING))
    return out + special_metadata(root)
