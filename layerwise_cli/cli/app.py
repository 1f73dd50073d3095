"""The root `layerwise` app: it only registers commands."""

from __future__ import annotations

import typer

from .inspect_order import inspect_order_command

app = typer.Typer(
    name="layerwise",
    help="Push new weights into running vLLM engines in layer order, and show what it cost.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def root() -> None:
    """Push new weights into running vLLM engines in layer order, and show what it cost.

    Errors print one line, `Error: <file or server>: <what is wrong>`, and exit 1
    (2 for usage errors); set LAYERWISE_DEBUG=1 to see the traceback.
    """


app.command("inspect-order")(inspect_order_command)


def main() -> None:
    """Console-script entry point."""
    app()
