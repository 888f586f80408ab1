"""Special token ids, add-token flags, chat template and normalizer flags, as llama.cpp's converter
derives them from a model folder's JSON files (``gguf.SpecialVocab``), without running code.

The converter's ``SpecialVocab`` (gguf-py in the llama-cpp-python 0.3.36 sdist) is the spec,
rewritten here because the PyPI ``gguf`` 0.19.0 that k3ckpt installs ships an older one: it
omits the ``add_bos/eos_token = false`` a ByteLevel post-processor implies (gpt-oss's
tokenizer.json has one; without the keys llama.cpp would prepend a BOS the model never saw),
the normalizer keys, and lets tokenizer_config.json overrule the post-processor. The rules:

1. ``tokenizer.json``: normalizer flags (Lowercase / StripAccents / BertNormalizer, nested
   in Sequence); the post-processor's add flags (ByteLevel: bos/eos false unless set later;
   RobertaProcessing: bos/eos/sep true; TemplateProcessing: the leading / trailing special
   tokens of ``single`` and the separator of ``pair``, which may rename bos/cls/eos/sep and
   move the old eos to eot / eom);
2. ``tokenizer_config.json``: the chat template (its ``chat_template``, else
   ``chat_template.jinja`` plus ``additional_chat_templates/*.jinja``, else
   ``chat_template.json``), ``add_<kind>_token`` where step 1 left it unset, and each
   ``<kind>_token``'s id: the first ``added_tokens`` entry of tokenizer.json with its content;
3. ``config.json`` (or its ``text_config``): ``<kind>_token_id`` for kinds still unset.

Only the kinds GGUFWriter has keys for are written (no ``cls`` id; add flags for bos, eos, sep).
"""

from __future__ import annotations

import json
from pathlib import Path
from string import ascii_letters, digits
from typing import Any

from ..errors import InvalidFileError
from . import container as C

KINDS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# kind -> tokenizer.ggml key suffix, for the kinds GGUFWriter writes (add_<kind>_token_id)
ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
           "pad": "padding_token_id", "mask": "mask_token_id", "eot": "eot_token_id", "eom": "eom_token_id"}
ADD_KINDS = ("bos", "eos", "sep")          # GGUFWriter's add_add_<kind>_token


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidFileError(f"not JSON: {exc}", file=str(path)) from None


class _Specials:
    """The converter's ``SpecialVocab`` state while it reads a folder."""

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.add: dict[str, bool] = {}
        self.kinds: tuple[str, ...] = KINDS
        self.chat_template: Any = None
        self.lowercase: bool | None = None
        self.strip_accents: bool | None = None

    def set_id(self, kind: str, tid: Any, where: Path) -> None:
        if not isinstance(tid, int):
            return
        if tid < 0:
            raise InvalidFileError(f"{kind} token id {tid} is negative", file=str(where))
        self.ids.setdefault(kind, tid)

    def normalizer(self, n: dict) -> None:
        kind = n.get("type")
        if kind == "Lowercase":
            self.lowercase = True
        elif kind == "StripAccents":
            self.strip_accents = True
        elif kind == "BertNormalizer":
            if "lowercase" in n:
                self.lowercase = n["lowercase"]
            if "strip_accents" in n:
                self.strip_accents = n["strip_accents"]
        elif kind == "Sequence":
            for sub in n.get("normalizers", []):
                self.normalizer(sub)


def _first_special(items: list, at: int):
    return items[at].get("SpecialToken", {}).get("id") if items else None


def _template(s: _Specials, proc: dict, cfg: dict | None, tok: dict) -> None:
    """TemplateProcessing: ``tok`` holds the bos/cls/eos/sep token strings, updated in place (and
    ``cfg`` with them, as the converter does)."""
    single, pair = proc.get("single", []), proc.get("pair", [])
    first = last = None
    if len(single) > 1:
        if first := _first_special(single, 0):
            if not cfg:
                tok["bos"] = first
            elif first not in (tok["bos"], tok["cls"]):
                if not tok["bos"]:
                    cfg["bos_token"] = tok["bos"] = first
                if not tok["cls"]:
                    cfg["cls_token"] = tok["cls"] = first
            s.add["bos"] = first in (tok["bos"], tok["cls"])
        if last := _first_special(single, -1):
            if not cfg:
                tok["eos"] = last
            elif last != tok["eos"]:
                for extra in ("eot", "eom"):       # the old eos becomes eot (or eom) before it is replaced
                    if extra not in s.kinds:
                        s.kinds += (extra,)
                        cfg[f"{extra}_token"] = tok["eos"]
                        break
                cfg["eos_token"] = tok["eos"] = last
            s.add["eos"] = last == tok["eos"]
    if not pair:
        return
    start = 1 if first and _first_special(pair, 0) == first else 0
    stop = -1 if last and _first_special(pair, -1) == last else None
    pair = pair[start:stop]
    if not pair or pair[0].get("Sequence", {}).get("id") != "A" or pair[-1].get("Sequence", {}).get("id") != "B":
        return
    middle = pair[1:-1]
    if not middle:
        return
    add_sep = False
    if (entry := _first_special(middle, 0)) and entry in (tok["sep"], tok["eos"]) and not last:
        add_sep = True
    if len(middle) == 2 and (entry := _first_special(middle, 1)) and entry in (tok["sep"], tok["eos"]):
        add_sep = True
    s.add["sep"] = add_sep
    if add_sep and not tok["sep"] and cfg:
        cfg["sep_token"] = tok["eos"]


def _from_tokenizer_files(s: _Specials, root: Path) -> None:
    tj_path, cfg_path = root / "tokenizer.json", root / "tokenizer_config.json"
    tj = read_json(tj_path) if tj_path.is_file() else None
    added = []
    if tj:
        if n := tj.get("normalizer"):
            s.normalizer(n)
        added = tj.get("added_tokens", [])
    cfg = read_json(cfg_path) if cfg_path.is_file() else None
    if tj:
        c = cfg or {}
        tok = {k: c.get(f"{k}_token") for k in ("bos", "cls", "eos", "sep")}
        if not tok["bos"] and tok["cls"] and cfg:
            cfg["bos_token"] = tok["bos"] = tok["cls"]
        if not tok["eos"] and tok["sep"] and cfg:
            cfg["eos_token"] = tok["eos"] = tok["sep"]
        post = tj.get("post_processor") or {}
        for proc in post.get("processors", [post]) if post else []:
            kind = proc.get("type")
            if kind == "ByteLevel":
                s.add.setdefault("bos", False)
                s.add.setdefault("eos", False)
            elif kind == "RobertaProcessing":
                s.add.update(bos=True, eos=True, sep=True)
                if not tok["cls"] and cfg:
                    cfg["cls_token"] = tok["cls"] = proc.get("cls", [tok["bos"]])[0]
                if not tok["sep"] and cfg:
                    cfg["sep_token"] = tok["sep"] = proc.get("sep", [tok["eos"]])[0]
            elif kind == "TemplateProcessing":
                _template(s, proc, cfg, tok)
    if not cfg:
        return
    s.chat_template = _chat_template(root, cfg)
    for kind in s.kinds:
        flag = cfg.get(f"add_{kind}_token")
        if isinstance(flag, bool):
            s.add.setdefault(kind, flag)
        entry = cfg.get(f"{kind}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(content, str):
            s.set_id(kind, next((a.get("id") for a in added if a.get("content") == content), None), tj_path)


def _chat_template(root: Path, cfg: dict):
    alt = None
    jinja, as_json = root / "chat_template.jinja", root / "chat_template.json"
    if jinja.is_file():
        alt = jinja.read_text(encoding="utf-8")
        more = sorted((root / "additional_chat_templates").glob("*.jinja"))
        if more:
            alt = [{"name": "default", "template": alt}] + [
                {"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in more]
    elif as_json.is_file():
        alt = read_json(as_json).get("chat_template")
    template = cfg.get("chat_template", alt)
    return template if template is None or isinstance(template, (str, list)) else None


def _from_config(s: _Specials, root: Path) -> None:
    path = root / "config.json"
    if not path.is_file():
        return
    config = read_json(path)
    for kind in s.kinds:
        tid = config.get(f"{kind}_token_id")
        if tid is None and "text_config" in config:
            tid = config["text_config"].get(f"{kind}_token_id")
        s.set_id(kind, tid, path)


def special_metadata(model_dir: str | Path) -> list[C.KV]:
    """The ``tokenizer.ggml.*`` special-token keys and ``tokenizer.chat_template*`` of a folder,
    in the order GGUFWriter's ``SpecialVocab.add_to_gguf`` adds them (merges aside)."""
    root = Path(model_dir)
    s = _Specials()
    _from_tokenizer_files(s, root)
    _from_config(s, root)
    out = [C.KV(f"tokenizer.ggml.{ID_KEYS[k]}", C.UINT32, tid) for k, tid in s.ids.items() if k in ID_KEYS]
    out += [C.KV(f"tokenizer.ggml.add_{k}_token", C.BOOL, bool(v)) for k, v in s.add.items() if k in ADD_KINDS]
    out += _template_kvs(s.chat_template)
    for key, v in (("lowercase", s.lowercase), ("strip_accents", s.strip_accents)):
        if v is not None:
            out.append(C.KV(f"tokenizer.ggml.normalizer.{key}", C.BOOL, bool(v)))
    return out


def _template_kvs(template) -> list[C.KV]:
    """GGUFWriter.add_chat_template: a string, or named templates ('default' is the plain key;
    names reduced to letters, digits and '_')."""
    if template is None:
        return []
    if isinstance(template, str):
        return [C.KV("tokenizer.chat_template", C.STRING, template)]
    default, named = None, {}
    for choice in template:
        name = "".join(c if c in ascii_letters + digits else "_" for c in choice.get("name", ""))
        body = choice.get("template")
        if name and body is not None:
            if name == "default":
                default = body
            else:
                named[name] = body
    out = [C.KV(f"tokenizer.chat_template.{n}", C.STRING, body) for n, body in named.items()]
    if named:
        out.append(C.KV("tokenizer.chat_templates", C.ARRAY, sorted(named), C.STRING))
    if default is not None:
        out.append(C.KV("tokenizer.chat_template", C.STRING, default))
    return out
