"""The project's shape: small modules and functions, one name per idea, test files named for what they drive.

Modules: none over 400 lines in the package, its scripts and its benchmarks, unless read again and listed with
why it stays whole (the count prompts a review; nothing is split only to meet it).
Functions of the package: none over 80 lines besides its docstring, counted
from the `def` line (the signature included: a command's options are
declared once, as `Annotated` aliases) to the last line, less the docstring's
lines (a docstring is never shortened to fit; a comment counts). Names: no public top-level function or
class defined in two modules of the package (vLLM's plugin entry points,
`register`, and the CLI's `render` are alike on purpose), and no two modules
outside `cli/` with one file name. Test files: docs/development.md's rule. The map in
docs/development.md: every module, and every name it says a module holds, exists.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "layerwise_cli"
MAX_LINES = 400
MAX_FUNCTION_LINES = 80  # besides its docstring
SHARED_NAMES = {"register", "render"}  # one per plugin entry point / per command, by design
TEST_KINDS = ("_logic", "_cli", "_engine", "_server", "_venv")
# Tests of the repository's own tools, named for the tool (docs/development.md).
TOOL_TESTS = {"test_structure.py", "test_check_imports.py", "test_vllm_release.py", "test_arch_table.py",
              "test_sweep_families.py", "test_bench_delta.py", "test_bench_quick.py", "test_device_check.py",
              "test_engine_starts.py"}


def _package_modules() -> dict[str, ast.Module]:
    return {path.relative_to(ROOT).as_posix(): ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


def _lines_besides_docstring(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the `def` line (decorators aside) to the function's last, less its docstring's lines."""
    lines = function.end_lineno - function.lineno + 1
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


# Modules over MAX_LINES that were read again and stay whole: the count prompts a review, never a split by lines.
REVIEWED_LONG_MODULES = {
    "layerwise_cli/vllm_compat.py": "the one door to vLLM's private API (scripts/check_imports.py): an accessor "
                                    "per private name, each a few lines; a second module would be a second door",
    "layerwise_cli/vllm_symbols.py": "declarations as data, one per private vLLM name layerwise relies on, read "
                                     "by scripts/check_vllm_release.py; nothing in it runs",
}


def test_no_module_of_the_package_scripts_or_benchmarks_is_over_400_lines_unless_reviewed() -> None:
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for folder in ("layerwise_cli", "scripts", "benchmarks") for path in sorted((ROOT / folder).rglob("*.py"))}
    assert sizes, "no modules found"
    assert {name: n for name, n in sizes.items() if n > MAX_LINES and name not in REVIEWED_LONG_MODULES} == {}
    # A reviewed module back under the count leaves the list (it would hide the next review).
    assert {name for name in REVIEWED_LONG_MODULES if sizes.get(name, 0) <= MAX_LINES} == set()


def test_no_function_of_the_package_is_over_80_lines_besides_its_docstring() -> None:
    found = {}
    for name, module in _package_modules().items():
        for node in ast.walk(module):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and _lines_besides_docstring(node) > MAX_FUNCTION_LINES:
                found[f"{name}:{node.lineno} {node.name}"] = _lines_besides_docstring(node)
    assert found == {}


def test_the_count_takes_the_signature_and_leaves_out_the_docstring() -> None:
    source = ('@decorated\ndef f(\n    a: int,\n) -> int:\n    """Doc\n\n    more.\n    """\n    # why\n    b = a\n\n'
              '    return b\n\n\ndef g():\n    """Only."""\n\n\ndef h(a):\n    return a\n')
    f, g, h = ast.parse(source).body
    assert (_lines_besides_docstring(f), _lines_besides_docstring(g), _lines_besides_docstring(h)) == (7, 1, 2)


def test_no_public_function_or_class_is_defined_in_two_modules() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for name, module in _package_modules().items():
        for node in module.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and not node.name.startswith("_") and node.name not in SHARED_NAMES:
                where[node.name].append(name)
    assert {name: modules for name, modules in where.items() if len(modules) > 1} == {}


def test_every_test_file_is_named_for_what_it_drives() -> None:
    files = sorted(path.name for path in (ROOT / "tests").glob("test_*.py"))
    assert files, "no test files found"
    assert [name for name in files if not name.removesuffix(".py").endswith(TEST_KINDS) and name not in TOOL_TESTS] \
        == []
    assert sorted(TOOL_TESTS - set(files)) == []  # a tool test renamed or gone: the list follows


# docs/development.md names modules and what is in them; each name must exist (the map made true, kept true).
DEVELOPMENT = ROOT / "docs" / "development.md"
# Backticked spans the map may hold that are no module of ours: other projects' names, and file names.
FOREIGN_ROOTS = {"vllm", "torch", "huggingface_hub", "safetensors", "typer", "rich", "numpy", "obstore", "os"}
FILE_SUFFIXES = {"md", "py", "json", "toml", "yml", "yaml", "safetensors", "txt", "sh", "png", "lock"}
_DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`")
# A module path of the package followed by the names it defines: "`worker/reload/handover.py` `hand_over`, `weights`".
_PATH_AND_NAMES = re.compile(r"`((?:\w+/)*\w+\.py)`((?: `[A-Za-z_]\w*`,?)+)")


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for the package and the tests' support modules."""
    files = {}
    for folder in (PACKAGE, ROOT / "tests" / "support"):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _names_of(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.ImportFrom):
        return [a.asname or a.name for a in node.names]
    return []


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _defines(path: Path, names: list[str]) -> bool:
    """Whether the module at PATH defines NAMES[0] at its top level, and NAMES[1:] inside it (a class, with the
    classes of the same module it derives from); the package's own names include its lazy table."""
    module = _parsed(path).body
    top = {name: node for node in module for name in _names_of(node)}
    if path == PACKAGE / "__init__.py" and len(names) == 1:
        return names[0] in top or names[0] in importlib.import_module("layerwise_cli").__all__
    found = top.get(names[0])
    for name in names[1:]:
        if not isinstance(found, ast.ClassDef):
            return False
        classes, found = [found], None
        while classes and found is None:
            cls = classes.pop()
            found = next((node for node in cls.body if name in _names_of(node)), None)
            classes += [top[base.id] for base in cls.bases
                        if isinstance(base, ast.Name) and isinstance(top.get(base.id), ast.ClassDef)]
    return found is not None


def _exists(dotted: str, modules: dict[str, Path], defined_in: dict[str, list[str]]) -> bool:
    parts = dotted.split(".")
    # A module named by its last components (`reload_plan.plan_reload`, `hub.pin.pin_commit`), longest first.
    for size in range(len(parts), 0, -1):
        head, rest = parts[:size], parts[size:]
        for module, path in modules.items():
            if module.split(".")[-size:] == head and (not rest or _defines(path, rest)):
                return True
    # A class or function of the package (`ReloadOptions.from_json`).
    return any(_defines(modules[module], parts) for module in defined_in.get(parts[0], []))


def _top_level_names(modules: dict[str, Path]) -> dict[str, list[str]]:
    found = defaultdict(list)
    for module, path in modules.items():
        for node in _parsed(path).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                found[node.name].append(module)
    return found


def test_every_module_and_name_the_development_page_shows_exists() -> None:
    text = DEVELOPMENT.read_text(encoding="utf-8")
    modules = _module_files()
    defined_in = _top_level_names(modules)
    dotted = {span for span in _DOTTED.findall(text)
              if span.split(".")[0] not in FOREIGN_ROOTS and span.split(".")[-1] not in FILE_SUFFIXES}
    assert len(dotted) > 10, "the page's names were not found"
    assert sorted(span for span in dotted if not _exists(span, modules, defined_in)) == []
    paths = {m.group(1) for m in re.finditer(r"`((?:\w+/)+(?:\w+\.py)?)`", text)}
    # A build output the page names (`site/`, made by mkdocs) exists only once built: git ignores it.
    built = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines() if line.strip().endswith("/")}
    assert sorted(p for p in paths - built if not any((base / p).exists() for base in (PACKAGE, ROOT))) == []
    pairs = [(path, name) for path, names in _PATH_AND_NAMES.findall(text) for name in re.findall(r"`(\w+)`", names)]
    assert len(pairs) > 30, "the map's modules and names were not found"
    missing = [f"{path} {name}" for path, name in pairs
               if not any(_defines(base / path, [name]) for base in (PACKAGE, ROOT) if (base / path).is_file())]
    assert missing == []


def test_the_development_page_check_finds_a_name_that_is_gone() -> None:
    modules = _module_files()
    defined_in = _top_level_names(modules)
    assert _exists("reload_plan.plan_reload", modules, defined_in)
    assert _exists("hub.pin.pin_commit", modules, defined_in)
    assert _exists("ReloadOptions.from_json", modules, defined_in)
    assert _exists("layerwise_cli.EXTENSION_CLS", modules, defined_in)
    assert not _exists("completion.unloaded_layer_watch", modules, defined_in)
    assert not _exists("reload_plan.no_such_function", modules, defined_in)
    assert not _exists("ReloadOptions.no_such_field", modules, defined_in)
