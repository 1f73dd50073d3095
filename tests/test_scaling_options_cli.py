"""The scaling options of `reload` and `serve` (-pp, -dp, --distributed-executor-backend): parsing and refusals."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from layerwise_cli import ENGINES_RPC_PATH
from layerwise_cli.cli.app import app
from layerwise_cli.client.engine.in_process import EngineOptions
from layerwise_cli.engine_defaults import cuda_available, executor_refusal
from layerwise_cli.server.command_line import governed_option


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"NO_COLOR": "1", "COLUMNS": "200"})


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("Error")]


@pytest.mark.usefixtures("local_some_model")
def test_serve_passes_the_parallel_sizes_to_vllm_and_binds_a_core_per_worker(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("layerwise_cli.engine_cpus.worker_cpu_holders", lambda **_: {})
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    result = _invoke("serve", "some/model", "-pp", "2", "-tp", "2", "-dp", "2", "--dry-run")
    assert result.exit_code == 0, result.output
    line = result.stdout
    assert "--pipeline-parallel-size 2" in line and "--data-parallel-size 2" in line
    assert "--tensor-parallel-size 2" in line
    # Four workers per engine (tp x pp): one core each.
    assert "VLLM_CPU_OMP_THREADS_BIND='0|1|2|3'" in line


@pytest.mark.usefixtures("local_some_model")
def test_serve_beside_a_busy_engine_keeps_all_its_processes_off_that_engines_cores(monkeypatch):
    # A server restarted beside a busy one: its worker computes on CPU 1, and its API server and engine core
    # start there too (`layerwise serve` sets its own affinity before it becomes the server; vLLM's processes
    # inherit it), never on the core the busy worker holds.
    if cuda_available():
        pytest.skip("a GPU is present: serve binds no CPU cores there")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("layerwise_cli.engine_cpus.worker_cpu_holders", lambda **_: {0: 1})
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    result = _invoke("serve", "some/model", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1 " in result.stdout
    # With no core held there is nothing to keep off.
    monkeypatch.setattr("layerwise_cli.engine_cpus.worker_cpu_holders", lambda **_: {})
    assert "taskset" not in _invoke("serve", "some/model", "--dry-run").stdout


@pytest.mark.usefixtures("local_some_model")
def test_vllm_spellings_of_the_parallel_sizes_are_governed_by_serve():
    assert governed_option("-pp2") == "--pipeline-parallel-size"
    assert governed_option("-dp=2") == "--data-parallel-size"
    assert governed_option("--distributed_executor_backend=ray") == "--distributed-executor-backend"
    # vLLM's other -dp... options (-dpl: --data-parallel-size-local, -dpa: its address) pass through.
    assert governed_option("-dpl") is None and governed_option("-dpa") is None
    assert governed_option("--data-parallel-size-local") is None
    result = _invoke("serve", "some/model", "--dry-run", "--data-parallel-size=2", "-dpl", "1")
    assert result.exit_code == 0 and "--data-parallel-size 2" in result.stdout and "-dpl 1" in result.stdout


def test_the_ray_executor_is_refused_on_cpu_with_the_reason():
    if cuda_available():
        pytest.skip("a GPU is present: vLLM runs the Ray executor there")
    served = _invoke("serve", "some/model", "--distributed-executor-backend", "ray", "--dry-run")
    assert served.exit_code == 1
    (line,) = _error_lines(served.output)
    assert "needs a GPU platform" in line and "no Ray support" in line
    reloaded = _invoke("reload", "--weights-path", "W", "--model", "some/model",
                       "--distributed-executor-backend", "ray")
    assert reloaded.exit_code == 1, reloaded.output
    (line,) = _error_lines(reloaded.output)
    assert "needs a GPU platform" in line


def test_the_ray_executor_without_ray_installed_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert "pip install 'layerwise[ray]'" in executor_refusal("ray", on_gpu=True)
    assert executor_refusal("mp", on_gpu=False) is None and executor_refusal(None, on_gpu=False) is None


def test_reload_refuses_data_parallel_in_process_and_engine_options_with_url():
    result = _invoke("reload", "--weights-path", "W", "-dp", "2")
    assert result.exit_code == 2 and "layerwise serve MODEL -dp N" in result.output
    result = _invoke("reload", "--weights-path", "W", "--url", "http://127.0.0.1:9", "-pp", "2")
    assert result.exit_code == 2 and "--pipeline-parallel-size" in result.output


def test_engine_options_carry_the_parallel_layout():
    kwargs = EngineOptions(pipeline_parallel_size=2, distributed_executor_backend="mp").llm_kwargs()
    assert kwargs["pipeline_parallel_size"] == 2 and kwargs["distributed_executor_backend"] == "mp"
    assert "distributed_executor_backend" not in EngineOptions().llm_kwargs()


def test_vllm_cpu_still_declares_no_ray_device():
    """What the refusal rests on: vLLM's Ray placement raises "current platform cpu does not support ray"
    when `ray_device_key` is empty. This fails when vLLM's CPU platform gains Ray support."""
    if cuda_available():
        pytest.skip("a GPU is present")
    from vllm.platforms import current_platform  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    assert current_platform.device_type == "cpu" and current_platform.ray_device_key == ""


def test_the_engines_endpoint_answers_per_engine():
    """The route `layerwise serve` adds, against a fake engine client with two engines (our route's logic only)."""
    from fastapi import FastAPI  # noqa: PLC0415 - fastapi: heavy (test collection stays fast)
    from fastapi.testclient import TestClient  # noqa: PLC0415 - fastapi: heavy (test collection stays fast)

    from layerwise_cli.server.engines_rpc import engines_rpc  # noqa: PLC0415 - fastapi: heavy (test collection stays fast)

    calls = []

    class Core:
        async def call_utility_all_async(self, name, method, timeout, args, kwargs):
            calls.append((name, method, kwargs))
            return [[{"ok": True, "engine": 0}], [{"ok": True, "engine": 1}, "text"]]

    app = FastAPI()
    app.add_api_route(ENGINES_RPC_PATH, engines_rpc, methods=["POST"])
    app.state.engine_client = type("Client", (), {"engine_core": Core()})()
    client = TestClient(app)
    answer = client.post(ENGINES_RPC_PATH, json={"method": "layerwise_ping", "kwargs": {"a": 1}})
    assert answer.status_code == 200
    assert answer.json() == {"engines": [[{"ok": True, "engine": 0}], [{"ok": True, "engine": 1}, "text"]]}
    assert calls == [("collective_rpc", "layerwise_ping", {"a": 1})]
    assert client.post(ENGINES_RPC_PATH, json=["no method"]).status_code == 400


@pytest.mark.usefixtures("local_some_model")
def test_serve_binds_the_cores_asked_for_and_refuses_a_list_that_is_not_one(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    result = _invoke("serve", "some/model", "--cpus", "1", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "VLLM_CPU_OMP_THREADS_BIND=1 " in result.stdout
    result = _invoke("serve", "some/model", "--cpus", "one", "--dry-run")
    assert result.exit_code == 2 and "--cpus 'one' is not a CPU list" in result.output
