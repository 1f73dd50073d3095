"""A vLLM release's `.py` files read with `ast` (nothing imported): definitions, re-exports, class members, digests."""

from __future__ import annotations

import ast
import hashlib
import zipfile
from pathlib import Path


class Source:
    """The `.py` files of a vLLM tree: a wheel (read from the zip) or a directory holding `vllm/`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        self._trees: dict[str, ast.Module | None] = {}

    def text(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            if self._zip is not None:
                try:
                    return self._zip.read(name).decode("utf-8")
                except KeyError:
                    continue
            elif (self.path / name).is_file():
                return (self.path / name).read_text(encoding="utf-8")
        return None

    def is_package(self, module: str) -> bool:
        name = module.replace(".", "/") + "/__init__.py"
        return name in self._zip.namelist() if self._zip is not None else (self.path / name).is_file()

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self.text(module)
            self._trees[module] = ast.parse(text) if text is not None else None
        return self._trees[module]


def _top_level(body: list[ast.stmt]):
    """Statements at module level, inside `if`/`try` blocks too (`if TYPE_CHECKING:`, optional imports)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody
                                  + [s for h in node.handlers for s in h.body])
        else:
            yield node


def _defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def find_definition(source: Source, module: str, name: str, hops: int = 6) -> tuple[str, ast.stmt] | None:
    """(defining module, node) of NAME as seen from MODULE, following `from X import NAME` re-exports."""
    tree = source.tree(module)
    if tree is None or hops < 0:
        return None
    found = None
    for node in _top_level(tree.body):
        if _defines(node, name):
            found = (module, node)  # the last definition wins, as at run time
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    origin = _absolute(module, node, source)
                    target = f"{origin}.{alias.name}"
                    if source.tree(target) is not None and alias.name != name:
                        found = (target, node)
                    else:
                        found = find_definition(source, origin, alias.name, hops - 1) or found
    if found is None and source.tree(f"{module}.{name}") is not None:
        return (f"{module}.{name}", tree)  # a submodule
    return found


def _absolute(module: str, node: ast.ImportFrom, source: Source) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if source.is_package(module) else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _class_members(source: Source, module: str, node: ast.ClassDef, depth: int = 0) -> set[str]:
    members: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            members.add(item.name)
            for sub in ast.walk(item):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                    sub, ast.AnnAssign | ast.AugAssign) else []
                for target in targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id == "self":
                        members.add(target.attr)
        elif isinstance(item, ast.Assign):
            members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
    if depth < 8:
        for base in node.bases:
            base_name = base.id if isinstance(base, ast.Name) else None
            if base_name is None:
                continue
            found = find_definition(source, module, base_name)
            if found and isinstance(found[1], ast.ClassDef):
                members |= _class_members(source, found[0], found[1], depth + 1)
    return members


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if names[:1] in (["self"], ["cls"]):
        names = names[1:]
    return names + ([f"*{args.vararg.arg}"] if args.vararg else []) + [a.arg for a in args.kwonlyargs]


def _without_docstrings(node: ast.AST) -> ast.AST:
    node = ast.parse(ast.unparse(node))  # a copy
    for sub in ast.walk(node):
        body = getattr(sub, "body", None)
        if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            sub.body = body[1:] or [ast.Pass()]
    return node


def _definitions(source: Source, module: str) -> dict[str, str] | None:
    """Top-level definition name -> hash of its AST (docstrings left out), for one module."""
    tree = source.tree(module)
    if tree is None:
        return None
    found = {}
    for node in _top_level(tree.body):
        names = [node.name] if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else \
            [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else \
            [node.target.id] if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) else []
        for name in names:
            found[name] = definition_digest(node)
    return found


def definition_digest(node: ast.AST) -> str:
    """12 hex digits of sha256 over the definition's source as `ast.unparse` writes it, docstrings left out
    (formatting and comments do not count; `vllm_compat.REVIEWED_CHANGES` records these)."""
    return hashlib.sha256(ast.unparse(_without_docstrings(node)).encode()).hexdigest()[:12]


def method_node(source: Source, module: str, qualname: str) -> ast.FunctionDef | None:
    """The def of `Class.method` (QUALNAME) in MODULE, following re-exports of the class; None if absent."""
    class_name, _, method = qualname.partition(".")
    found = find_definition(source, module, class_name)
    if found is None or not isinstance(found[1], ast.ClassDef):
        return None
    return next((item for item in found[1].body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                 and item.name == method), None)


def _constant(source: Source, module: str, name: str):
    found = find_definition(source, module, name)
    if found is None or not isinstance(found[1], ast.Assign | ast.AnnAssign):
        return None
    try:
        return ast.literal_eval(found[1].value)
    except ValueError:
        return None
