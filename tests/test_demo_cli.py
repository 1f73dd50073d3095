"""`layerwise demo`, the README's main-job command, as a user runs it."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.cli.app import app
from layerwise_cli.client.engine.in_process import EngineOptions
from layerwise_cli.vllm_logs import QUIET_ENV, quiet_engine_notes

# The `layerwise` script of this environment: an engine process spawned from it imports layerwise first.
LAYERWISE = str(Path(sys.executable).with_name("layerwise"))


@pytest.mark.engine
def test_demo_flips_multiply_add_multiply(tmp_path):
    env = {**os.environ, "LAYERWISE_CACHE": str(tmp_path / "cache")}
    env.pop("LAYERWISE_DEBUG", None)
    proc = subprocess.run([LAYERWISE, "demo", "--json", "--pairs", "3 4,2 5,9 9"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Without --verbose no warning or note of vLLM's, torch's or Triton's reaches the terminal.
    noise = [line for line in proc.stderr.splitlines()
             if re.search(r"\bWARNING\b|^\[W\d|Triton|FutureWarning|Loading safetensors", line)]
    assert noise == [], "\n".join(noise)
    data = json.loads(proc.stdout)  # stdout carries only the JSON: vLLM's logs go to stderr
    assert data["flipped"] is True
    assert data["answers"]["multiply (start)"] == ["12", "10", "81"]
    assert data["answers"]["after reloading add"] == ["7", "7", "18"]
    assert data["answers"]["after reloading multiply"] == ["12", "10", "81"]
    first = data["reloads"][0]
    assert first["order"] == "layer" and first["peak_buffer_bytes"] == first["largest_layer_bytes"]


def test_demo_rejects_bad_pairs():
    result = CliRunner().invoke(app, ["demo", "--pairs", "3 44"])
    assert result.exit_code == 2
    assert result.output.count("Error:") == 1 and "--pairs" in result.output


def test_quiet_engine_notes_hides_warnings_unless_debugging(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL", "PYTHONWARNINGS", QUIET_ENV):
        monkeypatch.delenv(name, raising=False)
    triton = logging.getLogger("vllm.triton_utils.importing")
    monkeypatch.setattr(triton, "level", logging.NOTSET)
    monkeypatch.setenv("LAYERWISE_DEBUG", "1")
    options = EngineOptions(max_model_len=64)
    assert quiet_engine_notes(options) is options
    assert "VLLM_LOGGING_LEVEL" not in os.environ and triton.level == logging.NOTSET

    monkeypatch.delenv("LAYERWISE_DEBUG")
    quiet = quiet_engine_notes(options)
    assert quiet.extra == {"use_tqdm_on_load": False} and quiet.max_model_len == 64
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert os.environ[QUIET_ENV] == "1" and triton.level == logging.ERROR
