"""Sparse deltas over HTTP: `reload --url` and `watch` bring a real server from A to B and back by deltas."""

from __future__ import annotations

import json
import shutil

import pytest

from layerwise_cli.demo import expected_answer
from layerwise_cli.writer.delta_step import write_delta
from tests.support.deltas import rl_step, save_step, write_steps
from tests.support.server_support import RunningServer, run_cli

pytestmark = pytest.mark.server

PAIRS = [(3, 4), (2, 5), (9, 9), (7, 8), (0, 6)]


def expected(name: str) -> list[str]:
    return [expected_answer(name, a, b) for a, b in PAIRS]


@pytest.fixture(scope="module")
def steps(demo_models, tmp_path_factory) -> dict:
    steps = write_steps(tmp_path_factory.mktemp("delta-server"), demo_models)
    steps.pop("tensors")
    return steps


@pytest.fixture(scope="module")
def server(steps):
    with RunningServer(steps["A"], extra=["--max-model-len", "64", "--max-num-seqs", "1"]) as running:
        yield running


def _reload(server, source, *args: str):
    return run_cli("reload", "--weights-path", str(source), "--url", server.url, "--json", *args)


def test_reload_url_moves_a_server_by_deltas_and_refuses_the_wrong_base(server, steps):
    # Started on A, reloaded by nobody: no record proves what it holds.
    refused = _reload(server, steps["AB"])
    assert refused.returncode == 1
    errors = [line for line in refused.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "needs the engine to hold its base" in errors[0], refused.stderr
    assert server.answers(PAIRS) == expected("multiply")
    assert _reload(server, steps["A"], "--all").returncode == 0
    to_b = _reload(server, steps["AB"], "--verify")
    assert to_b.returncode == 0, to_b.stderr
    entry = json.loads(to_b.stdout)["servers"][0]
    assert entry["verify"]["ok"] and entry["report"]["source"] == str(steps["AB"])
    # The server's records say the full step B: B's full checkpoint is skipped whole.
    same = json.loads(_reload(server, steps["B"]).stdout)["servers"][0]["report"]
    assert same["bytes"] == 0 and same["skipped_layers"] == len(same["layers"])
    # delta(A->B) again: the server holds B, the delta needs A.
    wrong = _reload(server, steps["AB"])
    assert wrong.returncode == 1 and "holds other weights" in wrong.stderr
    back = _reload(server, steps["BA"])
    assert back.returncode == 0, back.stderr
    assert server.answers(PAIRS) == expected("multiply")  # A is multiply's own weights, bit for bit


def test_watch_loads_a_delta_step_against_the_step_the_server_holds(server, steps, tmp_path):
    assert _reload(server, steps["A"], "--all").returncode == 0
    run = tmp_path / "run"
    run.mkdir()
    # The trainer's run: step_1 in full, step_2 as a delta against it (a copy of step_1: the base is known by its
    # digests, not its path, and the delta names this copy).
    shutil.copytree(steps["A"], run / "step_1")
    written = write_delta(run / "step_1", steps["B"], run / "step_2")
    assert written.delta is not None
    (run / "step_1" / "STABLE").touch()
    done = run_cli("watch", str(run), "--url", server.url, "--marker", "STABLE", "--once", "--interval", "0.1")
    assert done.returncode == 0, done.stderr
    assert "step_2" in done.stderr
    same = json.loads(_reload(server, steps["B"]).stdout)["servers"][0]["report"]
    assert same["bytes"] == 0 and same["skipped_layers"] == len(same["layers"])
    # A server that holds a step outside the newest delta's chain is not refused: the trainer wrote B in full
    # (step_3), then C against it (step_4); the server holds A. watch rebuilds step_4 from B's files and its
    # patch, and the server ends on C.
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from safetensors.torch import load_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    assert _reload(server, steps["A"], "--all").returncode == 0
    shutil.copytree(steps["B"], run / "step_3")
    b = {}
    for shard in sorted(steps["B"].glob("*.safetensors")):
        b.update(load_file(shard))
    c = {name: rl_step(t, 0.02, 7) if t.dtype == torch.bfloat16 else t for name, t in b.items()}
    assert save_step(c, run / "step_4", steps["A"], base=run / "step_3").delta is not None
    (run / "step_3" / "STABLE").touch()
    (run / "step_4" / "STABLE").touch()
    save_step(c, tmp_path / "c_full", steps["A"])
    done = run_cli("watch", str(run), "--url", server.url, "--marker", "STABLE", "--once", "--interval", "0.1")
    assert done.returncode == 0, done.stderr
    assert "step_4" in done.stderr
    held = json.loads(_reload(server, tmp_path / "c_full", "--verify").stdout)["servers"][0]
    assert held["verify"]["ok"] and held["report"]["bytes"] == 0
