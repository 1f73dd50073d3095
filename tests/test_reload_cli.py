"""`layerwise reload` as a user runs it: one engine run end to end, and the CLI's own errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import HubServer

LAYERWISE = [sys.executable, "-m", "layerwise_cli"]


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAYERWISE, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_missing_source_is_one_line_and_starts_nothing(tmp_path: Path):
    proc = run("reload", "--weights-path", str(tmp_path / "nope"))
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert str(tmp_path / "nope") in line
    assert "Starting vLLM" not in proc.stderr


def test_base_of_another_architecture_is_refused_before_the_engine_starts(make_checkpoint, demo_models):
    moe = make_checkpoint("in_order", layers=2, experts=4)
    proc = run("reload", "--weights-path", str(moe), "--model", str(demo_models["multiply"]))
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert "Qwen3MoeForCausalLM" in line and "Qwen3ForCausalLM" in line and str(moe) in line
    assert "Starting vLLM" not in proc.stderr


def test_corrupt_source_is_refused_before_the_engine_starts(demo_models, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(demo_models["add"], bad)
    shard = bad / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    proc = run("reload", "--weights-path", str(bad), "--model", str(demo_models["multiply"]))
    assert proc.returncode == 1
    assert str(shard) in one_error_line(proc)


def test_bad_order_is_a_usage_error(demo_models):
    proc = run("reload", "--weights-path", str(demo_models["add"]), "--order", "random")
    assert proc.returncode == 2


@pytest.mark.engine
def test_engine_that_fails_to_start_is_one_line(demo_models):
    # The debug model allows 512 positions; vLLM refuses a longer context at start.
    proc = run("reload", "--weights-path", str(demo_models["add"]), "--model", str(demo_models["multiply"]),
               "--max-model-len", "100000")
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert "failed to start" in line and str(demo_models["multiply"]) in line


@pytest.mark.engine
def test_reload_from_the_hub_end_to_end(demo_models, tmp_path):
    """A Hub repo id is downloaded (weights and config) from a loopback Hub, then streamed in layer order."""
    with HubServer() as hub:
        hub.add_repo("debug/add", demo_models["add"])
        proc = run("reload", "--weights-path", "debug/add", "--model", str(demo_models["multiply"]), "--json",
                   "--verify", env={"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    for key in ("wall_s", "bytes", "peak_buffer_bytes", "largest_layer_bytes", "layers", "order"):
        assert key in report
    assert report["order"] == "layer"
    assert report["peak_buffer_bytes"] == report["largest_layer_bytes"] == report["predicted_peak_buffer_bytes"]
    assert report["bytes"] == sum(layer["bytes"] for layer in report["layers"])
    names = [layer["name"] for layer in report["layers"]]
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
    assert "model.layers.0.self_attn.qkv_proj" in names and "model.layers.1.mlp.gate_up_proj" in names
    assert hub.sent_for(".safetensors") >= (demo_models["add"] / "model.safetensors").stat().st_size
    # --verify in process: every layer of the downloaded source matches, bit for bit.
    verify = report["verify"]
    assert verify["ok"] and verify["checked"] == verify["matched"] == len(names) and not verify["mismatched"]
