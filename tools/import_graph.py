"""The import graph between k3ckpt's packages, read from the source with ``ast`` (nothing is
imported): ``python tools/import_graph.py`` prints one line per package with what it imports,
then the cycles (there should be none; ``tests/test_architecture.py`` holds that).

A node is a package (``k3ckpt/io/``) or a top-level module (``k3ckpt/api.py``); imports inside
functions count the same as module-level ones, since a lazy import is still a dependency.
``--modules`` prints module-level edges instead.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_imports(root: Path = ROOT, package: str = "k3ckpt") -> dict[str, set[str]]:
    """``{module: {k3ckpt modules it imports}}``, relative imports resolved; ``from X import
    name`` counts as importing ``X.name`` where that is a module, else ``X``."""
    files = sorted((root / package).rglob("*.py"))
    modules = {module_name(p, root) for p in files}
    out: dict[str, set[str]] = {}
    for path in files:
        mod = module_name(path, root)
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                src = ".".join(base + ([node.module] if node.module else []))
                names = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
            else:
                continue
            for name in names:
                while name not in modules and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in modules and name != mod and name.split(".")[0] == package:
                    targets.add(name)
        out[mod] = targets
    return out


def node_of(module: str) -> str:
    """The package (or top-level module) a module belongs to: ``k3ckpt.io.reader`` -> ``io``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "k3ckpt"


def package_graph(imports: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    imports = module_imports() if imports is None else imports
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, targets in imports.items():
        graph[node_of(mod)]
        for t in targets:
            if node_of(t) != node_of(mod):
                graph[node_of(mod)].add(node_of(t))
    return dict(graph)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", action="store_true", help="module-level edges instead of packages")
    args = ap.parse_args(argv)
    imports = module_imports()
    graph = imports if args.modules else package_graph(imports)
    for node in sorted(graph):
        print(f"{node:14s} -> {', '.join(sorted(graph[node])) or '-'}")
    found = cycles(graph)
    print("cycles: " + ("; ".join(" <-> ".join(c) for c in found) if found else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
