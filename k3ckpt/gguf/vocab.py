"""Kimi's tiktoken vocabulary as GGUF tokenizer metadata, without running the model's code.

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
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidFileError, NotFoundError

RESERVED_SPECIALS = 256          # tokenization_kimi.py: num_reserved_special_tokens
NORMAL, CONTROL, UNUSED = 1, 3, 5    # llama.cpp's token types (gguf TokenType)


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
