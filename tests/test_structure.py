"""The project's shape: small modules and functions, one name per idea, test files named for what they drive.

Modules: none over 400 lines in the package, its scripts and its benchmarks.
Functions of the package: no body over 80 lines, counted from the first
statement after the docstring to the body's last line (a docstring or a
comment is never shortened to fit). Names: no public top-level function or
class defined in two modules of the package (vLLM's plugin entry points,
`register`, and the CLI's `render` are alike on purpose), and no two modules
outside `cli/` with one file name. Test files: docs/development.md's rule.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "layerwise_cli"
MAX_LINES = 400
MAX_BODY_LINES = 80
SHARED_NAMES = {"register", "render"}  # one per plugin entry point / per command, by design
TEST_KINDS = ("_logic", "_cli", "_engine", "_server", "_venv")
# Tests of the repository's own tools, named for the tool (docs/development.md).
TOOL_TESTS = {"test_structure.py", "test_check_imports.py", "test_vllm_release.py", "test_arch_table.py",
              "test_sweep_families.py", "test_bench_delta.py", "test_bench_quick.py", "test_device_check.py",
              "test_engine_starts.py"}


def _package_modules() -> dict[str, ast.Module]:
    return {path.relative_to(ROOT).as_posix(): ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


def _body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the body (0 for a docstring alone)."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def test_no_module_of_the_package_scripts_or_benchmarks_is_over_400_lines() -> None:
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for folder in ("layerwise_cli", "scripts", "benchmarks") for path in sorted((ROOT / folder).rglob("*.py"))}
    assert sizes, "no modules found"
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_no_function_body_of_the_package_is_over_80_lines() -> None:
    found = {}
    for name, module in _package_modules().items():
        for node in ast.walk(module):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > MAX_BODY_LINES:
                found[f"{name}:{node.lineno} {node.name}"] = _body_lines(node)
    assert found == {}


def test_the_body_count_starts_after_the_docstring() -> None:
    source = 'def f():\n    """Doc\n\n    more.\n    """\n    a = 1\n\n    return a\n\n\ndef g():\n    """Only."""\n'
    f, g = ast.parse(source).body
    assert (_body_lines(f), _body_lines(g)) == (3, 0)


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
