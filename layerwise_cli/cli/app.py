"""The root `layerwise` app: it only registers commands."""

from __future__ import annotations

import os
import sys
from typing import Annotated

from layerwise_cli.cli._output import interrupted

try:
    import typer

    from layerwise_cli.cli import _help
    from layerwise_cli.cli._output import OneLineErrors
    from layerwise_cli.cli.delta import delta_command
    from layerwise_cli.cli.demo import demo_command
    from layerwise_cli.cli.inspect_order import inspect_order_command
    from layerwise_cli.cli.reload import reload_command
    from layerwise_cli.cli.reorder import reorder_command
    from layerwise_cli.cli.serve import serve_command
    from layerwise_cli.cli.version import print_version
    from layerwise_cli.cli.watch import watch_command
    from layerwise_cli.vllm_logs import quiet_early_loggers
except KeyboardInterrupt:  # Ctrl-C while the CLI starts: one line, no traceback
    sys.stderr.write("Error: interrupted\n")
    raise SystemExit(130) from None

_help.use_two_column_panels()
# An engine process spawned from the `layerwise` script imports this module first: a quiet demo stays quiet there.
quiet_early_loggers()

app = typer.Typer(
    name="layerwise",
    cls=OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=print_version, is_eager=True,
                                          help="Print the versions of layerwise, vLLM and torch, and exit.")] = False,
) -> None:
    """Push new weights into running vLLM engines in layer order, and show what it cost.

    Errors print one line, `Error: <file or server>: <what is wrong>`, and exit 1
    (2 for usage errors); set LAYERWISE_DEBUG=1 to see the traceback.
    """


app.command("inspect-order")(inspect_order_command)
app.command("reload")(reload_command)
app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve_command)
app.command("reorder")(reorder_command)
app.command("demo")(demo_command)
app.command("watch")(watch_command)
app.command("delta")(delta_command)


def main() -> None:
    """Console-script entry point."""
    # stdout carries our data; vLLM logs to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(interrupted())
