"""Render reload reports, and follow a reload's per-layer progress, with Rich."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from layerwise_cli.cli._output import stderr, stdout
from layerwise_cli.report.progress import read_events
from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.report.sections import Placement
from layerwise_cli.report.verify_result import VerifyResult
from layerwise_cli.units import human_bytes, human_seconds

T = TypeVar("T")


def run_with_progress(task: Callable[[str | None], T], progress_path: str | None, label: str,
                      show: bool = True) -> T:
    """Run `task(progress_path)` in a thread; show a per-layer bar on stderr from the worker's events."""
    if not show or progress_path is None:
        return task(None)
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["value"] = task(progress_path)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    offset = 0
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[layer]}"), TimeElapsedColumn(),
                  console=stderr, transient=True) as progress:
        bar = progress.add_task(escape(label), total=None, layer="")
        while thread.is_alive() or offset < _size(progress_path):
            events, offset = read_events(Path(progress_path), offset)
            for event in events:
                if event["event"] == "start":
                    progress.update(bar, total=event["layers"])
                elif event["event"] == "layer":
                    progress.update(bar, advance=1, layer=escape(event["name"]))
            if not thread.is_alive() and not events:
                break
            time.sleep(0.05)
    thread.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]  # type: ignore[return-value]


def _size(path: str) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def _layer_label(name: str) -> str:
    # Every decoder module starts with `model.`; the rest is what tells layers apart.
    return name.removeprefix("model.")


def source_label(placement: Placement) -> str:
    """The source as the header names it: `org/model@<commit>` for a Hub source (the commit it was read at)."""
    return f"{placement.source}@{placement.commit}" if placement.commit else placement.source


def render_report(report: ReloadReport, title: str = "Reload", top: int = 0) -> None:
    """The per-layer table and totals on stdout."""
    table = Table(title=f"{escape(title)}: {report.placement.order} order, {len(report.layers)} parent layers "
                  "(buffered: bytes in vLLM's layer buffers as the layer completed)", title_justify="left")
    table.add_column("layer", overflow="fold", min_width=27)
    table.add_column("tensors", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("load", justify="right")
    table.add_column("process", justify="right")
    table.add_column("buffered", justify="right")
    layers = report.layers[:top] if top else report.layers
    for layer in layers:
        not_handed = f"skipped: {layer.skipped}" if layer.skipped else "patched in place" if layer.patched else None
        if not_handed is not None:
            table.add_row(f"{escape(_layer_label(layer.name))} [dim]({escape(not_handed)})[/]",
                          str(layer.tensors), human_bytes(layer.bytes), "-", "-", "-")
            continue
        table.add_row(escape(_layer_label(layer.name)) + ("" if layer.completed_during_stream else " (finalize)"),
                      str(layer.tensors), human_bytes(layer.bytes), human_seconds(layer.load_s),
                      human_seconds(layer.process_s), human_bytes(layer.buffered_bytes_at_completion))
    if top and len(report.layers) > top:
        table.add_row(f"... {len(report.layers) - top} more", "", "", "", "", "")
    stdout.print(table)
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    memory, findings = report.memory, report.findings
    summary.add_row("wall", f"{human_seconds(report.wall_s)} for {human_bytes(report.bytes)} "
                    f"({report.gb_per_s:.2f} GB/s), {report.volume.tensors} tensors, "
                    f"{report.placement.workers} worker(s)")
    summary.add_row("peak buffered", f"{human_bytes(memory.peak_buffer_bytes)} measured = "
                    f"{report.peak_over_largest:.2f} x largest layer ({human_bytes(memory.largest_layer_bytes)})")
    if memory.above_largest_layer_because:
        summary.add_row("", f"above the largest layer: {escape(memory.above_largest_layer_because)}")
    held = [layer for layer in report.layers if layer.held_to_end]
    if held:
        reasons = "; ".join(dict.fromkeys(layer.held_to_end for layer in held))
        summary.add_row("held to end", f"{', '.join(escape(_layer_label(layer.name)) for layer in held)} "
                        f"({escape(reasons)}): vLLM buffers them until the reload ends; layer order streams them last")
    verdict = "matches" if report.matches_prediction else "[yellow]DIFFERS from[/]"
    summary.add_row("predicted", f"{human_bytes(memory.predicted_peak_buffer_bytes)} ({verdict} the measurement)")
    summary.add_row("read-ahead", f"{human_bytes(memory.readahead_peak_bytes)} held at most, on top of the buffers")
    summary.add_row("in place", in_place_line(report))
    summary.add_row("time", time_line(report))
    summary.add_row("skipped", skipped_line(report))
    if report.volume.patched_layers:
        summary.add_row("patched", patched_line(report))
    if report.volume.rebuilt_layers:
        summary.add_row("rebuilt", rebuilt_line(report))
    if report.volume.fetched_bytes is not None:
        summary.add_row("fetched", f"{human_bytes(report.volume.fetched_bytes)} from "
                        f"{escape(source_label(report.placement))} by range (only the tensors handed over)")
    for note in findings.notes:
        summary.add_row("note", escape(note))
    if findings.unexpected:
        summary.add_row("unexpected", f"{len(findings.unexpected)} tensor(s) not buffered where the plan said")
    stdout.print(summary)
    if len(report.placement.ranks) > 1:
        render_ranks(report)


def time_line(report: ReloadReport) -> str:
    """Where the wall time went: the engine's thread (handover + vLLM), and the reading thread beside it."""
    timings, unchanged = report.timings, report.unchanged
    line = (f"handover {human_seconds(timings.handover_s)} + vLLM {human_seconds(timings.vllm_s)}; reading thread: "
            f"read {human_seconds(timings.read_s)}, check {human_seconds(timings.check_s)}, "
            f"hash {human_seconds(timings.hash_s)}, sample {human_seconds(timings.sample_s)}")
    if unchanged.spot_checked_layers:
        line += (f"; spot check of {unchanged.spot_checked_layers} layer(s) {human_seconds(timings.spot_check_s)} "
                 f"({human_bytes(unchanged.spot_check_bytes)})")
    return line


def patched_line(report: ReloadReport) -> str:
    """`12 of 19 layers patched in place from the delta (3.10 MiB read) in 0.05 s, each patched tensor proved by the
    step's digest`."""
    volume = report.volume
    return (f"{volume.patched_layers} of {len(report.layers)} layers patched in place from the delta "
            f"({human_bytes(volume.patched_bytes)} read) in {human_seconds(report.timings.patch_s)}, each patched "
            "tensor proved by the step's digest")


def rebuilt_line(report: ReloadReport) -> str:
    """`105 of 227 layers rebuilt from the delta's base and loaded as in the full step (not patched in place: ...)`."""
    volume = report.volume
    why = f": {escape(volume.rebuilt_reason)}" if volume.rebuilt_reason else ""
    return (f"{volume.rebuilt_layers} of {len(report.layers)} layers rebuilt from the delta's base and loaded as the "
            f"full step's are (not patched in place{why}); those cost what the full step's reload does, plus the "
            "rebuild")


def in_place_line(report: ReloadReport) -> str:
    """`115 of 227 layers (351.9 MiB) loaded into the engine's own tensors: ...`."""
    reloaded = sum(1 for layer in report.layers if not layer.skipped and not layer.patched)
    if not reloaded:
        return "none (no layer reloaded)"
    memory = report.memory
    if not memory.in_place_layers:
        return f"none of {reloaded} layers: vLLM materialized each in fresh tensors and copied them over"
    return (f"{memory.in_place_layers} of {reloaded} layers ({human_bytes(memory.in_place_bytes)}) loaded into the "
            "engine's own tensors (their processing keeps the loaded layout); the rest through vLLM's fresh tensors")


def skipped_line(report: ReloadReport) -> str:
    """`3 of 19 layers (1.00 MiB) unchanged, kept by the engine; digests from the shard headers: ...`."""
    total, unchanged = len(report.layers), report.unchanged
    if unchanged.all_layers:
        return f"none (--all: every layer reloaded and recorded; engine {report.placement.engine_id or '-'})"
    if unchanged.digests == "none":
        return "none (no records kept)"
    how = {"header": "digests from the shard headers: skipped layers spot-checked, not streamed",
           "read": "digests hashed as read", "mixed": "digests from headers where present, else hashed as read"}
    line = (f"{unchanged.skipped_layers} of {total} layers ({human_bytes(unchanged.skipped_bytes)}) unchanged, "
            f"kept by the engine; {how.get(unchanged.digests, unchanged.digests)}")
    if unchanged.stale_layers:
        line += f"; {unchanged.stale_layers} changed in the engine since recorded: reloaded"
    return line


def render_ranks(report: ReloadReport) -> None:
    """One row per worker: its place (rank, node when several, pp, tp, dp), the layers it held, what it read and
    buffered."""
    placement = report.placement
    table = Table(title=f"{placement.workers} workers, {placement.engines} engine(s)", title_justify="left")
    nodes = any(rank.node_rank for rank in placement.ranks)
    for column in ("rank", *(("node",) if nodes else ()), "pp", "tp", "dp"):
        table.add_column(column, justify="right")
    table.add_column("layers held", overflow="fold")
    table.add_column("streamed", justify="right")
    table.add_column("read from disk", justify="right")
    table.add_column("peak buffered", justify="right")
    for rank in placement.ranks:
        node = (str(rank.node_rank),) if nodes else ()
        table.add_row(str(rank.rank), *node, str(rank.pp_rank), str(rank.tp_rank), str(rank.dp_rank),
                      escape(_layer_span(rank.layers)), human_bytes(rank.bytes),
                      human_bytes(rank.disk_read_bytes) if rank.disk_read_bytes is not None else "-",
                      human_bytes(rank.peak_buffer_bytes))
    stdout.print(table)


def _layer_span(layers: list[str]) -> str:
    """`embed_tokens, layers 0-1 (14 modules)`: the non-decoder layers by name, decoder layers by index."""
    indices = sorted({int(m.group(1)) for name in layers if (m := re.search(r"\.layers\.(\d+)\.", name))})
    others = [_layer_label(name) for name in layers if not re.search(r"\.layers\.\d+\.", name)]
    parts = others[:1]
    if indices:
        span = f"{indices[0]}-{indices[-1]}" if indices == list(range(indices[0], indices[-1] + 1)) else \
            ",".join(map(str, indices))
        parts.append(f"layers {span}")
    parts += others[1:]
    return f"{', '.join(parts)} ({len(layers)} modules)"


def render_verify(verify: VerifyResult, where: str) -> None:
    """`--verify`'s verdict on stdout: counts, then every layer that differs, failed or was not checked."""
    line = (f"verify {escape(where)}: {verify.matched}/{verify.checked} parent layers match the source "
            f"bit for bit ({verify.tensors_compared} stored tensors, {verify.kernels_compared} kernel "
            f"read-backs) in {human_seconds(verify.wall_s)}")
    if verify.skipped:
        # Never "not checked" beside a success unless the user asked for it, and then in the same line.
        line += (f"; {len(verify.skipped)} NOT CHECKED, accepted by --allow-unchecked" if verify.unchecked_accepted
                 else f"; {len(verify.skipped)} not checked: verify fails")
    stdout.print(line, soft_wrap=True)
    for name, origin in verify.derived.items():
        stdout.print(f"  derived: {escape(name)} (derived from {escape(origin)}; checked against it)",
                     soft_wrap=True)
    for name in verify.mismatched:
        stdout.print(f"  differs: {escape(name)}: {escape(verify.details.get(name, ''))}", soft_wrap=True)
    for name, reason in verify.errors.items():
        stdout.print(f"  could not check: {escape(name)}: {escape(reason)}", soft_wrap=True)
    for name, reason in verify.skipped.items():
        stdout.print(f"  not checked: {escape(name)}: {escape(reason)}", soft_wrap=True)
