"""Node 0's watch on the other nodes of its engine (`server/follower_watch.py`), against stand-ins for vLLM's executor.

The stand-ins have the attributes the watch reads on vLLM's `MultiprocExecutor` and `MessageQueue`
(`vllm_symbols.MULTIPROC_EXECUTOR`, `MESSAGE_QUEUE`); tests/test_nodes_pp_server.py runs the watch in a real engine.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from layerwise_cli import vllm_compat
from layerwise_cli.server import follower_watch
from layerwise_cli.server.follower_watch import (
    Follower,
    NodeLost,
    end_engine,
    failing_with_the_loss,
    followers_of,
    read_until_lost,
    socket_address,
)
from layerwise_cli.worker.reload.hold_point import HOLD_ENV, hold_if_armed


def _queue(address: str | None) -> SimpleNamespace:
    return SimpleNamespace(handle=SimpleNamespace(remote_subscribe_addr=address), dequeue=None)


class FakeExecutor:
    """What the watch reads and calls on node 0's executor: WORLD ranks, LOCAL on each node, rank r's answer queue."""

    def __init__(self, world: int, local: int, *, leader: bool = True) -> None:
        self.world_size, self.local_world_size = world, local
        self.rpc_broadcast_mq = object() if leader else None
        self.response_mqs = [_queue(None if rank < local else f"tcp://10.0.0.{rank // local}:{5000 + rank}")
                             for rank in range(world)]
        self.is_failed = False
        self.shutdowns = 0
        self.callbacks = 0
        self.failure_callback = self._callback

    def _callback(self) -> None:
        self.callbacks += 1

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.mark.parametrize(("address", "expected"), [
    ("tcp://10.0.0.2:4321", ("10.0.0.2", 4321)),
    ("tcp://[::1]:4321", ("::1", 4321)),
    ("tcp://node1.example:80", ("node1.example", 80)),
])
def test_socket_address(address, expected):
    assert socket_address(address) == expected


def test_the_followers_are_the_other_nodes_each_reached_at_its_first_workers_socket():
    # Four ranks, two per node: node 1 runs ranks 2 and 3 and is reached where rank 2 answers.
    followers = followers_of(FakeExecutor(world=4, local=2))
    assert [(f.node, f.ranks, f.host, f.port) for f in followers] == [(1, [2, 3], "10.0.0.1", 5002)]
    three = followers_of(FakeExecutor(world=3, local=1))
    assert [(f.node, f.ranks, f.port) for f in three] == [(1, [1], 5001), (2, [2], 5002)]


def test_no_followers_on_one_node_or_on_a_headless_node():
    assert followers_of(FakeExecutor(world=2, local=2)) == []
    assert followers_of(FakeExecutor(world=2, local=1, leader=False)) == []


def test_the_reason_names_the_node_its_ranks_and_its_address_in_one_line():
    reason = Follower(node=1, ranks=[2, 3], host="10.0.0.1", port=5002).gone("3 connections refused")
    assert reason.startswith("node 1 of this engine (ranks 2, 3) at 10.0.0.1:5002 stopped answering (3 connections")
    assert "restart every node" in reason and "\n" not in reason
    assert "(rank 1)" in Follower(node=1, ranks=[1], host="h", port=1).gone("x")


def test_a_remote_read_waits_in_slices_and_keeps_the_answer_that_comes(monkeypatch):
    monkeypatch.setattr(follower_watch, "SLICE_S", 0.01)
    asked: list[float | None] = []
    answers = iter([TimeoutError(), TimeoutError(), "answer"])

    def dequeue(timeout=None, indefinite=False):
        asked.append(timeout)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert read_until_lost(dequeue, NodeLost())() == "answer"
    assert asked == [0.01, 0.01, 0.01]  # no deadline given: slices until it comes


def test_a_remote_read_keeps_the_callers_deadline(monkeypatch):
    monkeypatch.setattr(follower_watch, "SLICE_S", 0.01)

    def never(timeout=None, indefinite=False):
        raise TimeoutError

    with pytest.raises(TimeoutError):
        read_until_lost(never, NodeLost())(timeout=0.05)


def test_a_remote_read_stops_with_the_reason_once_a_node_is_lost(monkeypatch):
    monkeypatch.setattr(follower_watch, "SLICE_S", 0.01)
    lost = NodeLost()
    slices = []

    def waiting(timeout=None, indefinite=False):
        slices.append(timeout)
        if len(slices) == 3:
            lost.reason = "node 1 of this engine (rank 1) at h:1 stopped answering"
        raise TimeoutError

    with pytest.raises(RuntimeError, match=r"^node 1 of this engine \(rank 1\)"):
        read_until_lost(waiting, lost)()
    assert len(slices) == 3


def test_a_collective_call_fails_naming_the_lost_node_not_vllms_cancelled():
    lost = NodeLost()

    def cancelled(*args, **kwargs):
        raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError, match=r"^cancelled$"):  # no node lost: vLLM's own error
        failing_with_the_loss(cancelled, lost)("m")
    lost.reason = "node 1 of this engine (rank 1) at h:1 stopped answering"
    with pytest.raises(RuntimeError, match=r"^node 1 of this engine"):
        failing_with_the_loss(cancelled, lost)("m")
    assert failing_with_the_loss(lambda *a, **k: [1, 2], lost)("m") == [1, 2]


def test_a_lost_node_ends_the_engine_once(capsys):
    executor, lost = FakeExecutor(world=2, local=1), NodeLost()
    end_engine(executor, lost, "node 1 of this engine (rank 1) at h:1 stopped answering")
    end_engine(executor, lost, "node 2 ...")  # a second node lost at the same time: nothing more
    assert lost.reason.startswith("node 1") and executor.is_failed
    assert executor.shutdowns == 1 and executor.callbacks == 1 and executor.failure_callback is None
    assert capsys.readouterr().err == "Error: node 1 of this engine (rank 1) at h:1 stopped answering\n"


def test_watch_followers_wraps_the_remote_queues_and_the_call_and_watches_each_node(monkeypatch):
    started: list[tuple[str, int]] = []

    class Watch:
        def __init__(self, host, port, on_gone, *, describe):
            self.host, self.port, self.on_gone, self.describe = host, port, on_gone, describe

        def start(self):
            started.append((self.host, self.port))
            return self

    monkeypatch.setattr(follower_watch, "PeerWatch", Watch)
    executor = FakeExecutor(world=2, local=1)
    executor.collective_rpc = lambda *a, **k: "vllm's"
    local_dequeue = executor.response_mqs[0].dequeue
    watches = follower_watch.watch_followers(executor)
    assert started == [("10.0.0.1", 5001)]
    assert executor.response_mqs[0].dequeue is local_dequeue  # this node's worker: vLLM's own read
    assert executor.response_mqs[1].dequeue.__name__ == "dequeue_until_lost"
    assert executor.collective_rpc() == "vllm's"
    done = threading.Event()
    executor.failure_callback = done.set
    watches[0].on_gone(watches[0].describe("3 connections refused"))
    assert done.is_set() and executor.is_failed
    with pytest.raises(RuntimeError, match=r"^node 1 of this engine \(rank 1\) at 10\.0\.0\.1:5001"):
        executor.response_mqs[1].dequeue()


def test_watch_followers_leaves_an_engine_on_one_node_alone():
    executor = FakeExecutor(world=2, local=2)
    executor.collective_rpc = rpc = object()
    assert follower_watch.watch_followers(executor) == []
    assert executor.collective_rpc is rpc


def test_after_executor_ready_runs_the_hook_after_vllms_own_once_per_hook(monkeypatch):
    calls: list[str] = []

    class Executor:
        def _post_init_executor(self) -> None:
            calls.append("vllm")

    monkeypatch.setattr(vllm_compat, "_load", lambda symbol: Executor)
    hook = lambda executor: calls.append("hook")  # noqa: E731
    vllm_compat.after_executor_ready(hook)
    vllm_compat.after_executor_ready(hook)  # a plugin loaded twice: still once
    Executor()._post_init_executor()
    assert calls == ["vllm", "hook"]


def test_a_call_in_flight_is_answered_503_once_the_engine_died():
    from fastapi import HTTPException  # noqa: PLC0415 - fastapi: heavy (test collection stays fast)

    from layerwise_cli.server.engines_rpc import until_engine_dies  # noqa: PLC0415 - fastapi: heavy (test collection stays fast)

    engine = SimpleNamespace(errored=False)

    async def answered():
        return [[{"ok": True}]]

    async def never_answered():
        await asyncio.Event().wait()

    async def run():
        assert await until_engine_dies(answered(), engine, "m", poll_s=0.01) == [[{"ok": True}]]
        engine.errored = True
        with pytest.raises(HTTPException) as caught:
            await until_engine_dies(never_answered(), engine, "layerwise_reload", poll_s=0.01)
        return caught.value

    refused = asyncio.run(run())
    assert refused.status_code == 503 and "the engine died during layerwise_reload" in refused.detail


def test_the_hold_point_waits_only_when_armed(tmp_path, monkeypatch):
    monkeypatch.delenv(HOLD_ENV, raising=False)
    hold_if_armed()  # unset: returns
    monkeypatch.setenv(HOLD_ENV, str(tmp_path))
    hold_if_armed()  # not armed: returns
    assert not (tmp_path / "held").exists()
    (tmp_path / "armed").touch()
    holding = threading.Thread(target=hold_if_armed)
    holding.start()
    holding.join(0.3)
    assert holding.is_alive() and (tmp_path / "held").exists()  # it waits while armed
    (tmp_path / "armed").unlink()
    holding.join(10)
    assert not holding.is_alive()
