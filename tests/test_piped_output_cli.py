"""Tables on a piped stdout (a file, `| less`, CI logs) keep every column and every name whole."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from layerwise_cli.vllm_logs import (
    KILL_TREE_LOGGER,
    RELOAD_LOGGER,
    SHUTDOWN_LOGGER,
    quiet_force_kill,
    silence_rotary_reload_warning,
)
from tests.support.log_levels import loggers_at
from tests.support.synthetic import SyntheticModel, write_checkpoint


def _piped(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run with stdout and stderr pipes (no terminal anywhere) and no COLUMNS, as `layerwise ... | cat` does."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run([sys.executable, *args], capture_output=True, stdin=subprocess.DEVNULL, text=True,
                          env=env, timeout=120, check=False)


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every body row of the first table (│-separated lines between ┡ and └)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    end = next(i for i, line in enumerate(lines) if line.startswith("└"))
    return [[cell.strip() for cell in line.strip("│").split("│")] for line in lines[start + 1:end]]


def _header(text: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith("┃"))
    return [cell.strip() for cell in line.strip("┃").split("┃")]


def test_inspect_order_table_is_whole_when_piped(tmp_path: Path) -> None:
    # Multimodal-style names are long: the table is far wider than 80 columns.
    folder = tmp_path / "long-names"
    write_checkpoint(folder, SyntheticModel(layers=12, experts=4, prefix="model.language_model."), "trainer_export", 3)
    shown = _piped(["-m", "layerwise_cli", "inspect-order", str(folder), "--top", "0"])
    assert shown.returncode == 0, shown.stderr
    assert _header(shown.stdout) == ["layer", "tensors", "bytes", "shards", "held in file order"]
    rows = _table_rows(shown.stdout)
    data = json.loads(_piped(["-m", "layerwise_cli", "inspect-order", str(folder), "--top", "0", "--json"]).stdout)
    # One line per parent layer, every name whole in its cell: nothing wrapped onto a second line.
    assert [row[0] for row in rows] == [layer["name"] for layer in data["layers"]]
    assert all(len(row) == 5 and all(row) for row in rows)
    assert max(len(line) for line in shown.stdout.splitlines()) > 80  # the case Rich used to cut


def test_reload_table_is_whole_when_piped() -> None:
    code = textwrap.dedent("""
        from layerwise_cli.cli._reload_view import render_report
        from layerwise_cli.report.reload_report import ReloadReport
        from layerwise_cli.report.records import LayerReport
        from layerwise_cli.report.sections import Memory, Placement, Timings, Volume

        names = ["model.layers.0.post_attention_layernorm",
                 "model.language_model.layers.11.mlp.experts.routed_experts"]
        layers = [LayerReport(name, 1, 128, 0.0, 0.001, 128) for name in names]
        memory = Memory(peak_buffer_bytes=128, peak_tensor="t", predicted_peak_buffer_bytes=128,
                        largest_layer_bytes=128, readahead_peak_bytes=0)
        render_report(ReloadReport(placement=Placement(source="s", order="layer", rank=0),
                                   volume=Volume(bytes=256, tensors=2), memory=memory, timings=Timings(wall_s=0.5),
                                   layers=layers),
                      title="Reload /a/long/path/to/a/checkpoint/step-000200")
    """)
    shown = _piped(["-c", code])
    assert shown.returncode == 0, shown.stderr
    assert _header(shown.stdout) == ["layer", "tensors", "bytes", "load", "process", "buffered"]
    rows = _table_rows(shown.stdout)
    assert [row[0] for row in rows] == ["layers.0.post_attention_layernorm",
                                        "language_model.layers.11.mlp.experts.routed_experts"]
    assert all(row[5] == "128 B" for row in rows)


def test_columns_still_sets_the_width(tmp_path: Path) -> None:
    """COLUMNS, when set, is the width, as in a terminal: the table fits it (folding where it must)."""
    folder = tmp_path / "long-names"
    write_checkpoint(folder, SyntheticModel(layers=2, prefix="model.language_model."), "in_order", 1)
    env = {**os.environ, "COLUMNS": "70"}
    shown = subprocess.run([sys.executable, "-m", "layerwise_cli", "inspect-order", str(folder)], env=env,
                           capture_output=True, text=True, timeout=120, check=False)
    assert shown.returncode == 0, shown.stderr
    assert max(len(line) for line in shown.stdout.splitlines()) <= 70


# --- vLLM's known-harmless log lines -------------------------------------------------------------------------


def test_only_the_known_harmless_vllm_lines_are_dropped(monkeypatch) -> None:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    # vLLM holds its loggers at the level an earlier engine in this worker started with: WARNING here.
    with loggers_at(logging.WARNING, RELOAD_LOGGER, SHUTDOWN_LOGGER, KILL_TREE_LOGGER):
        for name in (RELOAD_LOGGER, SHUTDOWN_LOGGER, KILL_TREE_LOGGER):
            logging.getLogger(name).addHandler(handler)
        try:
            reload_logger = logging.getLogger(RELOAD_LOGGER)
            silence_rotary_reload_warning()
            installed = list(reload_logger.filters)
            silence_rotary_reload_warning()
            assert reload_logger.filters == installed  # idempotent
            reload_logger.warning("%s: Failed to load weights", "RotaryEmbedding")
            reload_logger.warning("%s: Failed to load weights", "MRotaryEmbedding")
            reload_logger.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real problem: kept
            reload_logger.warning("something else")
            shutdown_logger = logging.getLogger(SHUTDOWN_LOGGER)
            kill = "[shutdown] Process manager: force killing remaining processes count=%d"
            with quiet_force_kill():
                shutdown_logger.warning(kill, 1)
                # Then each process of the engine's tree, from another logger (vllm/utils/system_utils.py).
                logging.getLogger(KILL_TREE_LOGGER).warning("[shutdown] force killing sub process %s pid %d",
                                                            "VLLM::Worker", 4691)
                shutdown_logger.warning("[shutdown] something else")
            shutdown_logger.warning(kill, 2)  # outside a deliberate stop: kept
            monkeypatch.setenv("LAYERWISE_DEBUG", "1")
            reload_logger.warning("%s: Failed to load weights", "RotaryEmbedding")  # debugging shows everything
        finally:
            for name in (RELOAD_LOGGER, SHUTDOWN_LOGGER, KILL_TREE_LOGGER):
                logging.getLogger(name).removeHandler(handler)
    assert seen == ["QKVParallelLinear: Failed to load weights", "something else", "[shutdown] something else",
                    "[shutdown] Process manager: force killing remaining processes count=2",
                    "RotaryEmbedding: Failed to load weights"]
