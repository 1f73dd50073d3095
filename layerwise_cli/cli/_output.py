"""Where output goes, and how errors reach the user."""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console, ConsoleDimensions
from typer._click import exceptions as click_errors
from typer.core import TyperGroup
from typer.exceptions import TyperException

from layerwise_cli.errors import LayerwiseError, UsageError, describe_exception

# Piped stdout (a file, `| less`, `| grep`) without COLUMNS: wide enough that no table drops a column or
# breaks a name; each line still ends where its content ends.
PIPED_WIDTH = 10_000


class DataConsole(Console):
    """stdout's console: a terminal's width in a terminal (or COLUMNS when set), no width limit when piped.

    Rich would otherwise use 80 columns, or the width of the terminal stderr
    is on, and cut tables to fit: columns vanish and names wrap mid-word.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Rich fixes the width from COLUMNS as it is when the console is made (this module's import);
        # `size` reads COLUMNS as it is when printing instead.
        self._width = kwargs.get("width")

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self._width is None:
            columns = self._environ.get("COLUMNS", "")
            if columns.isdigit():
                return ConsoleDimensions(int(columns), size.height)
            if not self.is_terminal:
                return ConsoleDimensions(PIPED_WIDTH, size.height)
        return size


# stdout carries data (tables, JSON); stderr carries progress, status, errors.
stdout = DataConsole(highlight=False, soft_wrap=False)
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
        except BrokenPipeError:
            raise  # `| head` left: OneLineErrors ends quietly
        except KeyboardInterrupt:
            raise typer.Exit(interrupted()) from None
        except Exception as exc:  # noqa: BLE001 - every failure gets one line
            if debug_enabled():
                traceback.print_exc()
            error = describe_exception(exc)
            report_error(error)
            raise typer.Exit(2 if isinstance(error, UsageError) else 1) from None

    return wrapper  # type: ignore[return-value]


def interrupted() -> int:
    """Ctrl-C: one line on stderr, and the shell's exit code for SIGINT."""
    sys.stderr.write("Error: interrupted\n")
    sys.stderr.flush()
    return 130


def closed_stdout() -> NoReturn:
    """The reader of stdout left (`layerwise ... | head -1`): end quietly, as Unix tools do; exit 1, no message.

    stdout is pointed at /dev/null first, so that the interpreter's last flush
    of what is still buffered does not fail (and print) once more.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(1)


def usage_error_line(error: click_errors.ClickException) -> str:
    """A Click parsing error as one `Error: <command>: <what is wrong>` line (no Rich box, no usage block)."""
    ctx = getattr(error, "ctx", None)
    where = ctx.command_path if ctx is not None else "layerwise"
    what = " ".join(error.format_message().split())
    hint = f" (see {where} --help)" if isinstance(error, click_errors.UsageError) else ""
    return f"Error: {where}: {what}{hint}"


class OneLineErrors(TyperGroup):
    """The root group: option-parser errors print one line and exit 2, Ctrl-C one line and exit 130."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as exc:
            typer.echo(exc.ctx.get_help(), err=True)  # `layerwise` alone: the help, as before
            sys.exit(exc.exit_code)
        except click_errors.ClickException as exc:
            sys.stderr.write(usage_error_line(exc) + "\n")
            sys.exit(exc.exit_code)
        except (typer.Abort, KeyboardInterrupt):
            sys.exit(interrupted())
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # `layerwise ... | head`: the reader left
                closed_stdout()
            raise
        try:
            sys.stdout.flush()  # what is still buffered: a closed pipe shows here
        except BrokenPipeError:
            closed_stdout()
        sys.exit(rv if isinstance(rv, int) else 0)
