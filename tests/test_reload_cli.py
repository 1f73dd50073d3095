"""`layerwise reload` as a user runs it: one engine run end to end, and the CLI's own errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.cli.app import app
from tests.support.hub_server import HubServer, once_named

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


def test_base_of_another_architecture_is_refused_before_the_engine_starts(make_checkpoint):
    moe = make_checkpoint("in_order", layers=2, experts=4)
    dense = make_checkpoint("in_order", layers=2)
    proc = run("reload", "--weights-path", str(moe), "--model", str(dense))
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert "Qwen3MoeForCausalLM" in line and "Qwen3ForCausalLM" in line and str(moe) in line
    assert "Starting vLLM" not in proc.stderr


def test_corrupt_source_is_refused_before_the_engine_starts(make_checkpoint):
    bad = make_checkpoint("in_order", shards=1, layers=2)
    base = make_checkpoint("in_order", shards=1, layers=2)
    (shard,) = bad.glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[:-10])
    proc = run("reload", "--weights-path", str(bad), "--model", str(base))
    assert proc.returncode == 1
    assert str(shard) in one_error_line(proc)


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def _usage_error_line(result) -> str:
    """The one `Error:` line of a usage error (exit 2), from CliRunner's output."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def test_bad_order_is_a_usage_error():
    line = _usage_error_line(_invoke("reload", "--weights-path", "./nowhere", "--order", "random"))
    assert "'--order'" in line and "'random' is not one of 'layer', 'file'" in line


@pytest.mark.parametrize("option", [["--dtype", "bfloat16"], ["-tp", "2"], ["--tensor-parallel-size", "1"],
                                    ["--max-model-len", "64"], ["--quantization", "fp8"], ["-q", "fp8"],
                                    ["--enforce-eager"], ["--no-enforce-eager"], ["--memory-fraction", "0.5"],
                                    ["--dtype", "auto"]],
                         ids=lambda option: " ".join(option))
def test_url_refuses_engine_options(option):
    """With --url the servers' engines already run: an engine option would be silently ignored, so it is refused,
    even when it names the default value."""
    line = _usage_error_line(_invoke("reload", "--weights-path", "x", "--url", "http://127.0.0.1:9", *option))
    flag = {"-tp": "--tensor-parallel-size", "-q": "--quantization", "--no-enforce-eager": "--enforce-eager"}.get(
        option[0], option[0])
    assert line.startswith(f"Error: {flag} set the engine this command starts; with --url the servers already run")


def test_url_names_every_engine_option_given_and_refuses_model():
    line = _usage_error_line(_invoke("reload", "--weights-path", "x", "--url", "http://127.0.0.1:9",
                                     "--dtype", "float16", "--max-model-len", "64"))
    assert line.startswith("Error: --dtype, --max-model-len set the engine")
    line = _usage_error_line(_invoke("reload", "--weights-path", "x", "--url", "http://127.0.0.1:9",
                                     "--model", "./base"))
    assert "--model starts an engine in this process" in line


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
    """A Hub repo id is fetched from a loopback Hub while the engine starts, then streamed in layer order."""
    with HubServer() as hub:
        hub.add_repo("debug/add", demo_models["add"])
        proc = run("reload", "--weights-path", "debug/add", "--model", str(demo_models["multiply"]), "--json",
                   "--verify", env={"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # vLLM's own lines stay off stdout
    # vLLM's known-harmless lines are dropped (the rotary warning in the worker, the force-kill notices at
    # stop); its other warnings still reach stderr.
    assert "Failed to load weights" not in proc.stderr and "force killing" not in proc.stderr
    assert "WARNING" in proc.stderr
    for key in ("wall_s", "bytes", "peak_buffer_bytes", "largest_layer_bytes", "layers", "order"):
        assert key in report
    assert report["order"] == "layer"
    assert report["peak_buffer_bytes"] == report["largest_layer_bytes"] == report["predicted_peak_buffer_bytes"]
    assert report["bytes"] == sum(layer["bytes"] for layer in report["layers"])
    names = [layer["name"] for layer in report["layers"]]
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
    assert "model.layers.0.self_attn.qkv_proj" in names and "model.layers.1.mlp.gate_up_proj" in names
    # Fetched while the engine started, each byte once; --verify then read the cache with no weight byte sent.
    size = (demo_models["add"] / "model.safetensors").stat().st_size
    assert size <= hub.sent_for(".safetensors") <= 1.05 * size
    # --verify in process: every layer of the downloaded source matches, bit for bit.
    verify = report["verify"]
    assert verify["ok"] and verify["checked"] == verify["matched"] == len(names) and not verify["mismatched"]


def test_a_hub_reload_reads_the_commit_main_named_at_its_start(demo_models, tmp_path):
    """`main` moved once the reload pinned it changes nothing: the engine ends on the start commit, named.

    The command resolves `main` before the engine starts; as it first reads that commit, `main` moves to the
    engine's own weights (*multiply*). `--verify` proves layer by layer that the engine holds the start commit
    (*add*, which differs from *multiply* in every layer), and no request after the pin named the branch.
    """
    with HubServer() as hub:
        start = hub.add_repo("debug/step", demo_models["add"])
        once_named(hub, start, lambda: hub.move_ref("debug/step", "main", demo_models["multiply"]))
        proc = run("reload", "--weights-path", "debug/step", "--model", str(demo_models["multiply"]), "--json",
                   "--verify", env={"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf")})
        moved_to = hub.resolve("debug/step", "main").commit
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert moved_to != start and report["commit"] == start and report["source"] == "debug/step"
    verify = report["verify"]
    assert verify["ok"] and verify["checked"] == verify["matched"] == len(report["layers"]) > 0
    named_main = [r.path for r in hub.requests if "/main" in r.path]
    assert len(named_main) == 1 and named_main[0].endswith("/resolve/main/config.json"), named_main
