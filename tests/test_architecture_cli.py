"""The CLI is thin: its modules import nothing of the package but ``api``, ``errors`` and the
rendering module (and the package itself, for ``__version__``); no library module imports the CLI
(``__main__``, which runs it, aside)."""

from __future__ import annotations

import ast
from pathlib import Path

import k3ckpt

PACKAGE = Path(k3ckpt.__file__).parent
ALLOWED = {"k3ckpt", "k3ckpt.api", "k3ckpt.errors", "k3ckpt.render"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, those inside functions too, relative
    ones resolved against the module's package; ``from X import name`` counts ``X.name`` when
    that is a module of the package (``from .. import api`` is ``k3ckpt.api``)."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(rel.parts[:-1])   # a module's package; an __init__'s is its own folder too
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{mod}.{a.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").is_file() or \
                    (PACKAGE.parent / Path(*sub.split(".")) / "__init__.py").is_file()
                out.append((node.lineno, sub if is_module else mod))
    return out


def test_the_resolver_sees_relative_and_nested_imports():
    # the walk must see what the CLI modules actually hold, or the test below proves nothing
    found = {m for _, m in _imports(PACKAGE / "cli" / "plan.py")}
    assert "k3ckpt.api" in found and "k3ckpt.cli.render" in found
    found = {m for _, m in _imports(PACKAGE / "cli" / "main.py")}
    assert {"k3ckpt", "k3ckpt.errors"} <= found


def test_cli_imports_only_api_errors_and_rendering():
    bad = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for line, mod in _imports(path):
            if mod.split(".")[0] != "k3ckpt" or mod.startswith("k3ckpt.cli"):
                continue   # third-party, or a sibling in cli/
            if mod not in ALLOWED:
                bad.append(f"cli/{path.name}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_no_library_module_imports_the_cli():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "cli") in path.parents or path == PACKAGE / "__main__.py":   # python -m k3ckpt runs the CLI
            continue
        bad += [f"{path.relative_to(PACKAGE)}:{line} imports {mod}" for line, mod in _imports(path)
                if mod == "k3ckpt.cli" or mod.startswith("k3ckpt.cli.")]
    assert not bad, "\n".join(bad)
