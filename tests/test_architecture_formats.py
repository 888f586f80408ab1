"""The format registry is the one source of truth (docs/formats/README.md): ``formats`` sits
below ``requant``, code outside it names formats through ``formats.ids`` or asks the
registry, and what each format declares it can do is what works."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from k3ckpt.errors import UsageError
from k3ckpt.formats import get_format, ids, list_formats, recognise

PACKAGE = Path(__file__).resolve().parents[1] / "k3ckpt"

# the layers formats may import (docs/architecture.md)
FORMATS_MAY_IMPORT = {"formats", "errors", "io", "_numba", "units"}



def _k3ckpt_imports(path: Path) -> set[str]:
    """The k3ckpt packages a module imports (at the top or inside functions), by first component."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "k3ckpt":
                    out.add(parts[1] if len(parts) > 1 else "k3ckpt")
            else:
                here = list(path.relative_to(PACKAGE).parts[:-1])
                base = here[:max(0, len(here) - (node.level - 1))]
                target = base + (node.module.split(".") if node.module else [])
                out.update([target[0]] if target else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("k3ckpt."))
    return out


def _format_id_literals(path: Path, known: set[str]) -> set[str]:
    """The registered ids a module types as string constants (docstrings and f-string text aside)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
        if isinstance(node, ast.JoinedStr):   # the text pieces of an f-string are sentences, not ids
            docstrings.update(id(v) for v in node.values)
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value in known and id(n) not in docstrings}


def test_the_walkers_see_what_they_look_for(tmp_path):
    # walkers that found nothing would pass the tests below
    assert "requant" in _k3ckpt_imports(PACKAGE / "requant" / "worker.py")
    assert {"errors", "io"} <= _k3ckpt_imports(PACKAGE / "formats" / "base.py")
    probe = tmp_path / "probe.py"
    probe.write_text('"""moet-w2"""\ndef f():\n    """bf16"""\n    return "k3ckpt-mx2", f"{1}moet-w2"\n')
    assert _format_id_literals(probe, ids.BUILTIN) == {ids.MX2}


def test_formats_imports_nothing_above_it():
    for path in sorted((PACKAGE / "formats").glob("*.py")):
        assert _k3ckpt_imports(path) <= FORMATS_MAY_IMPORT, path.name


def test_ids_name_every_registered_format():
    assert ids.BUILTIN == {info.id for info in list_formats()}
    assert set(ids.MXFP4_LAYOUTS) <= ids.BUILTIN


def test_no_format_id_typed_outside_formats():
    known = {info.id for info in list_formats()}
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("formats/", "cli/")):   # the registry itself; the CLI's defaults and help
            continue
        hits = _format_id_literals(path, known)
        if hits:
            found[rel] = hits
    assert found == {}


# ------------------------------------------------------------ declared capabilities do what they say


def test_each_declared_method_is_what_the_planner_accepts():
    from k3ckpt.requant.plan import parse_format

    for info in list_formats():
        if not info.methods:
            continue
        assert parse_format(info.id).method == info.methods[0], info.id        # the first is the default
        for m in info.methods:
            assert parse_format(f"{info.id}:{m}").method == m, info.id
        with pytest.raises(UsageError, match=" or ".join(info.methods)):
            parse_format(f"{info.id}:no-such-method")
        with pytest.raises(UsageError, match="one of"):
            get_format(info.id).check_method("no-such-method")


def test_requant_hooks_are_reached_through_the_registry():
    """Every format that encodes from MXFP4 codes with its encoder in requant names a module
    that is there; the one-pass hook is a function of requant (importing formats alone)."""
    for info in list_formats():
        fmt = get_format(info.id)
        if fmt.encoder is not None:
            assert "mxfp4-codes" in info.encodes_from or info.can_encode, info.id
            assert fmt.encoder_module().__name__ == f"k3ckpt.requant.{fmt.encoder}"
        hook = fmt.one_pass_requant()
        if hook is not None:
            assert hook.__module__.startswith("k3ckpt.requant.") and info.methods, info.id
    assert get_format(ids.MOET_W2).one_pass_requant() is not None


def test_a_one_pass_format_refuses_an_unknown_method_with_the_list():
    hook = get_format(ids.MOET_W2).one_pass_requant()
    packed = np.zeros((1, 16), np.uint8)
    scale = np.full((1, 1), 127, np.uint8)
    with pytest.raises(UsageError, match=r"one of \['keep-scales', 'refit'\]"):
        hook(packed, scale, "nope")


def _config_declaring(key: str) -> dict:
    method, _, what = key.partition("/")
    if method == "compressed-tensors":
        return {"quant_method": method, "config_groups": {"group_0": {"format": what}}}
    if key == "fp8/block":
        return {"quant_method": "fp8", "weight_block_size": [128, 128]}
    if method == "modelopt":
        return {"quant_method": method, "quant_algo": what.upper()}
    assert not what, key
    return {"quant_method": method}


def test_every_declaration_is_recognised_as_its_format():
    declared = [(d, info.id) for info in list_formats() for d in info.declared_as]
    assert {fid for _, fid in declared} >= {ids.MXFP4_PACK, ids.GPT_OSS_MXFP4, ids.FP8_BLOCK, ids.INT4_PACK,
                                           ids.NVFP4, ids.NVFP4_MODELOPT, ids.FP8_E4M3}
    for key, fid in declared:
        assert recognise(_config_declaring(key)) == fid, key


def test_a_requant_output_is_recognised_by_its_source():
    """k3ckpt's own config: weights in no group keep the source's format (its groups name theirs)."""
    from k3ckpt.checkpoint.qconfig import build_config
    from k3ckpt.profiles import quant_hint

    source = {"quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}
    qc = build_config(source, {(ids.MOET_W2, "refit"): ["model.layers.1.mlp.experts.0.w1.weight"]})
    assert recognise(qc) == ids.MXFP4_PACK
    assert quant_hint({"quantization_config": qc}) == ids.MXFP4_PACK
    assert recognise({"quant_method": "awq"}) is None and recognise(None) is None
    assert recognise({"quant_method": "modelopt", "quant_algo": "FP8"}) is None
