"""Fail when layerwise_cli's modules import each other in a cycle (deferred imports inside functions count too).

Builds the import graph with `ast` (nothing is imported), then looks for
strongly connected components. An import inside a function is still an edge:
it hides a cycle from Python's import machinery, not from a reader.

Usage: python scripts/check_import_cycles.py [PACKAGE_DIR]   (default: layerwise_cli)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package modules that `name` (at `path`) imports, resolved to modules in `modules`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from . import x` may name a submodule; else the names come from `stem` itself.
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` imports a, a.b and a.b.c; the deepest known module is the edge.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parent.parent / "layerwise_cli").resolve()
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    # A package imports its parent package's __init__ implicitly; only explicit imports are edges here.
    graph = {name: imports_of(path, name, set(paths)) for name, path in paths.items()}
    found = cycles(graph)
    for component in found:
        members = set(component)
        edges = ", ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a] & members))
        print(f"import cycle: {' <-> '.join(component)} ({edges})", file=sys.stderr)
    if not found:
        print(f"no import cycles among {len(graph)} modules of {root.name}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
