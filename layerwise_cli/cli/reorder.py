"""`layerwise reorder`: rewrite a checkpoint so that every loader reads it in layer order."""

from __future__ import annotations

from typing import Annotated, Self

import typer
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from layerwise_cli.cli._options import (
    OUTPUT_PANEL,
    PROOF_PANEL,
    AllowNonfiniteOpt,
    JsonOpt,
    MappingOpt,
    RevisionOpt,
    SourceArg,
)
from layerwise_cli.cli._output import handle_errors, print_json, report_error, stderr, stdout
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.units import human_bytes, human_seconds, parse_size


@handle_errors
def reorder_command(
    source: SourceArg,
    destination: Annotated[
        str, typer.Argument(help="The directory to write (refused if it exists, unless --force).", show_default=False)
    ],
    revision: RevisionOpt = None,
    mapping: MappingOpt = "auto",
    max_shard_size: Annotated[
        str,
        typer.Option("--max-shard-size", metavar="SIZE", rich_help_panel=OUTPUT_PANEL,
                     help="Most tensor bytes per shard (e.g. 5GB, 512MiB); a parent layer spans two shards only "
                     "when it alone is larger."),
    ] = "5GB",
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing destination once the new one is complete.",
                           rich_help_panel=OUTPUT_PANEL)
    ] = False,
    digests: Annotated[
        bool,
        typer.Option("--digests/--no-digests", rich_help_panel=OUTPUT_PANEL,
                     help="Write each tensor's xxh3-128 digest in its shard's header, so that a reload skips "
                     "unchanged layers from the headers alone."),
    ] = True,
    verify: Annotated[
        bool,
        typer.Option("--verify", rich_help_panel=PROOF_PANEL,
                     help="Re-read every tensor written and compare its digest with the source's, and check for "
                     "NaN/Inf, before putting it in place; exit 1 on any difference."),
    ] = False,
    allow_nonfinite: AllowNonfiniteOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Rewrite a checkpoint so that vLLM's own loader reads complete parent layers one after another.

    Shard contents are chosen so that, read the way vLLM reads them (shards in
    natural order, tensors sorted by name inside each), no parent layer waits
    on another: the file-order peak buffer becomes the largest layer. Tensor
    bytes are copied raw in small chunks; everything is written beside
    DESTINATION and renamed into place only when complete.

    Example: layerwise reorder ./trainer-export ./reordered --max-shard-size 2GB --verify

    Every option: docs/commands/reorder.md.
    """
    try:
        limit = parse_size(max_shard_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-shard-size") from None
    if limit <= 0:
        raise typer.BadParameter("must be more than 0 bytes", param_hint="--max-shard-size")
    if allow_nonfinite and not verify:
        raise typer.BadParameter("only applies with --verify (which checks every tensor for NaN/Inf)",
                                 param_hint="--allow-nonfinite")
    from layerwise_cli.reorder.rewrite import reorder  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs
    from layerwise_cli.reorder.signals import ReorderInterrupted  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    try:
        if as_json:
            _quiet_hub_progress()
            result = reorder(source, destination, max_shard_size=limit, force=force, verify=verify,
                             revision=revision, mapping=mapping, allow_nonfinite=allow_nonfinite, digests=digests)
        else:
            with _Progress() as bar:
                result = reorder(source, destination, max_shard_size=limit, force=force, verify=verify,
                                 revision=revision, mapping=mapping, progress=bar.update,
                                 allow_nonfinite=allow_nonfinite, digests=digests)
    except ReorderInterrupted as stop:
        state = ("the new checkpoint was already in place" if stop.committed
                 else "nothing was written there and temporary files were removed")
        report_error(LayerwiseError(f"interrupted by {stop}; {state}", where=destination))
        raise typer.Exit(128 + stop.signum) from None
    data = result.to_dict()
    if as_json:
        print_json(data)
    else:
        render(data)


def _quiet_hub_progress() -> None:
    # --json turns progress off, the Hub's download bars included.
    from huggingface_hub.utils import disable_progress_bars  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    disable_progress_bars()


class _Progress:
    """Bytes written and shards done, on stderr."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TextColumn("{task.fields[shards]}"), TimeRemainingColumn(),
            console=stderr, transient=False,
        )
        self.tasks: dict[str, int] = {}
        self.started = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not stderr.is_terminal:
            # A file or pipe gets the final state once, on success; on failure the error is the only line.
            if exc_type is None and self.tasks:
                stderr.print(self.progress.get_renderable())
            return
        if not self.started:
            return
        if exc_type is not None:
            # On failure the bar goes away, so that the error is the one line left.
            self.progress.live.transient = True
        self.progress.__exit__(exc_type, exc, tb)

    def update(self, event) -> None:
        if not self.started and stderr.is_terminal:
            # Started with the first bytes: a refusal before any (the usual error) leaves no bar behind.
            self.progress.__enter__()
            self.started = True
        label = {"fetch": "write", "write": "write", "verify": "verify"}[event.phase]
        if label not in self.tasks:
            title = "writing" if label == "write" else "verifying"
            self.tasks[label] = self.progress.add_task(title, total=event.bytes_total, shards="")
        description = f"fetching {escape(event.file)}" if event.phase == "fetch" else (
            "writing" if label == "write" else "verifying")
        self.progress.update(
            self.tasks[label], completed=event.bytes_done, description=description,
            shards=f"{event.shards_done}/{event.shards_total} shards",
        )


def _size_label(n: int) -> str:
    # Shard limits are usually given in decimal units (the Hub's 5GB): say them back that way.
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return human_bytes(n)


def render(data: dict) -> None:
    """Print the closing summary and the shard table on stdout."""
    before, after = data["before"], data["after"]
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("source", escape(data["source"]) + (f" @ {escape(data['revision'])}" if data["revision"] else "")
                    + f" ({before['shards']} shard(s))")
    summary.add_row("destination", escape(data["destination"]) + f" ({after['shards']} shard(s), at most "
                    f"{_size_label(data['max_shard_size'])} each{', replaced' if data['replaced'] else ''})")
    summary.add_row("checkpoint", f"{data['tensors']} tensors, {human_bytes(data['total_bytes'])}")
    summary.add_row("largest layer", human_bytes(data["largest_layer_bytes"]))
    for label, side in (("file order before", before), ("file order after", after)):
        summary.add_row(label, f"peak {human_bytes(side['file_order_peak_buffer_bytes'])} = "
                        f"{side['peak_over_largest_layer']:.2f} x largest layer, "
                        f"{side['open_layers_at_peak']} layer(s) open at {escape(side['peak_tensor'])}")
    summary.add_row("written", f"{human_bytes(data['bytes_written'])} in {after['shards']} shard(s) and the index; "
                    f"{len(data['files_copied'])} other file(s) copied")
    if data["files_skipped"]:
        summary.add_row("not copied", escape(", ".join(data["files_skipped"])) + " (other weight files, or as noted)")
    if data["metadata_conflicts"]:
        summary.add_row("metadata", "source shards disagree on " + escape(", ".join(data["metadata_conflicts"]))
                        + "; kept the first shard's value")
    checked = (f"; the source's header digests matched its bytes ({data['source_digests_checked']} tensors)"
               if data["source_digests_checked"] else "")
    summary.add_row("digests", ("layerwise.digests (xxh3-128) in every shard header" if data["digests"]
                                else "none written (--no-digests)") + checked)
    nonfinite = data["nonfinite"]
    summary.add_row("verify", ("every tensor's digest matches the source; "
                               + (f"{len(nonfinite)} tensor(s) hold NaN/Inf (allowed), first: "
                                  f"{escape(nonfinite[0]['name'])}" if nonfinite else "no NaN/Inf"))
                    if data["verified"]
                    else "headers and tensor set checked (--verify also compares every tensor's bytes and "
                    "checks for NaN/Inf)")
    summary.add_row("time", human_seconds(data["seconds"]))
    stdout.print(summary)
    table = Table(title="Shards, in the order vLLM reads them", title_justify="left")
    table.add_column("shard")
    table.add_column("tensors", justify="right")
    table.add_column("parent layers", justify="right")
    table.add_column("bytes", justify="right")
    for row in data["shards"]:
        table.add_row(escape(row["name"]), str(row["tensors"]), str(row["parent_layers"]), human_bytes(row["bytes"]))
    stdout.print(table)
