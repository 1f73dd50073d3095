"""What a person sees after an RL run: a Rich table of the steps, the figures, the checks, and a timeline picture."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from examples.rl.record import RunRecord
from layerwise_cli.units import human_bytes


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _mb(value: int) -> str:
    return human_bytes(value)


def render(record: RunRecord, console=None) -> None:
    """The steps table, the figures and the checks, on CONSOLE (Rich; default: stdout)."""
    console = console or Console()
    table = Table(title="RL run: one row per step")
    for column in ("step", "kind", "save", "written", "full", *(f"serve/pause {i}" for i in ("a", "b")),
                   "served", "failed"):
        table.add_column(column, justify="right" if column != "kind" else "left")
    for row in record.steps:
        per_server = [f"{_s(s.serve_s)} / {_s(s.paused_s)}" for s in row.servers]
        kind = row.kind + (" NaN" if row.nan else "")
        table.add_row(str(row.step), kind, _s(row.save_s), _mb(row.written_bytes), _mb(row.full_bytes), *per_server,
                      str(row.served), str(row.failed))
    console.print(table)
    figures = record.figures()
    for name, label in (("serve_s", "step-to-serve"), ("pause_s", "pause per step"),
                        ("drain_s", "  of which the drain (in-flight requests finishing)"),
                        ("stopped_s", "stopped (nothing generated)"), ("apply_s", "apply per step"),
                        ("stalled_s", "engine held by the reload (no step ran)"),
                        ("pause_over_apply", "pause / apply"), ("stopped_over_apply", "stopped / apply"),
                        ("stalled_over_apply", "engine held / apply"),
                        ("save_s", "trainer's save"), ("bytes_over_full", "bytes per step / full step")):
        value = figures[name]
        if value["n"]:
            console.print(f"{label}: p50 {value['p50']:.3f}, p95 {value['p95']:.3f} (n={value['n']})")
    console.print(f"answers per step: {record.answers_per_step}")
    console.print(f"staleness (steps behind the newest -> answers): {record.staleness}")
    for name, outcome in record.checks.items():
        console.print(f"{name}: {outcome}")


def write_summary(record: RunRecord, out: Path) -> Path:
    """The record as JSON (steps, figures, answers per step, staleness, checks, start lines)."""
    path = out / "summary.json"
    data = {"steps": [r.to_dict() for r in record.steps], "figures": record.figures(),
            "answers_per_step": record.answers_per_step, "staleness": record.staleness, "checks": record.checks,
            "start_lines": record.start_lines}
    path.write_text(json.dumps(data, indent=2))
    return path


def timeline(events_path: Path, png: Path, step_of) -> Path:
    """The run over time: the trainer's steps, each server's pauses and weight step, requests per second."""
    import matplotlib  # noqa: PLC0415 - matplotlib: optional dependency (the plot extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib: optional dependency (the plot extra)

    rows = [json.loads(line) for line in events_path.read_text().splitlines()]
    t0 = min(r["time"] for r in rows)
    servers = sorted({r["server"] for r in rows if r["event"] == "answer"})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, height_ratios=(3, 1))
    for r in rows:
        if r["event"] == "step_saved":
            top.axvline(r["time"] - t0, color="red" if r.get("nan") else "grey", lw=0.6, ls=":")
        elif r["event"] in ("server_killed", "store_down", "trainer_killed"):
            top.annotate(r["event"].replace("_", " "), (r["time"] - t0, 0), rotation=90, fontsize=7, va="bottom")
    for i, url in enumerate(servers):
        points = [(r["time"] - t0, step_of(r["versions"][-1] if r["versions"] else None))
                  for r in rows if r["event"] == "answer" and r["server"] == url]
        points = [(t, s + 0.08 * i) for t, s in points if s is not None]
        top.scatter([t for t, _ in points], [s for _, s in points], s=3, label=f"answers of server {'ab'[i]}")
        for r in rows:
            if r["event"] == "reload_done" and r.get("server") == url and r.get("paused_s"):
                top.axvspan(r["time"] - t0 - r["paused_s"], r["time"] - t0, color=f"C{i}", alpha=0.25)
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 - matplotlib: optional dependency (the plot extra)

    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylabel("step of each answer\n(dotted: a step saved; red: NaN)")
    top.legend(loc="upper left", fontsize=8)
    done = [r["time"] - t0 for r in rows if r["event"] == "answer"]
    if done:
        bottom.hist(done, bins=max(1, int(max(done)) + 1), color="C2")
    bottom.set_ylabel("requests / s")
    bottom.set_xlabel("seconds since the run began (shaded: servers paused for a reload)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
