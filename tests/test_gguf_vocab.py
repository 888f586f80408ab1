"""Kimi's tiktoken vocabulary -> GGUF tokens, types and merges."""

from __future__ import annotations

import base64
import json
from collections import Counter

import numpy as np
import pytest

from k3ckpt.errors import InvalidFileError, NotFoundError
from k3ckpt.gguf import vocab as V


def train_bpe(corpus: list[bytes], merges: int, seed: int = 0):
    """A plain BPE trainer: ranked tokens (single bytes in a shuffled order, then each merge's
    result) and the merges as byte pairs, in rank order."""
    order = np.random.default_rng(seed).permutation(256)
    tokens = [bytes([int(b)]) for b in order]
    words = [[w[i:i + 1] for i in range(len(w))] for w in corpus]
    pairs_done = []
    for _ in range(merges):
        counts = Counter((a, b) for w in words for a, b in zip(w, w[1:]))
        if not counts:
            break
        (a, b), _n = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        pairs_done.append((a, b))
        tokens.append(a + b)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    return tokens, pairs_done


def write_tiktoken(path, tokens):
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))


def test_merges_rebuilt_from_ranks_match_training(tmp_path):
    text = "the cat sat on the mat with the hat " * 3 + "caf\u00e9 na\u00efve \u00e9t\u00e9"
    corpus = [w.encode() for w in text.split()]
    tokens, pairs = train_bpe(corpus, 25)
    write_tiktoken(tmp_path / "tiktoken.model", tokens)
    assert V.read_tiktoken(tmp_path / "tiktoken.model") == tokens
    want = [f"{V.byte_level(a)} {V.byte_level(b)}" for a, b in pairs]
    assert V.rebuild_merges(tokens) == want


def test_byte_level_strings():
    assert V.byte_level(b"hi") == "hi"
    assert V.byte_level(b" a") == "\u0120a"          # GPT-2 renders the space as U+0120
    assert V.byte_level(b"\n") == "\u010a"
    assert len({V.byte_level(bytes([b])) for b in range(256)}) == 256


def test_kimi_vocab_tokens_specials_and_padding(tmp_path):
    tokens, _ = train_bpe([b"abcabcab", b"bcbc"], 5)
    write_tiktoken(tmp_path / "tiktoken.model", tokens)
    base = len(tokens)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        str(base): {"content": "[BOS]", "special": True},
        str(base + 1): {"content": "[EOS]", "special": True},
        str(base + 3): {"content": "<|im_end|>", "special": True}}}))
    v = V.kimi_vocab(tmp_path, base + V.RESERVED_SPECIALS + 2)
    assert len(v.tokens) == len(v.token_types) == base + 258
    assert v.tokens[:base] == tuple(V.byte_level(t) for t in tokens)
    assert v.tokens[base:base + 4] == ("[BOS]", "[EOS]", f"<|reserved_token_{base + 2}|>", "<|im_end|>")
    assert v.token_types[base] == V.CONTROL and v.token_types[0] == V.NORMAL
    assert v.tokens[-1] == f"[PAD{base + 257}]" and v.token_types[-1] == V.UNUSED
    assert v.specials["[EOS]"] == base + 1
    assert len(repr(v)) < 100


@pytest.mark.parametrize("text, match", [
    ("YQ== 0\nYg== 0\n", "given twice"),
    ("YQ== 0\nYg== 2\n", "without gaps"),
    ("YQ== 0\n!!! 1\n", "line 2"),
    ("YQ== 0\nYQ== 1\n", "two ranks"),
])
def test_bad_tiktoken_files(tmp_path, text, match):
    (tmp_path / "tiktoken.model").write_text(text)
    with pytest.raises(InvalidFileError, match=match):
        V.read_tiktoken(tmp_path / "tiktoken.model")


def test_missing_or_too_large_vocab(tmp_path):
    with pytest.raises(NotFoundError, match="tiktoken.model"):
        V.kimi_vocab(tmp_path, 1000)
    write_tiktoken(tmp_path / "tiktoken.model", [bytes([b]) for b in range(256)])
    with pytest.raises(InvalidFileError, match="vocab_size"):
        V.kimi_vocab(tmp_path, 300)
