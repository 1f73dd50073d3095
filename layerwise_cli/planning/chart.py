"""The buffered-bytes chart: what vLLM's layer buffers hold over the stream, file order against layer order."""

from __future__ import annotations

from pathlib import Path

from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.inspect import OrderReport
from layerwise_cli.units import human_bytes

# The formats matplotlib's Agg backend writes; the suffix of the path picks one.
CHART_FORMATS = (".png", ".svg", ".pdf")
FILE_ORDER_COLOR, LAYER_ORDER_COLOR = "tab:red", "tab:blue"


def stream_curves(report: OrderReport) -> dict:
    """Buffered bytes after each tensor against the bytes delivered so far, for both orders (from the plan).

    Args:
        report: the planner's result (`inspect_order`).

    Returns:
        `{"file": {"delivered_bytes": [...], "buffered_bytes": [...]}, "layer": {...}}`, one point per tensor,
        integers (the benchmark stores this in its JSON).
    """
    out = {}
    for order, stream, sim in (("file", report.plan.file_order, report.file_order_buffering),
                               ("layer", report.plan.layer_order, report.layer_order_buffering)):
        delivered, xs = 0, []
        for item in stream:
            delivered += item.entry.nbytes
            xs.append(delivered)
        out[order] = {"delivered_bytes": xs, "buffered_bytes": list(sim.curve)}
    return out


def byte_unit(largest: float) -> tuple[float, str]:
    """The binary unit (divisor, name) in which LARGEST reads as a number between 1 and 1024."""
    divisor, name = 1.0, "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if largest < 1024 * divisor:
            break
        divisor, name = divisor * 1024, unit
    return divisor, name


def draw_stream_curves(ax, curves: dict, *, largest_layer_bytes: int | None = None,
                       measured: dict[str, tuple[int, str]] | None = None, title: str | None = None) -> None:
    """Draw both orders' buffered bytes over the stream on a matplotlib Axes.

    Args:
        ax: the matplotlib Axes to draw on.
        curves: `stream_curves`' result (or the same dict read back from JSON).
        largest_layer_bytes: drawn as a dotted line (the least any order can buffer), when given.
        measured: label -> (peak bytes, colour), each drawn as a dashed line (the benchmark's measured peaks).
        title: the Axes' title.
    """
    xmax = max((c["delivered_bytes"][-1] for c in curves.values() if c["delivered_bytes"]), default=1)
    ymax = max([max(c["buffered_bytes"], default=0) for c in curves.values()]
               + [largest_layer_bytes or 0] + [peak for peak, _ in (measured or {}).values()] + [1])
    xdiv, xunit = byte_unit(xmax)
    ydiv, yunit = byte_unit(ymax)
    for order, color, label in (("file", FILE_ORDER_COLOR, "file order (vLLM's default read order)"),
                                ("layer", LAYER_ORDER_COLOR, "layer order (layerwise)")):
        curve = curves[order]
        peak = max(curve["buffered_bytes"], default=0)
        # A point is (bytes delivered, bytes buffered) once a tensor is in: that height holds while the tensor
        # arrives, from the previous point's x ("pre" steps), starting from nothing delivered.
        ax.step([0] + [x / xdiv for x in curve["delivered_bytes"]], [0] + [y / ydiv for y in curve["buffered_bytes"]],
                where="pre", color=color, label=f"{label}: peak {human_bytes(peak)}")
    if largest_layer_bytes:
        ax.axhline(largest_layer_bytes / ydiv, color="gray", linestyle=":", linewidth=1,
                   label=f"largest parent layer: {human_bytes(largest_layer_bytes)}")
    for label, (peak, color) in (measured or {}).items():
        ax.axhline(peak / ydiv, color=color, linestyle="--", linewidth=1, label=label)
    ax.set_xlim(0, xmax / xdiv)
    ax.set_ylim(0, ymax / ydiv * 1.08)
    ax.set_xlabel(f"{xunit} delivered")
    ax.set_ylabel(f"{yunit} buffered in vLLM's layer buffers")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")


def pyplot(where: str | None = None):
    """matplotlib's pyplot on the Agg backend (no display), or a one-line error naming the missing package."""
    try:
        import matplotlib  # noqa: PLC0415 - optional: the ImportError is handled here
    except ImportError:
        raise LayerwiseError("the chart needs matplotlib, which is not installed: "
                             "pip install 'layerwise[plot]'", where=where) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    return plt


def write_order_chart(report: OrderReport, path: str | Path) -> Path:
    """Draw a checkpoint's buffered bytes over the stream, file order against layer order, into an image file.

    The chart shows, after each tensor is delivered, the bytes vLLM's layer buffers hold (the tensors of parent
    layers not yet complete), in vLLM's default read order and in layer order, with the largest parent layer as
    a line: the gap between the red curve and that line is what `layerwise reorder` (or `layerwise reload`,
    which streams in layer order) saves.

    Args:
        report: the planner's result (`inspect_order`).
        path: where to write; the suffix picks the format (`.png`, `.svg` or `.pdf`).

    Returns:
        The path written.

    Raises:
        LayerwiseError: matplotlib is not installed, the suffix is not one of those formats, or the file cannot be
            written (the message names the path).
    """
    path = Path(path)
    if path.suffix.lower() not in CHART_FORMATS:
        raise LayerwiseError(f"cannot tell the chart's format from the suffix {path.suffix or '(none)'!r}; "
                             f"use one of {', '.join(CHART_FORMATS)}", where=str(path))
    plt = pyplot(str(path))
    plan = report.plan
    source = plan.checkpoint.source + (f" @ {plan.checkpoint.revision}" if plan.checkpoint.revision else "")
    file_peak = report.file_order_buffering.peak_buffer_bytes
    layer_peak = report.layer_order_buffering.peak_buffer_bytes
    largest = plan.largest_layer_bytes
    per = max(largest, 1)  # a checkpoint of empty tensors has no largest layer
    title = (f"{source}\n{len(plan.file_order)} tensors, {human_bytes(plan.total_bytes)}; "
             f"peak: file order {file_peak / per:.2f} x, layer order {layer_peak / per:.2f} x "
             "the largest layer")
    fig, ax = plt.subplots(figsize=(9, 5))
    try:
        draw_stream_curves(ax, stream_curves(report), largest_layer_bytes=largest, title=title)
        fig.tight_layout()
        try:
            fig.savefig(path, dpi=110)
        except OSError as exc:
            raise LayerwiseError(f"cannot write the chart: {exc.strerror or exc}", where=str(path)) from None
    finally:
        plt.close(fig)
    return path
