"""`--help` that reads at 80 columns: each panel of options in two columns, the names and what they do.

Typer lays an options panel out in six columns (long names, short names,
negative names, their short forms, the type, the help); at 80 columns a
command with `--enforce-eager/--no-enforce-eager` beside
`--distributed-executor-backend` leaves its help 15 characters, a sentence
on ten lines. Here the names, the value they take and its range share one
column (at most 32 characters; longer lines wrap), and the help takes
the rest. Panels (`rich_help_panel`), the usage, the command's text and the
defaults stay Typer's own: only the panel's table is drawn here, by replacing
Typer's `_print_options_panel` (`use_two_column_panels`, called once by the root app;
tests/test_help_cli.py renders every command at 80 columns and fails when
the replacement stops applying).
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer import rich_utils

# The names column is as wide as its longest line, up to this many characters (the longest option name,
# `--distributed-executor-backend`, is 30); the help takes the rest, 44 characters at 80 columns.
_NAMES_MAX = 32


def option_names(param, ctx) -> Text:
    """PARAM's names as the names column shows them: `-tp, --tensor-parallel-size N [x>=1]`, `--atomic /
    --no-atomic`, `* BASE` (required); a flag shows no type."""
    text = Text(overflow="fold")
    if param.required:
        text.append(f"{rich_utils.REQUIRED_SHORT_STRING} ", style=rich_utils.STYLE_REQUIRED_SHORT)
    if param.param_type_name == "argument":  # Typer vendors Click: its classes are not click's
        text.append(param.name.upper(), style=rich_utils.STYLE_OPTION)
        return text
    names = sorted(param.opts, key=lambda opt: opt.startswith("--"))
    text.append(", ".join(names), style=rich_utils.STYLE_OPTION)
    if param.secondary_opts:
        text.append(" / ")
        text.append(", ".join(param.secondary_opts), style=rich_utils.STYLE_NEGATIVE_OPTION)
    if not getattr(param, "is_flag", False):
        kind = _value_name(param, ctx)
        if kind:
            text.append(f" {kind}", style=rich_utils.STYLE_TYPES)
    number_range = getattr(param, "_get_number_range_help_str", lambda: None)()
    if number_range:
        text.append(rich_utils.RANGE_STRING.format(number_range), style=rich_utils.STYLE_TYPES_SEPARATOR)
    return text


def _value_name(param, ctx) -> str:
    """The value PARAM takes, as Typer names it (its metavar, else `<int>`, `<layer|file>`, ...)."""
    shown = getattr(param, "display_type_rich", None)  # Typer 0.2x; before, Click's own metavar
    if shown is not None:
        return shown(ctx=ctx) or ""
    try:
        return param.make_metavar(ctx)
    except TypeError:  # Click before 8.2 takes no context
        return param.make_metavar()


def print_options_panel(*, name: str, params: list, ctx, markup_mode, console: Console) -> None:
    """Draw one panel of options or arguments: the names column, then each one's help, default and variable."""
    if not params:
        return
    names = [option_names(param, ctx) for param in params]
    widest = max(max(len(line) for line in text.plain.split("\n")) for text in names)
    table = Table(show_header=False, box=None, expand=True, pad_edge=False, padding=(0, 1))
    table.add_column(width=min(widest, _NAMES_MAX), overflow="fold")
    table.add_column(ratio=1)
    for param, text in zip(params, names, strict=True):
        table.add_row(text, rich_utils._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode))
    console.print(Panel(table, border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER, title=name,
                        title_align=rich_utils.ALIGN_OPTIONS_PANEL, box=box.ROUNDED))


def use_two_column_panels() -> None:
    """Draw every command's option panels with `print_options_panel` (idempotent)."""
    rich_utils._print_options_panel = print_options_panel
