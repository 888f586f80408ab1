"""llama.cpp itself is the judge of our GGUF files.

Needs what `.ci/run` installs: `llama-cpp-python==0.3.36` built from its sdist
(libllama and libggml for the CPU), and that sdist unpacked, named by
K3CKPT_LLAMA_CPP_SRC (its `vendor/llama.cpp`: the converter and its gguf-py),
plus torch and transformers for the converter. Without them these tests skip
and say why; with K3CKPT_REQUIRE_LLAMA_CPP=1 (CI) a missing piece fails instead.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from k3ckpt.gguf import container as C
from k3ckpt.gguf.convert import write_gguf
from k3ckpt.gguf.writer import GGUFWriter
from k3ckpt.io.reader import open_checkpoint

SRC_ENV = "K3CKPT_LLAMA_CPP_SRC"
TOKENS = [1, 5, 77, 300, 12, 99, 256, 45, 3, 400]


def _need(what: str):
    if os.environ.get("K3CKPT_REQUIRE_LLAMA_CPP") == "1":
        pytest.fail(f"llama.cpp check required but {what}")
    pytest.skip(what)


@pytest.fixture(scope="module")
def llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        _need("llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36 builds it, ~9 min)")
    return llama_cpp


@pytest.fixture(scope="module")
def converter_dir():
    src = os.environ.get(SRC_ENV)
    if not src or not (Path(src) / "convert_hf_to_gguf.py").is_file():
        _need(f"{SRC_ENV} does not name an unpacked llama.cpp tree (the sdist's vendor/llama.cpp)")
    for mod in ("torch", "transformers"):
        try:
            __import__(mod)
        except ImportError:
            _need(f"llama.cpp's converter needs {mod} (the interop extra)")
    return Path(src)


# The converter, run unmodified except for its vocabulary: its Kimi path loads the tokenizer with
# trust_remote_code, which k3ckpt never does, so set_vocab is replaced by one built from the
# checkpoint's tiktoken.model with k3ckpt's own reader (the same tokens and merges it derives).
HARNESS = """
import sys
from pathlib import Path
llama = Path(sys.argv[1])
sys.path[:0] = [str(llama), str(llama / "gguf-py")]
import gguf
import convert_hf_to_gguf
import importlib
from k3ckpt.gguf.vocab import kimi_vocab
module, cls, restore_eos = sys.argv[4], sys.argv[5], sys.argv[6] == "1"

def set_vocab(self):
    v = kimi_vocab(self.dir_model, self.hparams["vocab_size"])
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list(list(v.tokens))
    w.add_token_types(list(v.token_types))
    if v.merges:
        w.add_token_merges(list(v.merges))
    gguf.SpecialVocab(self.dir_model, load_merges=False).add_to_gguf(w)
    if restore_eos and (eos := self.hparams.get("eos_token_id")) is not None:   # what kimi_k3.py does
        w.add_eos_token_id(eos)

setattr(getattr(importlib.import_module("conversion." + module), cls), "set_vocab", set_vocab)
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "bf16"]
convert_hf_to_gguf.main()
"""


# fixture -> (converter module, model class, whether its set_vocab restores the config's eos)
CONVERTERS = {"k3-tiny": ("kimi_k3", "KimiK3Model", "1"), "kimi-k2-tiny": ("deepseek", "DeepseekV2Model", "0")}


def _convert(converter_dir, src, out, fixture):
    proc = subprocess.run([sys.executable, "-c", HARNESS, str(converter_dir), str(src), str(out),
                           *CONVERTERS[fixture]], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def converted(k3_tiny, converter_dir, tmp_path_factory):
    return _convert(converter_dir, k3_tiny, tmp_path_factory.mktemp("llama-converter") / "k3-tiny.gguf", "k3-tiny")


@pytest.fixture(scope="module")
def ours(k3_tiny, tmp_path_factory):
    ckpt = open_checkpoint(k3_tiny)
    d = tmp_path_factory.mktemp("ours")
    return {t: write_gguf(ckpt, d / f"k3-tiny-{t}.gguf", expert_type=t).paths[0] for t in ("mxfp4", "iq2_xs")}


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _bytes(t) -> bytes:
    return bytes(np.asarray(t.data).reshape(-1).view(np.uint8))


def _fields(path):
    r = gguf.GGUFReader(path)
    return {k: ([int(x) for x in f.types], f.contents()) for k, f in r.fields.items()
            if not k.startswith(("GGUF.", "general."))}


def _logits(llama_cpp, path) -> np.ndarray:
    m = llama_cpp.Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=64, n_threads=2, seed=0)
    m.eval(TOKENS)
    out = np.array(m.scores[:len(TOKENS)], dtype=np.float32)
    m.close()
    return out


def test_same_tensors_bytes_and_metadata_as_llama_cpps_converter(converted, ours):
    want, got = _tensors(converted), _tensors(ours["mxfp4"])
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        g = got[name]
        assert (g.tensor_type, list(g.shape)) == (t.tensor_type, list(t.shape)), name
        assert _bytes(g) == _bytes(t), name
    assert _fields(ours["mxfp4"]) == _fields(converted)
    general = gguf.GGUFReader(ours["mxfp4"]).fields
    assert general["general.architecture"].contents() == "kimi-k3"
    assert general["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_MXFP4_MOE


def test_llama_cpp_gives_identical_logits_on_both_files(llama_cpp, converted, ours):
    a, b = _logits(llama_cpp, converted), _logits(llama_cpp, ours["mxfp4"])
    assert np.isfinite(a).all() and a.std() > 0
    np.testing.assert_array_equal(a, b)


def _ggml_to_float(llama_cpp, ggml_type: int, raw: bytes, n: int) -> np.ndarray:
    """libggml's own decoder for ``ggml_type`` (its type traits' to_float), through ctypes."""
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))

    class Traits(ctypes.Structure):
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                    ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                    ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                    ("from_float_ref", ctypes.c_void_p)]

    lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
    traits = lib.ggml_get_type_traits(ctypes.c_int(ggml_type)).contents
    assert traits.type_name.decode().lower() == gguf.GGMLQuantizationType(ggml_type).name.lower()
    to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(traits.to_float)
    src = np.frombuffer(raw, np.uint8).copy()
    out = np.empty(n, np.float32)
    to_float(src.ctypes.data, out.ctypes.data, n)
    return out


def test_ggml_decodes_our_iq2_xs_experts_to_what_our_decoder_gives(llama_cpp, ours):
    from k3ckpt.formats.iq2xs import decode_iq2xs

    t = _tensors(ours["iq2_xs"])["blk.2.ffn_gate_exps.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.IQ2_XS
    raw = _bytes(t)
    n = int(np.prod([int(d) for d in t.shape]))
    ggml = _ggml_to_float(llama_cpp, int(t.tensor_type), raw, n)
    mine = decode_iq2xs(np.frombuffer(raw, np.uint8).reshape(-1, 74)).reshape(-1)
    np.testing.assert_array_equal(ggml, mine)


def _f32_expert_copy(src: Path, dst: Path, decoders=None) -> Path:
    """``src`` with every tensor of a type in ``decoders`` (ggml type -> (block bytes, decoder);
    default IQ2_XS) replaced by F32 holding our decode of its bytes."""
    from k3ckpt.formats.iq2xs import decode_iq2xs

    decoders = decoders or {gguf.GGMLQuantizationType.IQ2_XS: (74, decode_iq2xs)}

    r = gguf.GGUFReader(src)
    kvs = []
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        kind = int(f.types[0])
        if kind == C.ARRAY:
            kvs.append(C.KV(k, kind, f.contents(), int(f.types[1])))
        else:
            kvs.append(C.KV(k, kind, f.contents()))
    infos, data = [], []
    for t in r.tensors:
        shape = tuple(int(d) for d in t.shape)[::-1]
        raw = _bytes(t)
        if t.tensor_type in decoders:
            block, decode = decoders[t.tensor_type]
            x = decode(np.frombuffer(raw, np.uint8).reshape(-1, block)).astype(np.float32)
            infos.append(C.TensorInfo(t.name, int(gguf.GGMLQuantizationType.F32), shape))
            data.append(x.tobytes())
        else:
            infos.append(C.TensorInfo(t.name, int(t.tensor_type), shape))
            data.append(raw)
    with GGUFWriter(dst, kvs, infos) as w:
        for i, d in zip(infos, data):
            w.write(i.name, d)
    return dst


def test_llama_cpp_runs_iq2_xs_experts_as_we_decode_them(llama_cpp, ours, tmp_path):
    """The IQ2_XS file runs, and its logits are those of its own decoded values (an F32 copy)
    far more than those of the MXFP4 model it was cut from."""
    f32 = _f32_expert_copy(ours["iq2_xs"], tmp_path / "iq2_xs-as-f32.gguf")
    iq2, dec, mx = (_logits(llama_cpp, p) for p in (ours["iq2_xs"], f32, ours["mxfp4"]))
    assert np.isfinite(iq2).all()
    to_decoded = np.abs(iq2 - dec).max()
    to_mxfp4 = np.abs(iq2 - mx).max()
    assert to_decoded < to_mxfp4, (to_decoded, to_mxfp4)


@pytest.mark.parametrize("expert_type", ["iq1_s", "iq1_m", "iq2_xxs", "iq2_s", "q2_k", "iq3_xxs"])
def test_llama_cpp_runs_the_other_low_bit_types_as_we_decode_them(llama_cpp, k3_tiny, ours, tmp_path, expert_type):
    """IQ1_S, IQ1_M, IQ2_XXS, IQ2_S, Q2_K and IQ3_XXS experts: ggml's own decoder gives our decoder's values for
    every expert tensor, and llama.cpp runs the file as it runs an F32 copy holding those values."""
    from k3ckpt.formats import target_format

    fmt = target_format(expert_type)
    block = fmt.info.bytes_per_block

    def decode(packed):
        return fmt.decode({"packed": packed})
    with open_checkpoint(k3_tiny) as ckpt:
        path = write_gguf(ckpt, tmp_path / f"k3-{expert_type}.gguf", expert_type=expert_type).paths[0]
    experts = [t for n, t in _tensors(path).items() if "_exps" in n]
    assert experts and {t.tensor_type.name.lower() for t in experts} == {expert_type}
    for t in experts:
        raw = _bytes(t)
        n = int(np.prod([int(d) for d in t.shape]))
        mine = decode(np.frombuffer(raw, np.uint8).reshape(-1, block)).reshape(-1)
        np.testing.assert_array_equal(_ggml_to_float(llama_cpp, int(t.tensor_type), raw, n), mine)
    f32 = _f32_expert_copy(path, tmp_path / f"{expert_type}-as-f32.gguf", {experts[0].tensor_type: (block, decode)})
    got, dec, mx = (_logits(llama_cpp, p) for p in (path, f32, ours["mxfp4"]))
    assert np.isfinite(got).all()
    assert np.abs(got - dec).max() < np.abs(got - mx).max()


def test_kimi_k2_fp8_matches_the_converter_and_runs_the_same(llama_cpp, converter_dir, kimi_k2_tiny, tmp_path):
    """deepseek2 from block FP8: the converter dequantizes to BF16 (--outtype bf16); so do we, with
    bf16 experts. Same tensor bytes, same metadata, identical logits."""
    theirs = _convert(converter_dir, kimi_k2_tiny, tmp_path / "conv.gguf", "kimi-k2-tiny")
    with open_checkpoint(kimi_k2_tiny) as ckpt:
        mine = write_gguf(ckpt, tmp_path / "ours.gguf", expert_type="bf16").paths[0]
    want, got = _tensors(theirs), _tensors(mine)
    assert sorted(got) == sorted(want)
    differ = [n for n in want if _bytes(got[n]) != _bytes(want[n]) or got[n].tensor_type != want[n].tensor_type]
    assert differ == []
    assert _fields(mine) == _fields(theirs)
    np.testing.assert_array_equal(_logits(llama_cpp, theirs), _logits(llama_cpp, mine))


def test_kimi_k2_thinking_int4_matches_the_converter_and_runs_the_same(llama_cpp, converter_dir,
                                                                     kimi_k2_thinking_tiny, tmp_path):
    """deepseek2 from K2-Thinking's pack-quantized INT4 experts: the converter dequantizes them
    (dequant_packed) and writes BF16; so do we. Same bytes, same metadata, identical logits."""
    theirs = _convert(converter_dir, kimi_k2_thinking_tiny, tmp_path / "conv.gguf", "kimi-k2-tiny")
    with open_checkpoint(kimi_k2_thinking_tiny) as ckpt:
        mine = write_gguf(ckpt, tmp_path / "ours.gguf", expert_type="bf16").paths[0]
    want, got = _tensors(theirs), _tensors(mine)
    assert sorted(got) == sorted(want)
    assert [n for n in want if _bytes(got[n]) != _bytes(want[n]) or got[n].tensor_type != want[n].tensor_type] == []
    assert _fields(mine) == _fields(theirs)
    np.testing.assert_array_equal(_logits(llama_cpp, theirs), _logits(llama_cpp, mine))


def test_kimi_k2_yarn_rope_keys_match_the_converter(converter_dir, kimi_k2_tiny, tmp_path):
    """Kimi K2's real rope settings (YaRN, factor 32 from 4,096), set on the tiny K2's config."""
    import json
    import shutil

    src = tmp_path / "k2-yarn"
    shutil.copytree(kimi_k2_tiny, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(rope_theta=50000.0, rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                  "type": "yarn"})
    (src / "config.json").write_text(json.dumps(cfg))
    theirs = _convert(converter_dir, src, tmp_path / "conv.gguf", "kimi-k2-tiny")
    with open_checkpoint(src) as ckpt:
        mine = write_gguf(ckpt, tmp_path / "ours.gguf", expert_type="bf16").paths[0]
    got, want = _fields(mine), _fields(theirs)
    assert {k for k in want if ".rope." in k} >= {"deepseek2.rope.scaling.type", "deepseek2.rope.freq_base",
                                                    "deepseek2.rope.scaling.yarn_log_multiplier"}
    assert got == want


# gpt-oss: the converter runs unmodified but for its pre-tokenizer check, which names the pre-tokenizer
# by hashing the token ids of a probe text; only the real o200k vocabulary gives gpt-oss's hash (gpt-4o),
# so the tiny fixture's o200k-style tokenizer is named gpt-4o directly.
HARNESS_GPT_OSS = """
import sys
from pathlib import Path
llama = Path(sys.argv[1])
sys.path[:0] = [str(llama), str(llama / "gguf-py")]
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-4o"
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "bf16"]
convert_hf_to_gguf.main()
"""


def _convert_gpt_oss(converter_dir, src, out):
    proc = subprocess.run([sys.executable, "-c", HARNESS_GPT_OSS, str(converter_dir), str(src), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def gpt_oss_pair(converter_dir, gpt_oss_tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt-oss")
    theirs = _convert_gpt_oss(converter_dir, gpt_oss_tiny, d / "conv.gguf")
    with open_checkpoint(gpt_oss_tiny) as ckpt:
        mine = write_gguf(ckpt, d / "ours.gguf", expert_type="mxfp4").paths[0]
    return theirs, mine


def test_gpt_oss_matches_the_converter_and_runs_the_same(llama_cpp, gpt_oss_pair):
    """gpt-oss from its fused MXFP4 experts: gate/up split, the lossless repack, biases and sinks;
    every tensor byte-identical to the converter's, the same metadata, identical logits."""
    theirs, mine = gpt_oss_pair
    want, got = _tensors(theirs), _tensors(mine)
    assert sorted(got) == sorted(want)
    differ = [n for n in want if _bytes(got[n]) != _bytes(want[n]) or got[n].tensor_type != want[n].tensor_type
              or list(got[n].shape) != list(want[n].shape)]
    assert differ == []
    assert _fields(mine) == _fields(theirs)
    a, b = _logits(llama_cpp, theirs), _logits(llama_cpp, mine)
    assert np.isfinite(a).all() and a.std() > 0
    np.testing.assert_array_equal(a, b)


def test_llama_cpp_tokenizes_gpt_oss_text_as_the_tokenizer_json_does(llama_cpp, gpt_oss_pair, gpt_oss_tiny):
    """Our vocabulary in llama.cpp (gpt-4o pre-tokenizer, merges, specials): the token ids the
    tokenizers library gives, and no BOS added (the ByteLevel post-processor's add_bos_token = false)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(Path(gpt_oss_tiny) / "tokenizer.json"))
    m = llama_cpp.Llama(model_path=str(gpt_oss_pair[1]), vocab_only=True, verbose=False)
    for text in ("The experts of the model are stored in blocks of 32 values.",
                 "<|start|>user<|message|>Hi there, it's 2025!<|end|><|start|>assistant<think>",
                 "  spaces\n\nand newlines\t"):
        want = tok.encode(text).ids
        assert m.tokenize(text.encode(), add_bos=True, special=True) == want, text
        assert m.detokenize(want, special=True).decode() == text
    m.close()


def test_gpt_oss_real_config_keys_match_the_converter(converter_dir, gpt_oss_tiny, tmp_path):
    """openai/gpt-oss's config.json spells out the rope scaling (YaRN, factor 32 from 4,096) and the
    context the fixture leaves to transformers' defaults; the converter reads both the same way we do."""
    import json
    import shutil

    src = tmp_path / "gpt-oss-real-keys"
    shutil.copytree(gpt_oss_tiny, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(max_position_embeddings=65536, initial_context_length=4096, rope_theta=50000,
               rope_scaling={"beta_fast": 16.0, "beta_slow": 2.0, "factor": 16.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False})
    (src / "config.json").write_text(json.dumps(cfg))
    theirs = _convert_gpt_oss(converter_dir, src, tmp_path / "conv.gguf")
    with open_checkpoint(src) as ckpt:
        mine = write_gguf(ckpt, tmp_path / "ours.gguf", expert_type="mxfp4").paths[0]
    got, want = _fields(mine), _fields(theirs)
    assert want["gpt-oss.rope.scaling.factor"][1] == 16.0 and want["gpt-oss.context_length"][1] == 65536
    assert got == want
