"""`layerwise inspect-order`: what a checkpoint's tensor order will buffer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from layerwise_cli.cli._options import (
    OUTPUT_PANEL,
    PROOF_PANEL,
    JsonOpt,
    MappingOpt,
    RevisionOpt,
    SourceArg,
    TensorParallelOpt,
)
from layerwise_cli.cli._output import handle_errors, print_json, stderr, stdout
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.units import human_bytes, human_seconds, parse_size


@handle_errors
def inspect_order_command(
    source: SourceArg,
    revision: RevisionOpt = None,
    mapping: MappingOpt = "auto",
    tensor_parallel_size: TensorParallelOpt = 1,
    max_buffer: Annotated[
        str | None,
        typer.Option("--max-buffer", metavar="SIZE", rich_help_panel=PROOF_PANEL,
                     help="Exit 1 when the file-order peak exceeds SIZE (e.g. 512MiB, 2GB)."),
    ] = None,
    scan: Annotated[bool, typer.Option("--scan", rich_help_panel=PROOF_PANEL,
                                       help="Also read every tensor: exit 1 on NaN or Inf, or bytes that differ "
                                       "from their header digest (reads the whole checkpoint).")] = False,
    top: Annotated[int, typer.Option("--top", help="Show the N worst layers (0: all).", min=0, metavar="N",
                                     rich_help_panel=OUTPUT_PANEL)] = 20,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE.png", dir_okay=False, rich_help_panel=OUTPUT_PANEL,
        help="Also draw the buffered bytes over the stream, file order against layer order, into FILE (.png, "
             ".svg or .pdf; needs `pip install 'layerwise\\[plot]'`).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show which engine layer each tensor feeds and what vLLM's read order buffers.

    Reads headers only (HTTP range requests for Hub repos), never tensor data,
    unless --scan asks for a data scan. Per-layer digests are shown when the
    shard headers carry them (`layerwise.digests`, written by save_checkpoint). Layers vLLM holds until the end of a
    reload (a padded vocabulary) are named with the reason;
    --tensor-parallel-size changes which ranks hold them.

    Example: layerwise inspect-order ./checkpoint --top 10 --max-buffer 2GiB

    Example: layerwise inspect-order ./checkpoint --scan

    Example: layerwise inspect-order ./checkpoint --plot order.png

    A sparse delta (`layerwise delta`, docs/deltas.md) is described as the step
    it rebuilds (its base's layout), followed by its base, the changed fraction
    per layer and what a reload into an engine holding the base reads; --scan
    then checks the delta's positions and new values.

    Example: layerwise inspect-order run/step_120_delta

    Every kind of source: docs/sources.md; every option: docs/commands/inspect-order.md.
    """
    limit = _parse_limit(max_buffer)
    from layerwise_cli.planning.inspect import inspect_order  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    report = inspect_order(source, revision, mapping, tensor_parallel_size)
    data = report.to_dict(top=top)
    scanned = _scan_data(report, quiet=as_json) if scan else None
    if scanned is not None:
        data["scan"] = scanned.to_dict()
    if as_json:
        print_json(data)
    else:
        render(data, top)
        if data["delta"] is not None:
            render_delta(data["delta"], top)
        if scanned is not None:
            render_scan(scanned)
    if plot is not None:
        from layerwise_cli.planning.chart import write_order_chart  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

        stderr.print(f"chart             {escape(str(write_order_chart(report, plot)))}", soft_wrap=True)
    _refuse_findings(report, scanned, limit, source)


def _parse_limit(max_buffer: str | None) -> int | None:
    """--max-buffer in bytes (None: not given); a size that does not parse is a usage error."""
    if max_buffer is None:
        return None
    try:
        return parse_size(max_buffer)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-buffer") from None


def _scan_data(report, *, quiet: bool):
    """--scan: read the checkpoint's tensor data; the scan's findings, or None for a delta.

    A delta's own bytes are checked in place, and a failure raised at once;
    a full checkpoint's findings are returned for the report and
    `_refuse_findings`.
    """
    delta = report.plan.checkpoint.delta
    if delta is not None:
        # A delta's own bytes: every position and every new value, as a reload's pre-flight reads them, and every
        # v2 chunk decoded.
        delta.validate()
        delta.decode_chunks()
        delta.refuse_nonfinite()
        return None
    return _scan(report.plan.checkpoint, quiet=quiet)


def _refuse_findings(report, scanned, limit: int | None, source: str) -> None:
    """Exit 1, once the report is shown, on what the scan found or a file-order peak over --max-buffer.

    Raises:
        LayerwiseError: the first tensor whose bytes differ from their header
            digest, else the first holding NaN or Inf (with how many more),
            else the peak over LIMIT.
    """
    if scanned is not None and scanned.digest_mismatches:
        first = scanned.digest_mismatches[0]
        more = (f" ({len(scanned.digest_mismatches)} tensors differ from their header digests)"
                if len(scanned.digest_mismatches) > 1 else "")
        raise LayerwiseError(f"{first.describe()}{more}", where=_shard_where(report.plan.checkpoint, first.shard))
    if scanned is not None and scanned.nonfinite:
        first = scanned.nonfinite[0]
        more = f" ({len(scanned.nonfinite)} tensors hold NaN or Inf)" if len(scanned.nonfinite) > 1 else ""
        raise LayerwiseError(f"{first.describe()}{more}", where=_shard_where(report.plan.checkpoint, first.shard))
    peak = report.file_order_buffering.peak_buffer_bytes
    if limit is not None and peak > limit:
        raise LayerwiseError(
            f"file-order peak buffer {human_bytes(peak)} ({peak} bytes) exceeds --max-buffer "
            f"{human_bytes(limit)}; run `layerwise reorder` on it",
            where=source,
        )

def render(data: dict, top: int) -> None:
    """Print the summary and the per-layer table on stdout, from the JSON data alone (`OrderReport.to_dict`)."""
    largest = data["largest_layer_bytes"]
    fo, lo = data["file_order"], data["layer_order"]
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    commit = data.get("commit")
    summary.add_row("source", escape(data["source"]) + (f" @ {escape(data['revision'])}" if data["revision"] else "")
                    + (f" (commit {commit})" if commit else ""))
    summary.add_row("mapping", escape(data["mapping"]["description"]))
    if data["mapping"].get("guess"):
        summary.add_row("guess", escape(data["mapping"]["guess"]["text"]))
    summary.add_row("checkpoint", f"{data['shards']} shard(s), {data['tensors']} tensors, "
                    f"{human_bytes(data['total_bytes'])}, {data['parent_layers']} parent layers")
    summary.add_row("largest layer", human_bytes(largest))
    if data["held_to_end"]:
        reasons = list(dict.fromkeys(row["reason"] for row in data["held_to_end"]))
        summary.add_row("held to end", f"{', '.join(escape(row['name']) for row in data['held_to_end'])}: "
                        f"{human_bytes(data['held_to_end_bytes'])} buffered until the reload ends "
                        f"({escape('; '.join(reasons))})")
    for label, sim in (("file order peak", fo), ("layer order peak", lo)):
        rank = f" on rank {sim['rank']}" if sim["rank"] is not None else ""
        summary.add_row(
            label,
            f"{human_bytes(sim['peak_buffer_bytes'])} = {sim['peak_over_largest_layer']:.2f} x largest layer, "
            f"{sim['open_layers_at_peak']} layer(s) open at {escape(sim['peak_tensor'])}{rank}",
        )
    if lo["above_largest_layer_because"]:
        # The JSON carries the whole sentence; here the held layers are named one row up.
        why = ("the layers held to the end, together" if data["held_to_end"]
               else escape(lo["above_largest_layer_because"]))
        summary.add_row("", f"layer order is above the largest layer: {why}")
    digests = data["header_digests"]
    if digests["shards_with_digests"]:
        summary.add_row("digests", f"{escape(digests['key'])} ({escape(digests['format'])}) in "
                        f"{digests['shards_with_digests']} of {data['shards']} shard(s), "
                        f"{len(digests['tensors'])} tensors; per-layer digest in the table")
    if data["skipped_tensors"]:
        rows = data["skipped_as_vllm_does"]
        reasons = list(dict.fromkeys(row["reason"] for row in rows))
        summary.add_row("skipped", f"{len(rows)} tensor(s), {human_bytes(sum(row['bytes'] for row in rows))}, "
                        f"skipped as vLLM does (not read, not buffered): {escape('; '.join(reasons))}")
    summary.add_row("read", f"{data['header_bytes_read']} header bytes of "
                    f"{data['total_bytes'] + data['header_bytes_read']}")
    stdout.print(summary)
    table = Table(title=f"Parent layers, worst first{f' (top {top})' if top else ''}", title_justify="left")
    table.add_column("layer", overflow="fold")  # wrap, never cut, a module name
    table.add_column("tensors", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("shards", justify="right")
    table.add_column("held in file order", justify="right")
    held = any(row["held_to_end"] for row in data["layers"])
    if held:
        table.add_column("held to the end", overflow="fold")
    with_digests = any(row["digest"] for row in data["layers"])
    if with_digests:
        table.add_column("digest")  # the first 12 of 32 hex digits; --json has them whole
    for row in data["layers"]:
        cells = [escape(row["name"]), str(row["tensors"]), human_bytes(row["bytes"]),
                 str(len(row["shards"])), human_bytes(row["file_order_held_bytes"])]
        if held:
            cells.append(escape(row["held_to_end"] or ""))
        if with_digests:
            cells.append(row["digest"][:12] if row["digest"] else "-")
        table.add_row(*cells)
    stdout.print(table)
    if fo["peak_buffer_bytes"] > lo["peak_buffer_bytes"]:
        stderr.print(f"[yellow]File order buffers {fo['peak_over_largest_layer']:.2f}x the largest layer; "
                     "`layerwise reload` streams in layer order, `layerwise reorder` rewrites the file.[/]")



def render_delta(delta: dict, top: int) -> None:
    """Print what a delta changes and what a reload of it reads, from the JSON data alone (`DeltaView.to_dict`)."""
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("delta", f"{escape(delta['file'])}: {human_bytes(delta['file_bytes'])} for a "
                    f"{human_bytes(delta['full_bytes'])} step ({delta['file_bytes'] / delta['full_bytes']:.3f} x)")
    summary.add_row("base", escape(delta["base"]))
    summary.add_row("changed", f"{delta['changed_values']} of {delta['values']} values "
                    f"({delta['changed_fraction']:.2%}), in {delta['changed_layers']} of {len(delta['layers'])} "
                    "parent layers")
    summary.add_row("a reload reads", f"{human_bytes(delta['reload_reads'])}: the delta, and the base's bytes of "
                    "the layers it changes (the others are skipped)")
    stdout.print(summary)
    rows = sorted(delta["layers"], key=lambda row: (-row["changed_fraction"], row["name"]))
    if top:
        rows = rows[:top]
    table = Table(title=f"Changed values per parent layer, most first{f' (top {top})' if top else ''}",
                  title_justify="left")
    table.add_column("layer", overflow="fold")
    table.add_column("changed", justify="right")
    table.add_column("tensors patched", justify="right")
    table.add_column("delta bytes", justify="right")
    table.add_column("layer bytes", justify="right")
    for row in rows:
        table.add_row(escape(row["name"]), f"{row['changed_fraction']:.2%}", str(row["patched_tensors"]),
                      human_bytes(row["delta_bytes"]), human_bytes(row["bytes"]))
    stdout.print(table)

def _scan(checkpoint, quiet: bool):
    """Read every tensor and count NaN/Inf, with a progress bar on stderr unless quiet."""
    from layerwise_cli.checkpoint.format.finite import scan_checkpoint  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    if quiet:
        return scan_checkpoint(checkpoint)
    with Progress(TextColumn("scanning"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                  console=stderr, transient=True) as bar:
        task = bar.add_task("scan", total=checkpoint.total_bytes)
        return scan_checkpoint(checkpoint, progress=lambda done, total: bar.update(task, completed=done))


def _shard_where(checkpoint, shard: str) -> str:
    if checkpoint.local_dir is not None:
        return str(checkpoint.shard_path(shard))
    return f"{checkpoint.source}/{shard}"


def render_scan(scanned) -> None:
    """One line for the data scan, then one per tensor holding NaN or Inf."""
    state = (f"{len(scanned.nonfinite)} tensor(s) hold NaN or Inf" if scanned.nonfinite else "no NaN or Inf")
    if scanned.digests_checked:
        differ = len(scanned.digest_mismatches)
        state += (f"; {differ} of {scanned.digests_checked} header digest(s) do not match the bytes" if differ
                  else f"; {scanned.digests_checked} header digest(s) match the bytes")
    stdout.print(f"scan              {scanned.tensors_checked} floating tensor(s) of {scanned.tensors}, "
                 f"{human_bytes(scanned.bytes)} read in {human_seconds(scanned.seconds)}: {state}", soft_wrap=True)
    for bad in scanned.digest_mismatches:
        stdout.print(f"  {escape(bad.name)} ({escape(bad.shard)}): header digest {bad.expected}, bytes {bad.actual}",
                     soft_wrap=True)
    for found in scanned.nonfinite:
        stdout.print(f"  {escape(found.name)} ({escape(found.shard)}): {found.nan} NaN, {found.inf} Inf",
                     soft_wrap=True)
