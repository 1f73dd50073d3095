"""Data parallel 2 behind one server: every engine is reached, reported, verified, and named when it fails.

vLLM's own /collective_rpc reaches every engine of a data-parallel server but
answers with the first engine's workers only; `layerwise serve` adds
/layerwise/engines_rpc, which answers per engine (see server/engines_rpc.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerwise_cli import EXTENSION_CLS
from layerwise_cli.client.engine.generate import greedy_answers
from layerwise_cli.client.engine.in_process import EngineOptions
from layerwise_cli.client.servers.api import ServerClient
from layerwise_cli.demo import demo_prompt, expected_answer
from layerwise_cli.server.command_line import server_command_line
from tests.support.dp_fault import FAULTY_EXTENSION_CLS
from tests.support.in_process import start_here, stop_here
from tests.support.server_support import KV_CACHE, ROOT, RunningServer, run_cli

pytestmark = pytest.mark.server

# 40 requests at once: vLLM's load balancer spreads them over both engines.
PAIRS = [(a, b) for a in range(2, 10) for b in range(5)]


@pytest.fixture(scope="module")
def fresh_add(demo_models):
    """What an engine started fresh on *add* answers (before the server starts: never two engines at once).

    The engine runs in this process (`start_here`: the same engine, answering bit for bit as one started the
    default way, tests/test_in_process_engine.py), a start of seconds where processes of its own take 30 or more.
    """
    llm = start_here(str(demo_models["add"]), EngineOptions(max_model_len=64))
    try:
        return greedy_answers(llm, [demo_prompt(a, b) for a, b in PAIRS])
    finally:
        stop_here(llm)


class _DataParallelServer(RunningServer):
    """`layerwise serve MODEL -dp 2` as it execs (server_command_line), with the test's extension subclass."""

    def command(self):
        _, env = super().command()
        # Two ranks: vLLM's own binding gives each its core (a test worker's one-core binding fits one rank).
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        # The engines import the test's extension class from the repository's `tests` package.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        plan = server_command_line(self.model, port=self.port, data_parallel_size=2, max_model_len=64,
                          extra=[*KV_CACHE, "--max-num-seqs", "8"])
        argv = [FAULTY_EXTENSION_CLS if arg == EXTENSION_CLS else arg for arg in plan.argv]
        assert FAULTY_EXTENSION_CLS in argv and argv[argv.index("--data-parallel-size") + 1] == "2"
        return argv, {**env, **plan.env}


@pytest.fixture(scope="module")
def dp_server(demo_models, fresh_add):
    with _DataParallelServer(demo_models["multiply"], start_timeout=400) as server:
        yield server


def _batch(server) -> list[str]:
    with ThreadPoolExecutor(max_workers=len(PAIRS)) as pool:
        return list(pool.map(lambda pair: server.answers([pair])[0], PAIRS))


def _served_per_engine(server) -> dict[str, float]:
    """vLLM's finished-request counter per engine index, from /metrics."""
    text = server.http.get(f"{server.url}/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line).group(1)
            counts[engine] = counts.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _per_engine_fingerprints(server) -> list[dict]:
    client = ServerClient(server.url)
    try:
        engines = client.engines_rpc("layerwise_fingerprints")
    finally:
        client.close()
    assert all(worker["ok"] for workers in engines for worker in workers)
    return [workers[0]["fingerprints"] for workers in engines]


def test_dp2_every_engine_reloads_reports_and_verifies(dp_server, demo_models, fresh_add):
    assert _batch(dp_server) == [expected_answer("multiply", a, b) for a, b in PAIRS]
    served_before = _served_per_engine(dp_server)
    done = run_cli("reload", "--weights-path", str(demo_models["add"]), "--url", dp_server.url, "--verify",
                   "--json")
    assert done.returncode == 0, done.stderr
    (server,) = json.loads(done.stdout)["servers"]
    report = server["report"]
    assert server["ok"] and server["engines"] == 2 and not server["warnings"]
    assert report["engines"] == 2 and report["workers"] == 2
    assert sorted((r["dp_rank"], r["pp_rank"], r["tp_rank"]) for r in report["ranks"]) == [(0, 0, 0), (1, 0, 0)]
    assert all(r["layers"] == [layer["name"] for layer in report["layers"]] for r in report["ranks"])
    assert server["verify"]["ok"] and server["verify"]["checked"] == len(report["layers"])

    answers = _batch(dp_server)
    assert answers == [expected_answer("add", a, b) for a, b in PAIRS] == fresh_add
    served = _served_per_engine(dp_server)
    # The batch was spread over both engines, and every answer flipped: both engines hold *add*.
    assert set(served) == {"0", "1"} and all(served[e] > served_before.get(e, 0.0) for e in served), served
    first, second = _per_engine_fingerprints(dp_server)
    assert first == second


def test_dp2_failure_on_one_engine_exits_1_naming_it(dp_server, demo_models, tmp_path):
    holding_add = _per_engine_fingerprints(dp_server)
    source = tmp_path / "multiply"
    shutil.copytree(demo_models["multiply"], source)
    poisoned = tmp_path / "multiply.engine1"  # what engine 1 reads instead (tests/support/dp_fault.py)
    shutil.copytree(source, poisoned)
    tensors = load_file(str(poisoned / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    assert not torch.isfinite(tensors[name]).all()

    done = run_cli("reload", "--weights-path", str(source), "--url", dp_server.url)
    assert done.returncode == 1
    error = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert len(error) == 1 and "data-parallel engine 1 of 2" in error[0] and "NaN" in error[0], done.stderr
    assert f"engine 0 holds {source}" in done.stderr and "engine 1 rolled back" in done.stderr
    first, second = _per_engine_fingerprints(dp_server)
    assert second == holding_add[1] and first != holding_add[0]

    shutil.rmtree(poisoned)
    done = run_cli("reload", "--weights-path", str(source), "--url", dp_server.url)
    assert done.returncode == 0, done.stderr
    assert _batch(dp_server) == [expected_answer("multiply", a, b) for a, b in PAIRS]
    first, second = _per_engine_fingerprints(dp_server)
    assert first == second
