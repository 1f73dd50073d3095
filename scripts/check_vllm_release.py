"""Check vLLM's newest release against what layerwise uses of it, from the wheel's source (no install, no GPU).

1. Symbols: every entry of `layerwise_cli.vllm_compat.PRIVATE` (module, class,
   function, module attribute; a class's members; a function's parameters) is
   looked up in the release's `.py` files, parsed with `ast` (nothing of the
   release is imported; re-exports are followed), in its module or one it
   moved to (`moved_to`); one added in a later release (`since`) may be absent
   from an older one.
2. Copied rules: every `vllm_compat.COPIED_RULES` entry (the read order, the
   vocabulary padding, the completion rule) is compared definition by
   definition (source without docstrings) with the installed vLLM, the one the
   engine tests run on; a definition that differs passes only with a review of
   exactly its text (`vllm_compat.REVIEWED_CHANGES`); a constant is compared
   with layerwise's copy of it.
3. Hooks: in a release that reruns module hooks after a reload (0.34's
   `finalize_model_weights`), each hook reviewed as safe to rerun on a layer
   not re-sent (`vllm_compat.IDEMPOTENT_HOOKS`) must have the reviewed text.
4. The architecture table: `scripts/gen_arch_table.py` regenerates the table
   from the release's source, and it must equal the committed table of that
   version (`layerwise_cli/planning/architectures-release.json`), entry by
   entry: a new release fails until its table is generated and committed.
5. `layerwise[gpu]` resolves (`pip install --dry-run --ignore-installed
   --report`, for the wheel's platform and Python 3.12: layerwise's own
   dependencies plus the `gpu` extra, read from pyproject.toml), and the release
   is inside the extra's range. A release whose own pins do not resolve from
   the index is reported, and `layerwise[gpu]` resolved unpinned instead.

Prints one table row per check and exits 1 on any difference (a check that
could not run is a difference).

Usage:
    python scripts/check_vllm_release.py                    # newest release, downloaded to a temp dir
    python scripts/check_vllm_release.py --version 0.34.0 --download-dir DIR   # DIR caches the wheel
    python scripts/check_vllm_release.py --wheel PATH       # a wheel (.whl) or an unpacked source tree
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from layerwise_cli import vllm_compat  # noqa: E402 - after the checkout is on the path
from layerwise_cli.vllm_compat import CopiedRule, PrivateSymbol  # noqa: E402

# A GPU user's machine: x86-64 Linux up to glibc 2.39 (Ubuntu 24.04), Python 3.12. pip matches `--platform`
# tags exactly, so every manylinux level is listed (llguidance 1.7 ships manylinux_2_17 wheels only, vLLM _2_28).
PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)), "manylinux2014_x86_64", "linux_x86_64")
PYTHON = "3.12"


@dataclass(frozen=True)
class Row:
    check: str
    subject: str
    ok: bool
    detail: str


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
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) < Version(than)
    except InvalidVersion:
        return False


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


def check_architectures(source: Source, version: str, work: Path) -> list[Row]:
    """The planner's architecture table of VERSION against the table generated from the release's source."""
    from layerwise_cli.planning import arch_table

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
    spec = importlib.util.spec_from_file_location("gen_arch_table", ROOT / "scripts" / "gen_arch_table.py")
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


def gpu_requirements() -> tuple[list[str], list[str]]:
    """(layerwise's own dependencies, the `gpu` extra), from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return list(project["dependencies"]), list(project["optional-dependencies"]["gpu"])


def _pip_platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def check_resolution(version: str, work: Path) -> list[Row]:
    """`pip install --dry-run` of layerwise[gpu]'s requirements for a GPU machine; the release within the extra.

    When `vllm==VERSION` does not resolve with layerwise's requirements, vLLM is resolved alone: if it does not
    resolve either, the release itself cannot be installed from the index (one of its own pins is missing), which
    no change to layerwise mends; then what a user gets is checked instead: `layerwise[gpu]` without a pin must
    resolve, and the row names the vllm it picks.
    """
    from packaging.requirements import Requirement

    base, extra = gpu_requirements()
    rows = []
    vllm_pins = [Requirement(r) for r in extra if Requirement(r).name == "vllm"]
    inside = bool(vllm_pins) and all(r.specifier.contains(version, prereleases=True) for r in vllm_pins)
    rows.append(Row("gpu extra", "vllm range", inside, f"{', '.join(map(str, vllm_pins)) or 'no vllm'} "
                    f"{'includes' if inside else 'excludes'} {version}"))
    pinned = _resolve([*base, *extra, f"vllm=={version}"], work / "pinned.json")
    if pinned.installed is not None:
        rows.append(Row("gpu extra", "pip resolution", pinned.installed.get("vllm") == version, pinned.summary()))
        return rows
    alone = _resolve([f"vllm=={version}"], work / "alone.json")
    if alone.installed is not None:
        rows.append(Row("gpu extra", "pip resolution", False, f"vllm {version} resolves alone but not with "
                        f"layerwise's requirements: {pinned.error}"))
        return rows
    unpinned = _resolve([*base, *extra], work / "unpinned.json")
    if unpinned.installed is None:
        rows.append(Row("gpu extra", "pip resolution", False, f"layerwise[gpu] does not resolve: {unpinned.error}"))
        return rows
    rows.append(Row("gpu extra", "pip resolution", True, f"vllm {version} itself does not resolve from the index "
                    f"({alone.error[-160:]}); layerwise[gpu] resolves to vllm {unpinned.installed.get('vllm')}: "
                    f"{unpinned.summary()}"))
    return rows


@dataclass(frozen=True)
class Resolution:
    """One `pip install --dry-run --report`: the packages it would install (None: it failed, see `error`)."""

    installed: dict[str, str] | None
    error: str
    seconds: float

    def summary(self) -> str:
        shown = ", ".join(f"{name} {self.installed.get(name, '?')}"
                          for name in ("vllm", "torch", "transformers", "huggingface-hub"))
        return f"{len(self.installed)} packages in {self.seconds:.0f} s: {shown}"


def _resolve(requirements: list[str], report: Path) -> Resolution:
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
               str(report), *_pip_platform_args(), *requirements]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    took = time.perf_counter() - started
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if "WARNING: Location" not in line]
        return Resolution(None, f"pip exit {done.returncode}: {' '.join(' '.join(lines).split())[-400:]}", took)
    installed = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                 for item in json.loads(report.read_text())["install"]}
    return Resolution(installed, "", took)


def newest_version() -> str:
    """The newest `vllm` on the package index, as pip sees it."""
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm"], capture_output=True,
                          text=True, check=False, timeout=120)
    match = re.search(r"^vllm \(([^)]+)\)", done.stdout, re.MULTILINE)
    if not match:
        raise SystemExit(f"could not ask the index for vllm's versions: {' '.join(done.stderr.split())[-300:]}")
    return match.group(1)


def download_wheel(version: str, directory: Path) -> Path:
    """The vllm VERSION wheel for a GPU machine in DIRECTORY (downloaded only if not already there)."""
    for wheel in directory.glob(f"vllm-{version}-*.whl"):
        return wheel
    command = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--quiet", "-d",
               str(directory), *_pip_platform_args()]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    wheels = list(directory.glob(f"vllm-{version}-*.whl"))
    if done.returncode != 0 or not wheels:
        raise SystemExit(f"pip download vllm=={version} failed: {' '.join(done.stderr.split())[-400:]}")
    return wheels[0]


def installed_source() -> Source:
    """The installed vLLM's source tree (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no installed vLLM to compare the copied rules with (pip install 'layerwise[cpu]')")
    return Source(Path(next(iter(spec.submodule_search_locations))).parent)


def print_table(rows: list[Row]) -> None:
    width = max(len(r.subject) for r in rows)
    check_width = max(len(r.check) for r in rows)
    for r in rows:
        print(f"{'ok' if r.ok else 'DIFF':<4}  {r.check:<{check_width}}  {r.subject:<{width}}  {r.detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", help="the vllm release (default: the newest on the index)")
    parser.add_argument("--wheel", type=Path, help="check this wheel or unpacked source tree instead of downloading")
    parser.add_argument("--download-dir", type=Path, help="keep the wheel here (default: a temp dir, removed)")
    parser.add_argument("--installed", type=Path, help="the reference vLLM tree for the copied rules "
                        "(default: the installed vllm)")
    parser.add_argument("--skip-resolution", action="store_true", help="no pip resolution of layerwise[gpu]")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-release-") as temp:
        work = Path(temp)
        version = args.version
        if args.wheel is not None:
            path = args.wheel
            version = version or _version_of(path)
        else:
            version = version or newest_version()
            directory = args.download_dir or work
            directory.mkdir(parents=True, exist_ok=True)
            path = download_wheel(version, directory)
        downloaded = time.perf_counter()
        release = Source(path)
        installed = Source(args.installed) if args.installed else installed_source()
        print(f"vLLM {version} from {path.name} against layerwise's vllm_compat ({len(vllm_compat.PRIVATE)} symbols, "
              f"{len(vllm_compat.COPIED_RULES)} copied rules); reference: {installed.path}")
        rows = [check_symbol(release, symbol, version) for symbol in vllm_compat.PRIVATE]
        for rule in vllm_compat.COPIED_RULES:
            rows += check_rule(release, installed, rule)
        rows += check_hooks(release)
        rows += check_architectures(release, version, work)
        checked = time.perf_counter()
        if not args.skip_resolution:
            rows += check_resolution(version, work)
    print_table(rows)
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} of {len(rows)} checks ok; wheel {downloaded - started:.1f} s, source checks "
          f"{checked - downloaded:.1f} s, total {time.perf_counter() - started:.1f} s")
    return 1 if failed else 0


def _version_of(path: Path) -> str:
    match = re.match(r"vllm-([^-]+)-", path.name)
    return match.group(1) if match else "unknown"


if __name__ == "__main__":
    sys.exit(main())
