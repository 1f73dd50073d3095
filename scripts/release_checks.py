"""The source checks of a vLLM release: layerwise's private symbols, copied rules, rerun hooks, architecture table."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version
from release_source import (
    Source,
    _class_members,
    _constant,
    _definitions,
    _parameters,
    definition_digest,
    find_definition,
    method_node,
)

# The lists are read through vllm_compat, as the worker reads them (a test patches them there); the checkout is on
# sys.path: scripts/check_vllm_release.py put it there.
from layerwise_cli import vllm_compat
from layerwise_cli.planning import arch_table
from layerwise_cli.vllm_symbols import CommandFlag, CopiedRule, PrivateSymbol

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Row:
    check: str
    subject: str
    ok: bool
    detail: str


def check_symbol(source: Source, symbol: PrivateSymbol, version: str = "0") -> Row:
    """One PRIVATE entry against SOURCE (release VERSION): in its module or, moved, in one of `moved_to`."""
    row = lambda ok, detail: Row("symbol", symbol.label, ok, detail)  # noqa: E731
    found = where_defined(source, symbol)
    if found is None and symbol.since is not None and _older(version, symbol.since):
        return row(True, f"absent, as in every release before {symbol.since} (layerwise keeps the older behaviour)")
    if found is None:
        modules = [m for m in symbol.modules if source.tree(m) is not None]
        if not modules:
            return row(False, f"module {' or '.join(symbol.modules)} is missing")
        if symbol.nested:
            return row(False, f"no def {symbol.name} in {' or '.join(modules)}")
        return row(False, f"{symbol.name} is not defined in {' or '.join(modules)}")
    module, node = found
    moved = "" if module == symbol.module else f" (moved to {module})"
    if symbol.name is None:
        return row(True, f"module present{moved}")
    if symbol.nested:
        return row(True, f"nested def present{moved}")
    where, node = node
    at = moved or ("" if where == module else f" (from {where})")
    if symbol.kind == "class":
        if not isinstance(node, ast.ClassDef):
            return row(False, f"{symbol.name} is no longer a class{at}")
        missing = [m for m in symbol.members if m not in _class_members(source, where, node)]
        if missing:
            return row(False, f"class {symbol.name}{at} has no {', '.join(missing)}")
        return row(True, f"class{at}" + (f"; members {', '.join(symbol.members)}" if symbol.members else ""))
    if symbol.kind == "function":
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return row(False, f"{symbol.name} is no longer a function{at}")
        params = _parameters(node)
        if symbol.parameters is not None and params[: len(symbol.parameters)] != list(symbol.parameters):
            return row(False, f"signature ({', '.join(params)}){at}, layerwise passes "
                       f"({', '.join(symbol.parameters)})")
        return row(True, f"def {symbol.name}({', '.join(params)}){at}")
    if symbol.kind == "attribute":
        if not isinstance(node, ast.Assign | ast.AnnAssign | ast.ImportFrom):
            return row(False, f"{symbol.name} is a {type(node).__name__}{at}, not a module attribute")
        return row(True, f"attribute{at}")
    return row(False, f"unknown kind {symbol.kind!r} in vllm_compat")


def where_defined(source: Source, symbol: PrivateSymbol) -> tuple[str, object] | None:
    """(module, definition) of SYMBOL in the first of its modules that has it; a module symbol's definition is
    its tree, a nested def's the def node, any other `find_definition`'s (defining module, node)."""
    for module in symbol.modules:
        tree = source.tree(module)
        if tree is None:
            continue
        if symbol.name is None:
            return module, tree
        if symbol.nested:
            defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                    and n.name == symbol.name]
            if defs:
                return module, defs[0]
            continue
        found = find_definition(source, module, symbol.name)
        if found is not None:
            return module, found
    return None


def _older(version: str, than: str) -> bool:
    try:
        return Version(version) < Version(than)
    except InvalidVersion:
        return False


def check_flag(source: Source, flag: CommandFlag) -> Row:
    """FLAG declared (`add_argument(..., "FLAG", ...)`) in one of its modules of SOURCE."""
    for module in flag.modules:
        tree = source.tree(module)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"
                    and any(isinstance(a, ast.Constant) and a.value == flag.flag for a in node.args)):
                return Row("flag", flag.flag, True, f"declared in {module}")
    return Row("flag", flag.flag, False, f"{flag.flag} is not declared in {' or '.join(flag.modules)}; "
               f"layerwise passes it: {flag.used_by}")


def check_rule(release: Source, installed: Source, rule: CopiedRule) -> list[Row]:
    """One COPIED_RULES entry: the release's definitions against the installed vLLM's, and the constant's value.

    A definition that differs passes only if `vllm_compat.REVIEWED_CHANGES` holds a review of exactly the
    release's definition (its digest; `removed` for one the release dropped): one row per review, with its verdict.
    """
    subject = f"{rule.name}: {rule.module.removeprefix('vllm.')}"
    new, old = _definitions(release, rule.module), _definitions(installed, rule.module)
    if new is None or old is None:
        which = "release" if new is None else "installed vLLM"
        return [Row("rule", subject, False, f"module missing in the {which}")]
    names = list(rule.definitions) or sorted(old.keys() | new.keys())
    changed = [n for n in names if n in old and n in new and old[n] != new[n]]
    gone = [n for n in names if n in old and n not in new]
    added = [n for n in names if n not in old and n in new]
    absent = [n for n in names if n not in old and n not in new]
    reviews = {(r.module, r.definition, r.digest): r for r in vllm_compat.REVIEWED_CHANGES}
    reviewed = {n: reviews.get((rule.module, n, new.get(n, "removed"))) for n in changed + gone + added}
    reviewed = {n: review for n, review in reviewed.items() if review is not None}
    unreviewed = [("changed", changed), ("removed", gone), ("added", added)]
    parts = [f"{label}: {', '.join(names_)}" for label, names_ in
             [(label, [n for n in found if n not in reviewed]) for label, found in unreviewed]
             + [("not found", absent)] if names_]
    same = len(names) - len(changed) - len(gone) - len(added) - len(absent)
    detail = "; ".join(parts) or (f"{same} definitions unchanged since the installed vLLM"
                                  + (f", {len(reviewed)} changed and reviewed (below)" if reviewed else ""))
    rows = [Row("rule", subject, not parts, detail)]
    short = rule.module.removeprefix("vllm.model_executor.").removeprefix("model_loader.")
    rows += [Row("reviewed", f"{short}.{n}", True, f"{review.release} ({review.digest}): {review.verdict}")
             for n, review in reviewed.items()]
    if rule.constant and rule.copied_value:
        value = _constant(release, rule.module, rule.constant)
        module, attr = rule.copied_value
        copied = getattr(importlib.import_module(module), attr)
        rows.append(Row("rule", f"{rule.name}: {rule.constant}", value == copied,
                        f"release {value!r}, layerwise ({module.rsplit('.', 1)[-1]}.{attr}) {copied!r}"))
    return rows


def check_hooks(source: Source) -> list[Row]:
    """The reviewed hooks, in a release that reruns module hooks after a reload (0.34's `finalize_model_weights`)."""
    if where_defined(source, vllm_compat.FINALIZE_MODEL_WEIGHTS) is None:
        return [Row("hook", "finalize_model_weights", True, "absent: the release reruns no module's own hook after "
                    "a reload (nothing to review)")]
    return [check_hook(source, hook) for hook in vllm_compat.IDEMPOTENT_HOOKS]


def check_hook(source: Source, hook) -> Row:
    """One `vllm_compat.IDEMPOTENT_HOOKS` entry: the release's text of the hook must be the one reviewed."""
    subject = f"{hook.module.removeprefix('vllm.model_executor.')}.{hook.qualname}"
    node = method_node(source, hook.module, hook.qualname)
    if node is None:
        return Row("hook", subject, False, "not found in the release: layerwise skips no layer holding it (safe, "
                   "slower); review the hook that replaced it")
    digest = definition_digest(node)
    if digest != hook.digest:
        return Row("hook", subject, False, f"changed since reviewed ({hook.release}, {hook.digest}; now {digest}): "
                   "read it again; is it still safe to rerun on a layer that was not re-sent?")
    return Row("hook", subject, True, f"as reviewed for {hook.release}: {hook.verdict}")


def check_architectures(source: Source, version: str, work: Path) -> list[Row]:
    """The planner's architecture table of VERSION against the table generated from the release's source."""
    committed = arch_table.table_for(version)
    if committed is None:
        have = ", ".join(str(t["vllm_version"]) for t in arch_table.tables())
        return [Row("architecture", "table", False, f"no committed table for vLLM {version} (have {have}): run "
                    "scripts/gen_arch_table.py --vllm-root UNPACKED/vllm --out "
                    "layerwise_cli/planning/architectures-release.json")]
    generated = _generator().generate(_package_dir(source, work))["architectures"]
    expected = committed["architectures"]
    rows = []
    for arch in sorted(set(expected) | set(generated)):
        if expected.get(arch) != generated.get(arch):
            what = ("new in the release" if arch not in expected else "gone from the release"
                    if arch not in generated else "entry differs: " + ", ".join(
                        sorted(k for k in set(expected[arch]) | set(generated[arch])
                               if expected[arch].get(k) != generated[arch].get(k))))
            rows.append(Row("architecture", arch, False, what))
    if not rows:
        rows.append(Row("architecture", "table", True, f"{len(generated)} architectures of {version} equal the "
                        "committed table"))
    return rows


def _generator():
    spec = importlib.util.spec_from_file_location("gen_arch_table", HERE / "gen_arch_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _package_dir(source: Source, work: Path) -> Path:
    """The release's `vllm` package as a directory of `.py` files (a wheel is unpacked into WORK)."""
    if source._zip is None:
        return source.path / "vllm"
    out = work / "unpacked"
    for name in source._zip.namelist():
        if name.startswith("vllm/") and name.endswith(".py"):
            source._zip.extract(name, out)
    return out / "vllm"
