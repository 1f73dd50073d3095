"""The count of engine and server starts per test file: which subprocesses start one, and the table of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engine_starts import KINDS, kind_of_command, line

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "engine_starts.py"
LAYERWISE = "/venv/bin/layerwise"


@pytest.mark.parametrize(("argv", "kind"), [
    ([LAYERWISE, "serve", "/m", "--port", "8000"], "server"),
    ([LAYERWISE, "serve", "/m", "--headless", "--nnodes", "2"], "server"),
    ([sys.executable, "-m", "layerwise_cli.server.launch", "--model", "/m"], "server"),
    ([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"], "server"),
    ([LAYERWISE, "reload", "--weights-path", "/b", "--model", "/a"], "cli_engine"),
    ([sys.executable, "-m", "layerwise_cli", "reload", "--weights-path", "/b", "--model", "/a"], "cli_engine"),
    ([LAYERWISE, "demo", "--pairs", "3,4"], "cli_engine"),
    ([sys.executable, "-c", "from vllm import LLM\nLLM(model='/m')"], "script"),
    ([sys.executable, "-m", "benchmarks.bench_reload", "--quick"], "script"),
    ([LAYERWISE, "reload", "--weights-path", "/b", "--url", "http://127.0.0.1:8000"], None),
    ([LAYERWISE, "inspect-order", "/m", "--json"], None),
    ([sys.executable, "-c", "print(1)"], None),
    (["git", "status"], None),
])
def test_each_kind_of_start_is_told_from_its_command_line(argv, kind):
    assert kind_of_command(argv) == kind


def test_the_table_takes_each_files_last_line_and_puts_the_slowest_first(tmp_path):
    starts = tmp_path / "starts.txt"
    counts = {kind: 0 for kind in KINDS}
    starts.write_text(line("gw0", "test_a_server.py", 999.0, {**counts, "server": 9})  # an earlier run's
                      + line("gw0", "test_a_server.py", 120.4, {**counts, "server": 2})
                      + line("gw1", "test_b_engine.py", 300.0, {**counts, "in_process": 3, "engine": 1})
                      + line("gw1", "test_c_logic.py", 1.0, counts))
    durations = tmp_path / "pytest.txt"
    durations.write_text("============ slowest durations ============\n"
                         "100.50s setup    tests/test_a_server.py::test_one\n"
                         "10.00s call     tests/test_a_server.py::test_two[x]\n"
                         "250.00s call     tests/test_b_engine.py::test_three\n")
    done = subprocess.run([sys.executable, str(SCRIPT), str(starts), "--durations", str(durations)],
                          capture_output=True, text=True, timeout=60, check=True)
    rows = [row for row in done.stdout.splitlines() if row.startswith("| test_")]
    # The logic file started nothing in under 20 s: left out.
    assert rows == ["| test_b_engine.py | 3 | 1 | 0 | 0 | 0 | 300 | 250 |",
                    "| test_a_server.py | 0 | 0 | 2 | 0 | 0 | 120 | 110 |"]
    assert done.stdout.splitlines()[-1] == "| all | 3 | 1 | 2 | 0 | 0 | 421 | 360 |"
