"""Where output goes, and how errors reach the user."""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from typer.exceptions import TyperException
from rich.console import Console

from ..errors import LayerwiseError, UsageError, describe_exception

# stdout carries data (tables, JSON); stderr carries progress, status, errors.
stdout = Console(highlight=False, soft_wrap=False)
stderr = Console(stderr=True, highlight=False)

F = TypeVar("F", bound=Callable[..., Any])


def debug_enabled() -> bool:
    return os.environ.get("LAYERWISE_DEBUG", "") not in {"", "0"}


def print_json(data: object) -> None:
    """Print JSON on stdout, plain (no Rich markup or colour)."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    sys.stdout.flush()


def report_error(error: LayerwiseError) -> None:
    """Print the one-line `Error: ...` on stderr."""
    message = " ".join(str(error).split())
    # One line only: scripts grep it; LAYERWISE_DEBUG=1 adds the traceback.
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()


def handle_errors(func: F) -> F:
    """Turn handled errors into `Error: ...` and exit 1 (2 for usage errors)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort, TyperException, SystemExit):
            raise  # usage errors keep Click's exit code 2
        except KeyboardInterrupt:
            sys.stderr.write("Error: interrupted\n")
            raise typer.Exit(130) from None
        except Exception as exc:  # noqa: BLE001 - every failure gets one line
            if debug_enabled():
                traceback.print_exc()
            error = describe_exception(exc)
            report_error(error)
            raise typer.Exit(2 if isinstance(error, UsageError) else 1) from None

    return wrapper  # type: ignore[return-value]
