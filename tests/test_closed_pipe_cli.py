"""A reader that left (`layerwise ... | head -1`): every command ends quietly, exit 1, nothing on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server_support import free_port
from tests.support.synthetic import SyntheticModel, write_checkpoint

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ["inspect-order", "reload", "serve", "reorder", "demo", "watch"]


def into_closed_pipe(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run `layerwise ARGS` with stdout a pipe whose reading end is already closed: every write fails (EPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    try:
        return subprocess.run([sys.executable, "-m", "layerwise_cli", *args], stdout=write_end,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env, timeout=120,
                              check=False)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [["--help"], *([name, "--help"] for name in COMMANDS)], ids=" ".join)
def test_help_into_a_closed_pipe_ends_quietly(args: list[str]) -> None:
    done = into_closed_pipe(args)
    assert (done.returncode, done.stderr) == (1, "")


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["table", "json"])
def test_a_report_into_a_closed_pipe_ends_quietly(tmp_path: Path, extra: list[str]) -> None:
    folder = tmp_path / "model"
    write_checkpoint(folder, SyntheticModel(layers=4), "trainer_export", 2)
    done = into_closed_pipe(["inspect-order", str(folder), *extra])
    assert (done.returncode, done.stderr) == (1, "")


def test_an_open_pipe_is_not_affected(tmp_path: Path) -> None:
    """The same command into a pipe that is read: exit 0, the whole output."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "layerwise_cli", "watch", "--help"], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0 and "--url" in done.stdout


def test_watch_json_into_a_closed_pipe_stops_quietly(tmp_path: Path) -> None:
    """The first event cannot be written: the watcher stops (nothing in flight is left behind), exit 1, no message."""
    (tmp_path / "step_1").mkdir()
    done = into_closed_pipe(["watch", str(tmp_path), "--url", f"http://127.0.0.1:{free_port()}", "--json",
                             "--interval", "0.1"])
    assert (done.returncode, done.stderr) == (1, "")
