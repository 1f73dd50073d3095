"""The project's modules stay small: none over 400 lines in the package, its scripts and its benchmarks."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400


def test_no_module_of_the_package_scripts_or_benchmarks_is_over_400_lines() -> None:
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for folder in ("layerwise_cli", "scripts", "benchmarks") for path in sorted((ROOT / folder).rglob("*.py"))}
    assert sizes, "no modules found"
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
