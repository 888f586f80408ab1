"""Special token ids, add flags, chat templates and normalizer flags against llama.cpp's converter.

The converter's ``gguf.SpecialVocab`` (gguf-py of the llama-cpp-python 0.3.36 sdist, named by
K3CKPT_LLAMA_CPP_SRC) reads each folder below in a subprocess and writes its keys with its own
GGUFWriter; ``special.special_metadata`` must give the same keys, types and values. Without the
sdist these tests skip and say why (K3CKPT_REQUIRE_LLAMA_CPP=1 makes that a failure).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3ckpt.errors import InvalidFileError
from k3ckpt.gguf import container as C
from k3ckpt.gguf.special import special_metadata

SRC_ENV = "K3CKPT_LLAMA_CPP_SRC"

# the converter's SpecialVocab into its GGUFWriter; prints {key: [gguf type, value]}
PROBE = """
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]) / "gguf-py"))
import gguf
w = gguf.GGUFWriter(path=None, arch="llama")
gguf.SpecialVocab(sys.argv[2], load_merges=False).add_to_gguf(w, quiet=True)
out = {k: [int(v.type), v.value] for k, v in w.kv_data[0].items() if k != "general.architecture"}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def gguf_py():
    src = os.environ.get(SRC_ENV)
    if not src or not (Path(src) / "gguf-py" / "gguf" / "vocab.py").is_file():
        what = f"{SRC_ENV} does not name an unpacked llama.cpp tree (the sdist's vendor/llama.cpp)"
        if os.environ.get("K3CKPT_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(what)
        pytest.skip(what)
    return Path(src)


def _converter(gguf_py, folder) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(gguf_py), str(folder)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _ours(folder) -> dict:
    out = {}
    for kv in special_metadata(folder):
        value = sorted(kv.value) if kv.key == "tokenizer.chat_templates" else kv.value
        out[kv.key] = [kv.kind, value]
    return out


def _folder(root: Path, name: str, files: dict) -> Path:
    d = root / name
    for rel, obj in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return d


def _added(*pairs):
    return [{"id": i, "content": c, "special": True} for i, c in pairs]


ADDED = _added((0, "<s>"), (1, "</s>"), (2, "<unk>"), (3, "<pad>"), (4, "<mask>"), (5, "<|eot|>"))


def _tok(post=None, normalizer=None):
    return {"added_tokens": ADDED, "normalizer": normalizer, "post_processor": post,
            "model": {"type": "BPE", "vocab": {}, "merges": []}}


def _single(*items):
    return [{"SpecialToken": {"id": x}} if x not in ("A", "B") else {"Sequence": {"id": x}} for x in items]


CASES = {
    "bytelevel_and_config_flag": {
        "tokenizer.json": _tok({"type": "ByteLevel"}),
        "tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                                  "chat_template": "{{ messages }}"},
        "config.json": {"pad_token_id": 3, "eos_token_id": 99}},
    "roberta": {
        "tokenizer.json": _tok({"type": "RobertaProcessing", "cls": ["<s>", 0], "sep": ["</s>", 1]}),
        "tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": {"content": "<unk>"},
                                  "mask_token": "<mask>"}},
    "template_new_eos": {
        "tokenizer.json": _tok({"type": "Sequence", "processors": [
            {"type": "ByteLevel"},
            {"type": "TemplateProcessing", "single": _single("<s>", "A", "<|eot|>"),
             "pair": _single("<s>", "A", "</s>", "B", "<|eot|>")}]}),
        "tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>"}},
    "template_sep": {
        "tokenizer.json": _tok({"type": "TemplateProcessing", "single": _single("<mask>", "A"),
                                "pair": _single("<mask>", "A", "</s>", "B")}),
        "tokenizer_config.json": {"eos_token": "</s>"}},
    "normalizers_and_jinja": {
        "tokenizer.json": _tok(None, {"type": "Sequence", "normalizers": [
            {"type": "BertNormalizer", "lowercase": False, "strip_accents": True}, {"type": "Lowercase"}]}),
        "tokenizer_config.json": {"pad_token": "<pad>"},
        "chat_template.jinja": "default {{ x }}",
        "additional_chat_templates/tool_use.jinja": "tools {{ y }}",
        "additional_chat_templates/rag-2.jinja": "rag {{ z }}"},
    "chat_template_json": {
        "tokenizer.json": _tok(),
        "tokenizer_config.json": {"cls_token": "<s>", "sep_token": "</s>"},
        "chat_template.json": {"chat_template": "from json"}},
    "config_only": {
        "tokenizer_config.json": {"bos_token": "<s>", "add_eos_token": False},
        "config.json": {"text_config": {"bos_token_id": 7, "eos_token_id": 8}, "unk_token_id": 9}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_special_keys_match_the_converters_special_vocab(gguf_py, tmp_path, case):
    folder = _folder(tmp_path, case, CASES[case])
    want = _converter(gguf_py, folder)
    if "tokenizer.chat_templates" in want:
        want["tokenizer.chat_templates"][1] = sorted(want["tokenizer.chat_templates"][1])
    assert want, "every case sets some key"
    assert _ours(folder) == want


def test_special_keys_of_the_gpt_oss_fixture(gguf_py, gpt_oss_tiny):
    ours = _ours(gpt_oss_tiny)
    assert ours == _converter(gguf_py, gpt_oss_tiny)
    # the ByteLevel post-processor: llama.cpp must not prepend a BOS gpt-oss never saw
    assert ours["tokenizer.ggml.add_bos_token"] == [C.BOOL, False]


def test_negative_id_is_refused(tmp_path):
    d = _folder(tmp_path, "neg", {"config.json": {"bos_token_id": -1}})
    with pytest.raises(InvalidFileError, match="bos token id -1 is negative"):
        special_metadata(d)
    d = _folder(tmp_path, "bad", {"tokenizer_config.json": "{not json"})
    with pytest.raises(InvalidFileError, match="not JSON"):
        special_metadata(d)
