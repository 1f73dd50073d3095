"""`layerwise delta`: write a trainer's full step as a sparse delta against the step before."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from layerwise_cli.cli._options import OUTPUT_PANEL, JsonOpt
from layerwise_cli.cli._output import handle_errors, print_json, stdout
from layerwise_cli.units import human_bytes, human_seconds


@handle_errors
def delta_command(
    base: Annotated[str, typer.Argument(help="The previous step: a full checkpoint directory on this machine.",
                                        show_default=False)],
    new: Annotated[str, typer.Argument(help="The new step: a full checkpoint directory.", show_default=False)],
    out: Annotated[str, typer.Argument(help="The step directory to write (refused if it exists and is not "
                                       "empty, unless --force).", show_default=False)],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing OUT (a directory of plain files) "
                                        "once the new one is complete.", rich_help_panel=OUTPUT_PANEL)] = False,
    marker: Annotated[str, typer.Option("--marker", metavar="NAME", rich_help_panel=OUTPUT_PANEL,
                                        help="The empty completion file created last in OUT ('' for none).")]
    = "STABLE",
    whole_fraction: Annotated[float, typer.Option("--whole-fraction", min=0.0, max=1.0, metavar="F",
                                                  help="A tensor with more than this fraction of its values "
                                                  "changed is stored whole.")] = 0.5,
    as_json: JsonOpt = False,
) -> None:
    """Write NEW as the values that changed against BASE (`delta.safetensors`), with the digests that prove it.

    OUT then holds `delta.safetensors`, NEW's config and tokenizer files, and
    the marker, put in place atomically. A reload of OUT rebuilds NEW from BASE
    and the patch, into an engine that holds BASE (docs/deltas.md). When BASE
    cannot be proved (its header digests do not match its bytes), differs in
    its tensors, or the delta would not be smaller, NEW's files are copied
    instead and the summary says why.

    Example: layerwise delta run/step_119 run/step_120 run/step_120_delta

    Loading a delta, chains, what is proved: docs/commands/delta.md and docs/deltas.md.
    """
    from layerwise_cli.writer.delta_step import write_delta  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    result = write_delta(base, new, out, marker=marker or None, overwrite=force, whole_fraction=whole_fraction)
    data = to_dict(result)
    if as_json:
        print_json(data)
    else:
        render(data)


def to_dict(result) -> dict:
    """The rows the table shows, as JSON (bytes as integers, seconds as floats)."""
    delta = result.delta
    return {
        "directory": str(result.directory),
        "kind": "delta" if delta is not None else "full",
        "fallback": result.fallback,
        "files": list(result.shards),
        "tensors": result.tensors,
        "bytes": result.total_bytes,
        "base": delta.base if delta is not None else None,
        "patched_tensors": delta.patched if delta is not None else 0,
        "changed_values": delta.changed_values if delta is not None else None,
        "total_values": delta.total_values if delta is not None else None,
        "full_bytes": delta.full_bytes if delta is not None else result.total_bytes,
        "marker": str(result.marker) if result.marker is not None else None,
        "replaced": result.replaced,
        "seconds": result.seconds,
    }


def render(data: dict) -> None:
    """Print the summary on stdout."""
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("written", escape(data["directory"]) + (" (replaced)" if data["replaced"] else ""))
    if data["kind"] == "delta":
        share = data["changed_values"] / data["total_values"] if data["total_values"] else 0.0
        summary.add_row("delta", f"{human_bytes(data['bytes'])} for a {human_bytes(data['full_bytes'])} step "
                        f"({data['bytes'] / data['full_bytes']:.3f} x)")
        summary.add_row("base", escape(data["base"]))
        summary.add_row("changed", f"{data['changed_values']} of {data['total_values']} values ({share:.2%}), in "
                        f"{data['patched_tensors']} of {data['tensors']} tensors")
    else:
        summary.add_row("full step", f"{human_bytes(data['bytes'])}, {data['tensors']} tensors: no delta, because "
                        f"{escape(data['fallback'] or '')}")
    summary.add_row("time", human_seconds(data["seconds"]))
    stdout.print(summary)
