"""`layerwise serve` for one node of an engine across nodes: the command, the thread binding, the refusals."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from typer.testing import CliRunner

from layerwise_cli.cli.app import app
from layerwise_cli.errors import UsageError
from layerwise_cli.server.command_line import server_command_line
from layerwise_cli.server.headless import model_first, option_value
from layerwise_cli.server.nodes import NodePlacement, node_refusal
from layerwise_cli.server.peer_watch import PeerWatch, leader_gone, reachable

BIND = "VLLM_CPU_OMP_THREADS_BIND"


@pytest.fixture(autouse=True)
def _no_binding_set(monkeypatch):
    monkeypatch.delenv(BIND, raising=False)
    # As on a host where no other engine runs (engines of other tests or people would move these cores).
    monkeypatch.setattr("layerwise_cli.engine_cpus.worker_cpu_holders", lambda **_: {})


def _binding(tp: int, pp: int = 1, nnodes: int = 1, rank: int = 0) -> str | None:
    node = NodePlacement(nnodes=nnodes, node_rank=rank, headless=rank > 0)
    return server_command_line("m", tensor_parallel_size=tp, pipeline_parallel_size=pp, node=node,
                               on_gpu=False).env.get(BIND)


def test_the_thread_binding_counts_this_nodes_workers(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    # One node: every worker of the engine is local.
    assert _binding(tp=2) == "0-3|4-7"
    assert _binding(tp=2, pp=2) == "0-1|2-3|4-5|6-7"
    # TP=2 over two nodes: one worker per node, one CPU list (a list of two fails vLLM's assert): what vLLM's
    # `auto` would pick, named.
    assert "|" not in _binding(tp=2, nnodes=2)
    assert "|" not in _binding(tp=2, nnodes=2, rank=1)
    # TP=4 (or TP=2 x PP=2) over two nodes: two workers on each node, each with half the node's cores.
    assert _binding(tp=4, nnodes=2) == "0-3|4-7"
    assert _binding(tp=2, pp=2, nnodes=2, rank=1) == "0-3|4-7"


def test_a_binding_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(BIND, "1")
    assert _binding(tp=4, nnodes=2) is None  # not in the additions: the process inherits the user's own


def test_the_leader_serves_and_a_headless_node_serves_nothing():
    leader = server_command_line("m", tensor_parallel_size=2, api_key="k", on_gpu=False,
                                 node=NodePlacement(nnodes=2, master_addr="10.0.0.1", master_port=4000))
    assert leader.argv[leader.argv.index("--nnodes"):][:8] == [
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "4000"]
    assert "--headless" not in leader.argv and "--port" in leader.argv and leader.env["VLLM_API_KEY"] == "k"
    follower = server_command_line("m", tensor_parallel_size=2, api_key="k", host="0.0.0.0", on_gpu=False,
                                   node=NodePlacement(nnodes=2, node_rank=1, master_addr="10.0.0.1",
                                                      master_port=4000, headless=True))
    # No API server: no address to bind (so no --allow-remote needed), no key, nothing to warn about.
    assert "--headless" in follower.argv and "--host" not in follower.argv and "--port" not in follower.argv
    assert "VLLM_API_KEY" not in follower.env and not follower.warnings
    assert "--worker-extension-cls" in follower.argv  # the same extension on every node
    single = server_command_line("m", on_gpu=False)
    assert "--nnodes" not in single.argv  # vLLM's own defaults for an engine on one node


@pytest.mark.parametrize(("node", "dp", "words"), [
    (NodePlacement(nnodes=2, node_rank=2, headless=True), 1, "--node-rank 2 is not below --nnodes 2"),
    (NodePlacement(nnodes=2, node_rank=1), 1, "--node-rank 1 needs --headless"),
    (NodePlacement(nnodes=2, headless=True), 1, "--headless is for nodes 1 and up"),
    (NodePlacement(nnodes=2), 2, "--nnodes with --data-parallel-size > 1"),
])
def test_placements_vllm_cannot_start_are_refused(node, dp, words):
    assert words in node_refusal(node, data_parallel_size=dp)
    with pytest.raises(UsageError, match=words.replace("+", r"\+")):
        server_command_line("m", tensor_parallel_size=2, data_parallel_size=dp, node=node, on_gpu=False)


def test_workers_that_do_not_split_over_the_nodes_are_refused():
    with pytest.raises(UsageError, match=r"--nnodes 2 must divide the engine's workers \(.* = 3\)"):
        server_command_line("m", tensor_parallel_size=3, node=NodePlacement(nnodes=2), on_gpu=False)
    assert node_refusal(NodePlacement(nnodes=2, node_rank=1, headless=True), data_parallel_size=1) is None


@pytest.mark.parametrize("arg", ["--node-rank", "--node_rank=1", "--nnodes", "-n2", "-r", "--headless",
                                 "--master-port=1", "--master-addr"])
def test_the_node_options_cannot_pass_through(arg):
    result = CliRunner().invoke(app, ["serve", "m", "--dry-run", "--", arg])
    assert result.exit_code == 2 and "cannot pass through to vLLM" in result.output


def test_serve_dry_run_for_each_node():
    common = ["serve", "m", "-tp", "2", "--nnodes", "2", "--master-port", "4123", "--dry-run"]
    leader = CliRunner().invoke(app, common)
    follower = CliRunner().invoke(app, [*common, "--node-rank", "1", "--headless"])
    assert leader.exit_code == 0 and follower.exit_code == 0, leader.output + follower.output
    assert "--node-rank 0 --master-addr 127.0.0.1 --master-port 4123 --enforce-eager" in leader.stdout
    assert "--node-rank 1 --master-addr 127.0.0.1 --master-port 4123 --headless" in follower.stdout
    # One worker on each node: one CPU list each (two would fail vLLM's assert).
    for shown in (leader.stdout, follower.stdout):
        assert "|" not in shown.split(f"{BIND}=")[1].split()[0]
    refused = CliRunner().invoke(app, [*common, "--node-rank", "1"])
    assert refused.exit_code == 2 and "--node-rank 1 needs --headless" in refused.output


# --- a headless node's watch on node 0 ------------------------------------------------------------------------


def _watch(answers: list[bool]):
    """A headless node's PeerWatch on node 0 whose probes answer ANSWERS in turn (then False); the reasons given."""
    gone: list[str] = []
    done = threading.Event()
    probes = iter(answers)

    def on_gone(reason: str) -> None:
        gone.append(reason)
        done.set()

    watch = PeerWatch("10.0.0.1", 4000, on_gone, describe=leader_gone("10.0.0.1", 4000), interval=0.001,
                      misses=3, probe=lambda host, port, timeout: next(probes, False))
    return watch, gone, done


def test_a_leader_that_stops_answering_is_reported_once_after_the_misses():
    watch, gone, done = _watch([False, False, True, False, False, True, False, False, False])
    watch.start()
    assert done.wait(10)
    # Refusals before the leader first answered are a leader not started yet; one answer resets the count.
    assert len(gone) == 1 and watch.reason == gone[0]
    assert gone[0].startswith("the engine's node 0 at 10.0.0.1:4000 stopped answering (3 connections refused")
    assert "\n" not in gone[0]


def test_a_leader_never_reached_is_not_reported_gone():
    watch, gone, _ = _watch([])  # every probe refused
    watch.start()
    time.sleep(0.2)  # hundreds of probes
    watch.stop()
    assert not gone and watch.reason is None and not watch.reached


def test_reachable_probes_a_real_socket():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert reachable("127.0.0.1", port, 2.0)
    assert not reachable("127.0.0.1", port, 2.0)  # closed: refused


@pytest.mark.parametrize(("args", "value"), [
    (["--master-addr", "10.0.0.2", "--x"], "10.0.0.2"),
    (["--master-addr=10.0.0.3"], "10.0.0.3"),
    (["--master-addr", "a", "--master-addr", "b"], "b"),
    (["--master-port", "1"], "127.0.0.1"),
])
def test_option_value_reads_what_argparse_reads(args, value):
    assert option_value(args, "--master-addr", "127.0.0.1") == value


def test_the_model_leads_a_headless_nodes_vllm_serve_arguments():
    assert model_first(["--model", "m", "--headless", "-tp", "2"]) == ["m", "--headless", "-tp", "2"]
    assert model_first(["--headless", "--model", "./a b"]) == ["./a b", "--headless"]
    assert model_first(["--headless"]) == ["--headless"]
