"""`layerwise demo`, the README's main-job command, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.engine
def test_demo_flips_multiply_add_multiply(tmp_path):
    env = {**os.environ, "LAYERWISE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "layerwise_cli", "demo", "--json", "--pairs", "3 4,2 5,9 9"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)  # stdout carries only the JSON: vLLM's logs go to stderr
    assert data["flipped"] is True
    assert data["answers"]["multiply (start)"] == ["12", "10", "81"]
    assert data["answers"]["after reloading add"] == ["7", "7", "18"]
    assert data["answers"]["after reloading multiply"] == ["12", "10", "81"]
    first = data["reloads"][0]
    assert first["order"] == "layer" and first["peak_buffer_bytes"] == first["largest_layer_bytes"]


def test_demo_rejects_bad_pairs():
    from typer.testing import CliRunner

    from layerwise_cli.cli.app import app

    result = CliRunner().invoke(app, ["demo", "--pairs", "3 44"])
    assert result.exit_code == 2
    assert result.output.count("Error:") == 1 and "--pairs" in result.output
