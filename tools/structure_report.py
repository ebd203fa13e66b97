"""Structure figures of the source tree: files past 400 lines, functions past 80 lines, import cycles.

    python tools/structure_report.py [ROOT] [--json]

Import cycles are the strongly connected components of the graph of imports between the project's
modules (`engine`, `kernels`, `gateway`, `policies`, `modeltools`, `evals`), counted twice: every import (function-level
and `TYPE_CHECKING` ones too, since they still tie two files together) and module-level imports only
(what Python executes at import time). Tests and this folder are not scanned.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

PACKAGES = ("engine", "kernels", "gateway", "policies", "modeltools", "evals")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 80


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool, mods: dict[str, Path]) -> list[str]:
    """The project modules an import statement names (`from pkg import sub` names the submodule, not `pkg`)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this module's package
            base = module.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]
    else:
        return []
    out = []
    for name in names:  # the longest project module the name points at
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def import_graph(root: Path, top_level_only: bool) -> dict[str, set[str]]:
    mods = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = tree.body if top_level_only else ast.walk(tree)
        for node in nodes:
            graph[mod].update(_imported(node, mod, path.name == "__init__.py", mods))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def long_functions(root: Path) -> list[tuple[str, str, int]]:
    out = []
    for path in modules(root).values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append((str(path.relative_to(root)), node.name, n))
    return sorted(out, key=lambda r: -r[2])


def long_classes(root: Path, limit: int = 200) -> list[tuple[str, str, int]]:
    out = []
    for path in modules(root).values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                out.append((str(path.relative_to(root)), node.name, node.end_lineno - node.lineno + 1))
    return sorted(out, key=lambda r: -r[2])


def long_files(root: Path) -> list[tuple[str, int]]:
    out = [(str(p.relative_to(root)), len(p.read_text().splitlines())) for p in modules(root).values()]
    return sorted([r for r in out if r[1] > MAX_FILE_LINES], key=lambda r: -r[1])


def function_level_imports(root: Path) -> int:
    n = 0
    for path in modules(root).values():
        tree = ast.parse(path.read_text(), str(path))
        top = {id(node) for node in tree.body}
        n += sum(1 for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in top)
    return n


def report(root: Path) -> dict:
    return {
        "files_over_400_lines": long_files(root),
        "functions_over_80_lines": long_functions(root),
        "classes_over_200_lines": long_classes(root),
        "import_cycles_all_imports": cycles(import_graph(root, top_level_only=False)),
        "import_cycles_module_level": cycles(import_graph(root, top_level_only=True)),
        "non_top_level_imports": function_level_imports(root),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = report(Path(args.root))
    if args.json:
        print(json.dumps(r, indent=1))
        return
    for key, rows in r.items():
        if isinstance(rows, int):
            print(f"{key}: {rows}")
            continue
        print(f"{key}: {len(rows)}")
        for row in rows:
            print("   ", " <-> ".join(row) if key.startswith("import") else "  ".join(map(str, row)))


if __name__ == "__main__":
    main()
