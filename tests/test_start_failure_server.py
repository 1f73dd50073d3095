"""An engine that fails to start says why: the exception vLLM's engine or worker process failed with, on one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from layerwise_cli.client.engine.in_process import EngineOptions, start_engine
from layerwise_cli.engine_output import capture_engine_output, root_cause, start_failure
from layerwise_cli.errors import LayerwiseError
from tests.support.producers import Producer, save_lfm2_checkpoint, save_pretrained_checkpoint
from tests.support.server_support import free_port

LAYERWISE = [sys.executable, "-m", "layerwise_cli"]

# What vLLM 0.32 wrote when a worker failed in model init (abridged from a real run on LFM2).
_VLLM_FAILURE = """\
(Worker pid=27618) ERROR 12-01 14:08:46 [multiproc_executor.py:953] WorkerProc failed to start.
(Worker pid=27618) ERROR 12-01 14:08:46 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker pid=27618) ERROR 12-01 14:08:46 [multiproc_executor.py:953]   File "/x/vllm/v1/executor/multiproc_executor.py", line 900, in worker_main
(Worker pid=27618) ERROR 12-01 14:08:46 [multiproc_executor.py:953]     worker = WorkerProc(*args, **kwargs)
(Worker pid=27618) ERROR 12-01 14:08:46 [multiproc_executor.py:953]              ^^^^^^^^^^^^^^^^^^^^^^^^^^^
(Worker pid=27618) ERROR 12-01 14:08:46 [multiproc_executor.py:953] AttributeError: 'Lfm2Config' object has no attribute 'conv_dim'
(EngineCore pid=27600) ERROR 12-01 14:08:47 [core.py:1510] EngineCore failed to start.
(EngineCore pid=27600) ERROR 12-01 14:08:47 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=27600) ERROR 12-01 14:08:47 [core.py:1510]   File "/x/vllm/v1/engine/core.py", line 1480, in run_engine_core
(EngineCore pid=27600) ERROR 12-01 14:08:47 [core.py:1510] Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
Traceback (most recent call last):
  File "/x/start.py", line 6, in <module>
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""  # noqa: E501


def test_root_cause_is_the_workers_exception_not_the_wrappers() -> None:
    assert root_cause(_VLLM_FAILURE.splitlines()) == "AttributeError: 'Lfm2Config' object has no attribute 'conv_dim'"
    assert root_cause(["INFO 12-01 14:08:40 [core.py:1] all fine", "Traceback (most recent call last):"]) is None


def test_start_failure_replaces_a_pointer_but_keeps_a_specific_message() -> None:
    wrapper = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    cause = "AttributeError: 'Lfm2Config' object has no attribute 'conv_dim'"
    assert start_failure(wrapper, cause).startswith(f"the vLLM engine failed to start: {cause} (raised in")
    specific = ValueError("max_model_len 100000 is greater than the model's 512")
    assert start_failure(specific, cause) == f"the vLLM engine failed to start: {specific}"
    assert start_failure(wrapper, None) == f"the vLLM engine failed to start: {wrapper}"


def test_capture_sees_a_child_processs_output_and_passes_it_on(tmp_path: Path) -> None:
    # A real child on the captured descriptors, as vLLM spawns its engine process; the outer process's
    # own stdout/stderr must still receive every line.
    child = "import sys; print('child log line'); sys.stderr.write('Traceback (most recent call last):\\n" \
            "  File \"x\", line 1\\nKeyError: \\'w13_weight\\'\\n')"
    code = textwrap.dedent(f"""
        import subprocess, sys
        from layerwise_cli.engine_output import capture_engine_output
        with capture_engine_output() as output:
            subprocess.run([sys.executable, "-c", {child!r}], check=True)
        print("CAUSE", output.root_cause())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.stdout.splitlines() == ["child log line", "CAUSE KeyError: 'w13_weight'"]
    assert "KeyError: 'w13_weight'" in done.stderr


def test_no_capture_is_left_behind() -> None:
    before = os.fstat(1).st_ino, os.fstat(2).st_ino
    with capture_engine_output():
        pass
    assert (os.fstat(1).st_ino, os.fstat(2).st_ino) == before


@pytest.fixture(scope="module")
def broken_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Qwen3 save_pretrained checkpoint whose config vLLM's model init refuses (in the worker process)."""
    out = save_pretrained_checkpoint(tmp_path_factory.mktemp("broken") / "qwen3", Producer("qwen3"), seed=0)
    config = json.loads((out / "config.json").read_text())
    config["hidden_act"] = "gelu"  # vLLM's Qwen2/Qwen3 MLP: "Unsupported activation: gelu. Only silu is supported"
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.engine
def test_api_names_the_workers_exception(tmp_path: Path) -> None:
    model = save_lfm2_checkpoint(tmp_path / "lfm2")
    with pytest.raises(LayerwiseError) as raised:
        start_engine(str(model), EngineOptions(max_model_len=64))
    message = str(raised.value)
    assert message.startswith(f"{model}: the vLLM engine failed to start: AttributeError: ")
    assert "'Lfm2Config' object has no attribute 'conv_dim'" in message
    assert "See root cause above" not in message


def _last_line(stderr: str) -> str:
    return stderr.rstrip("\n").rsplit("\n", 1)[-1]


@pytest.mark.engine
def test_cli_reload_names_the_workers_exception(broken_qwen3: Path) -> None:
    proc = subprocess.run([*LAYERWISE, "reload", "--weights-path", str(broken_qwen3), "--model", str(broken_qwen3),
                           "--max-model-len", "64"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [_last_line(proc.stderr)], proc.stderr[-3000:]
    assert errors[0].startswith(f"Error: {broken_qwen3}: the vLLM engine failed to start: ValueError: "
                                "Unsupported activation: gelu")


@pytest.mark.engine
@pytest.mark.server
def test_serve_names_the_workers_exception(broken_qwen3: Path) -> None:
    proc = subprocess.run([*LAYERWISE, "serve", str(broken_qwen3), "--port", str(free_port()), "--max-model-len",
                           "64"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [_last_line(proc.stderr)], proc.stderr[-3000:]
    assert errors[0].startswith(f"Error: {broken_qwen3}: the vLLM engine failed to start: ValueError: "
                                "Unsupported activation: gelu")
