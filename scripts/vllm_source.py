"""Read vLLM's package sources with `ast`, importing nothing: modules, classes, and simple values."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

_MAPPER_FIELDS = {"orig_to_new_prefix": "prefix", "orig_to_new_substr": "substr", "orig_to_new_suffix": "suffix",
                  "orig_to_new_regex": "regex", "orig_to_new_stacked": "stacked",
                  "orig_to_new_renaming": "renaming"}


class Unknown(Exception):
    """An expression this reader cannot evaluate statically."""


@dataclass
class ClassRef:
    module: ModuleSource
    node: ast.ClassDef

    @property
    def qualname(self) -> str:
        return f"{self.module.name}.{self.node.name}"


@dataclass
class Regex:
    pattern: str


@dataclass
class ModuleSource:
    name: str
    path: Path
    tree: ast.Module
    assigns: dict[str, ast.expr] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local -> (module, attr)


class VllmSource:
    """vLLM's package sources, parsed on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root  # the `vllm` package directory
        self._modules: dict[str, ModuleSource | None] = {}

    def module(self, dotted: str) -> ModuleSource | None:
        if dotted in self._modules:
            return self._modules[dotted]
        parts = dotted.split(".")
        if parts[0] != "vllm":
            self._modules[dotted] = None
            return None
        base = self.root.joinpath(*parts[1:])
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not path.is_file():
            self._modules[dotted] = None
            return None
        tree = ast.parse(path.read_text(), str(path))
        mod = ModuleSource(dotted, path, tree)
        package = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
        for node in _top_level(tree.body):
            if isinstance(node, ast.ClassDef):
                mod.classes[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        mod.assigns[target.id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                mod.assigns[node.target.id] = node.value
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(package, node.module, node.level)
                for alias in node.names:
                    mod.imports.setdefault(alias.asname or alias.name, (source, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    mod.imports[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
        self._modules[dotted] = mod
        return mod

    def lookup(self, mod: ModuleSource, name: str, depth: int = 0):
        """What NAME is in MOD: a ClassRef, an evaluated value, or a module name (str)."""
        if depth > 20:
            raise Unknown(name)
        if name in mod.classes:
            return ClassRef(mod, mod.classes[name])
        if name in mod.assigns:
            return self.evaluate(mod.assigns[name], mod, depth + 1)
        if name in mod.imports:
            source, attr = mod.imports[name]
            if attr is None:
                return _ModuleName(source)
            other = self.module(source)
            if other is None:
                sub = self.module(f"{source}.{attr}")
                if sub is not None:
                    return _ModuleName(sub.name)
                raise Unknown(name)
            if attr not in other.classes and attr not in other.assigns and attr not in other.imports:
                sub = self.module(f"{source}.{attr}")
                if sub is not None:
                    return _ModuleName(sub.name)
            return self.lookup(other, attr, depth + 1)
        raise Unknown(name)

    def class_attr(self, ref: ClassRef, attr: str, depth: int = 0):
        """The value of class attribute ATTR on REF or its first base that sets it; raises KeyError if none."""
        for node in ref.node.body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
            if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                return self.evaluate(node.value, ref.module, depth + 1, owner=ref)
        for base in self.bases(ref):
            try:
                return self.class_attr(base, attr, depth + 1)
            except KeyError:
                continue
        raise KeyError(attr)

    def bases(self, ref: ClassRef) -> list[ClassRef]:
        found = []
        for base in ref.node.bases:
            try:
                value = self.evaluate(base, ref.module)
            except Unknown:
                continue
            if isinstance(value, ClassRef):
                found.append(value)
        return found

    def mro(self, ref: ClassRef) -> list[ClassRef]:
        seen: dict[str, ClassRef] = {}
        stack = [ref]
        while stack:
            cls = stack.pop(0)
            if cls.qualname in seen:
                continue
            seen[cls.qualname] = cls
            stack.extend(self.bases(cls))
        return list(seen.values())

    def evaluate(self, node: ast.expr, mod: ModuleSource, depth: int = 0, owner: ClassRef | None = None):
        if depth > 40:
            raise Unknown("too deep")
        ev = lambda n: self.evaluate(n, mod, depth + 1, owner)  # noqa: E731
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Dict):
            out: dict = {}
            for key, value in zip(node.keys, node.values):
                if key is None:
                    out.update(ev(value))
                else:
                    out[_hashable(ev(key))] = ev(value)
            return out
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = []
            for elt in node.elts:
                if isinstance(elt, ast.Starred):
                    items.extend(ev(elt.value))
                else:
                    items.append(ev(elt))
            return items
        if isinstance(node, ast.Name):
            if owner is not None:
                # A name in a class body may be an attribute set earlier in it.
                for item in owner.node.body:
                    if isinstance(item, ast.Assign) and any(
                            isinstance(t, ast.Name) and t.id == node.id for t in item.targets):
                        return self.evaluate(item.value, mod, depth + 1, owner)
            return self.lookup(mod, node.id, depth + 1)
        if isinstance(node, ast.Attribute):
            base = ev(node.value)
            if isinstance(base, ClassRef):
                try:
                    return self.class_attr(base, node.attr, depth + 1)
                except KeyError as exc:
                    raise Unknown(f"{base.qualname}.{node.attr}") from exc
            if isinstance(base, _ModuleName):
                other = self.module(base.name)
                if other is None:
                    raise Unknown(node.attr)
                return self.lookup(other, node.attr, depth + 1)
            raise Unknown(ast.unparse(node))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            left, right = ev(node.left), ev(node.right)
            if isinstance(left, Mapper) and isinstance(right, Mapper):
                return left.merged(right)
            if isinstance(left, dict) and isinstance(right, dict):
                return {**left, **right}
            raise Unknown(ast.unparse(node))
        if isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname == "WeightsMapper":
                if node.args:
                    raise Unknown("positional WeightsMapper")
                return Mapper({_MAPPER_FIELDS[kw.arg]: _mapper_field(kw.arg, ev(kw.value)) for kw in node.keywords})
            if fname == "compile" and node.args:
                return Regex(ev(node.args[0]))
            if fname == "dict" and not node.args:
                return {kw.arg: ev(kw.value) for kw in node.keywords}
            raise Unknown(ast.unparse(node))
        raise Unknown(ast.unparse(node))


@dataclass
class _ModuleName:
    name: str


@dataclass
class Mapper:
    """A `WeightsMapper`'s fields, as JSON-ready data."""

    fields: dict

    def merged(self, other: Mapper) -> Mapper:
        out = {key: (dict(value) if isinstance(value, dict) else list(value)) for key, value in self.fields.items()}
        for key, value in other.fields.items():
            if key in out and isinstance(value, dict):
                out[key] = {**out[key], **value}
            elif key in out:
                out[key] = out[key] + list(value)
            else:
                out[key] = value
        return Mapper(out)


def _mapper_field(arg: str, value):
    if arg == "orig_to_new_regex":
        return {(k.pattern if isinstance(k, Regex) else k): v for k, v in value.items()}
    if arg == "orig_to_new_stacked":
        return {k: [v[0], v[1]] for k, v in value.items()}
    if arg == "orig_to_new_renaming":
        raise Unknown("WeightRenaming")
    return value


def _hashable(key):
    if isinstance(key, Regex):
        return key.pattern
    if isinstance(key, list):
        return tuple(key)
    return key


def _top_level(body: list[ast.stmt]):
    """A module's statements, with those of top-level `if`/`try` blocks (platform-dependent imports) in order."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
        else:
            yield node


def _absolute(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")
    if level > 1:
        parts = parts[: -(level - 1)]
    return ".".join(parts + ([module] if module else []))
