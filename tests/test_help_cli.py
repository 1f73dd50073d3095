"""Every command's `--help` reads at 80 columns: grouped panels, a description column of at least 30 characters,
and no help text lost to Rich markup (`[ray]`, `[plot]`)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from layerwise_cli.cli.app import app

WIDTH = 80
MIN_DESCRIPTION = 30
# A Rich markup tag, as rich.markup parses one: `[` then a letter, `#`, `/` or `@`, up to `]`.
MARKUP_TAG = re.compile(r"(?<!\\)\[[a-z#/@][^\[\]]*\]")

_COMMANDS = typer.main.get_command(app).commands


def render_help(command: str) -> str:
    """`layerwise COMMAND --help` as a terminal 80 columns wide shows it (plain text, no colour)."""
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH)},
                                terminal_width=WIDTH)
    assert result.exit_code == 0, result.output
    return result.output


def panels(text: str) -> dict[str, list[str]]:
    """Panel title -> the lines inside it (between its top and bottom border)."""
    found: dict[str, list[str]] = {}
    title = None
    for line in text.splitlines():
        top = re.match(r"^╭─ (.+?) ─", line)
        if top:
            title = top.group(1)
            found[title] = []
        elif line.startswith("╰"):
            title = None
        elif title is not None:
            found[title].append(line)
    return found


def description_width(lines: list[str], param) -> int:
    """The width of the description column on PARAM's row: from its help's first words to the panel's border.

    Raises:
        AssertionError: no line shows PARAM's name whole, followed by the start of its help.
    """
    name = next((opt for opt in param.opts if opt.startswith("--")), None) or param.name.upper()
    words = plain(param.help or "").split()[:2]
    for line in lines:
        # The names cell: `│ `, a required star, short names, then the name.
        at = re.match(rf"│ (?:\* )?(?:-\w+, )*{re.escape(name)}(?![\w-])", line)
        if at is None:
            continue
        start = line.find(" ".join(words), at.end())
        assert start >= 0, f"{name}: its help does not start on its row: {line!r}"
        return line.rindex("│") - 1 - start
    raise AssertionError(f"{name} is not shown whole in its panel:\n" + "\n".join(lines))


def plain(help_text: str) -> str:
    """What a help text is meant to show: its words, an escaped `\\[` shown as `[`."""
    return " ".join(help_text.replace("\\[", "[").split())


def shown_text(text: str) -> str:
    """The rendered help's words in one line, box drawing left out."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_options_are_grouped_in_panels_with_a_readable_description(command: str) -> None:
    text = render_help(command)
    params = [p for p in _COMMANDS[command].params if p.help and not getattr(p, "hidden", False)]
    boxes = panels(text)
    assert boxes, f"{command}: no panels:\n{text}"
    options = [p for p in params if p.param_type_name == "option" and p.name != "help"]
    if len(options) > 6:
        loose = [p.name for p in options if not getattr(p, "rich_help_panel", None)]
        assert not loose, f"{command}: {len(options)} options, and {loose} in no panel"
    for param in params:
        panel = getattr(param, "rich_help_panel", None) or ("Arguments" if param.param_type_name == "argument"
                                                            else "Options")
        assert panel in boxes, f"{command}: panel {panel!r} of {param.name} not rendered:\n{text}"
        width = description_width(boxes[panel], param)
        assert width >= MIN_DESCRIPTION, (f"{command} {param.name}: description column {width} characters wide "
                                          f"at {WIDTH} columns (want {MIN_DESCRIPTION}):\n" + "\n".join(boxes[panel]))


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_no_help_text_is_lost_to_markup(command: str) -> None:
    text = shown_text(render_help(command))
    cmd = _COMMANDS[command]
    for help_text in [cmd.help or "", *(p.help or "" for p in cmd.params)]:
        for tag in MARKUP_TAG.findall(help_text):
            assert tag in text, f"{command}: {tag!r} (in {help_text[:60]!r}...) is not shown: Rich took it as markup"


def test_the_check_catches_markup_and_narrow_columns() -> None:
    """The two checks fail on what they are meant to catch: an unescaped `[ray]`, a 17-character column."""
    assert MARKUP_TAG.findall("needs `pip install 'layerwise[ray]'`") == ["[ray]"]
    assert MARKUP_TAG.findall("pip install 'layerwise\\[plot]'") == []
    lines = ["│ --weights-path   <str>     A checkpoint   │", "│                            directory.     │"]

    class Param:
        opts = ("--weights-path",)
        name = "weights_path"
        help = "A checkpoint directory."

    assert description_width(lines, Param()) == len("A checkpoint   ") - 1


def readme_command_lines() -> list[str]:
    """Every `$ layerwise ...` line of the README's console blocks."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return [line[2:] for line in text.splitlines() if line.startswith("$ layerwise ")]


@pytest.mark.parametrize("line", readme_command_lines())
def test_every_readme_command_line_parses(line: str) -> None:
    """Each command line the README shows names a command, options it has and values they accept (parsed by the
    real app, not run: the engine runs are the engine tests')."""
    args = shlex.split(line)[1:]
    root = typer.main.get_command(app)
    with root.make_context("layerwise", list(args)) as ctx:
        command = root.get_command(ctx, args[0])
        assert command is not None, f"no command {args[0]!r}"
        command.make_context(args[0], args[1:], parent=ctx).close()


def test_the_readme_shows_every_command() -> None:
    shown = {line.split()[1] for line in readme_command_lines()} | {"demo"}  # the demo is the set-up's first line
    assert shown == set(_COMMANDS)
