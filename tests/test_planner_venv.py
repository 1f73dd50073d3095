"""Without vLLM installed, inspect-order plans exactly as with vLLM: a venv of layerwise's light dependencies.

The venv holds only `[project] dependencies` (no torch, no vLLM), built
without a pip cache. Each checkpoint is planned there and here (vLLM
installed); the JSON must be equal. `tests/test_planner_engine.py` and the
equivalence matrix prove the with-vLLM predictions equal the engine's
measurement, so the venv's predictions equal it too (one engine start per
architecture, none here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from layerwise_cli.planning import arch_table
from tests.support.producers import PADDED_VOCAB, Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.slow  # builds a venv (pip from the registry) and writes checkpoints with torch

ROOT = Path(__file__).resolve().parent.parent
# The equivalence matrix's configurations, then the families beyond it.
PRODUCERS = [Producer("qwen3"), Producer("qwen3", tied=True, vocab_size=PADDED_VOCAB),
             Producer("llama", vocab_size=PADDED_VOCAB), Producer("mistral"), Producer("qwen3_moe"),
             Producer("phi3"), Producer("gemma3"), Producer("gpt2"), Producer("granite"), Producer("olmo2"),
             Producer("nemotron_h"), Producer("qwen3_next")]


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("light-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    # pip from this interpreter installs into the venv (--python): no pip bootstrap, no cache.
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                           "--no-cache-dir", *deps], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm'), "
                            "u.find_spec('torch'))"], capture_output=True, text=True, timeout=60, check=True)
    assert probe.stdout.split() == ["None", "None"], probe.stdout
    return python


def plan_json(python: Path, folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    proc = subprocess.run([str(python), "-m", "layerwise_cli", "inspect-order", str(folder), "--json", "--top", "0"],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("producers")
    return {p.label: save_pretrained_checkpoint(root / p.label, p, seed=2) for p in PRODUCERS}


@pytest.mark.parametrize("producer", PRODUCERS, ids=lambda p: p.label)
def test_the_plan_without_vllm_equals_the_plan_with_it(light_venv: Path, checkpoints, producer: Producer) -> None:
    pytest.importorskip("vllm")
    folder = checkpoints[producer.label]
    without = plan_json(light_venv, folder)
    with_vllm = plan_json(Path(sys.executable), folder)
    assert without["mapping"]["kind"] == "table"
    # Without vLLM the planner reads the newest table (the release GPU users install); with vLLM, the table of
    # the installed version. For these architectures the two tables agree: the plans differ only in that stamp.
    newest, installed = arch_table.tables()[0]["vllm_version"], arch_table.installed_vllm_version()
    assert f"(vLLM {newest}," in without["mapping"].pop("description")
    assert f"(vLLM {installed}," in with_vllm["mapping"].pop("description")
    assert without == with_vllm
