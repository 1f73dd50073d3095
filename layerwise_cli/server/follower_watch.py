"""Node 0's watch on the engine's other nodes: a node that is gone ends the engine, naming it, instead of a hang.

In vLLM 0.32's multiprocessing executor on node 0 (in the engine core
process), each worker of another node answers a collective call over a ZMQ
socket that worker binds on its own node. The executor reads those answers
with no timeout (a reload, a verify) and watches only its own node's worker
processes. A node killed during a reload left node 0 waiting for ever: the
reload never answered, the engine core ignored SIGTERM (its busy loop never
came back to see it), and `/health` said 200.

Here, once the executor of node 0 is up (its answer sockets connected), a
`PeerWatch` per other node probes the socket of that node's first worker.
When one stops answering:

1. this process says so in one line (`Error: node 1 of this engine (rank 1) at A:P stopped answering ...`);
2. the executor is marked failed and shut down, as vLLM does when a worker of its own node dies (its local
   workers end; a read from one of them stops);
3. a read from another node's worker in progress stops with that line (it is read in slices of
   `SLICE_S` seconds, the deadline a caller gave kept), so the collective call in flight fails with it:
   a reload over HTTP fails naming the node;
4. vLLM's failure callback runs: the engine core ends, and node 0's server with it (vLLM's watchdog stops a
   server whose engine died; `layerwise serve` then exits 1, told by the note `NODE_LOST_NOTE_ENV` names).
   A new engine needs every node restarted.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from layerwise_cli import vllm_compat
from layerwise_cli.server.peer_watch import PeerWatch

# How long one read of another node's answer waits before it checks whether that node was lost.
SLICE_S = 1.0
# A file `layerwise serve` names for its engine processes: the engine core writes the reason there when a node is
# lost, and the server, whose vLLM exits 0 once its engine died, exits 1 instead.
NODE_LOST_NOTE_ENV = "LAYERWISE_NODE_LOST_NOTE"


@dataclass
class Follower:
    """Another node of the engine, as node 0's executor reaches it.

    Attributes:
        node: its node rank.
        ranks: the global ranks of its workers.
        host: the address its first worker answers on.
        port: that worker's answer socket.
    """

    node: int
    ranks: list[int] = field(default_factory=list)
    host: str = ""
    port: int = 0

    def gone(self, seen: str) -> str:
        """Why the engine ends: this node stopped answering, from what the watch SEEN."""
        ranks = ", ".join(map(str, self.ranks))
        return (f"node {self.node} of this engine (rank{'s' if len(self.ranks) > 1 else ''} {ranks}) at "
                f"{self.host}:{self.port} stopped answering ({seen}): the engine cannot run without it and stops; "
                "restart every node to start it again")


@dataclass
class NodeLost:
    """Why the engine ends (None while every node answers); the first node lost wins."""

    reason: str | None = None


def socket_address(address: str) -> tuple[str, int]:
    """(host, port) of a ZMQ TCP endpoint (`tcp://10.0.0.2:4321`, `tcp://[::1]:4321`)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def followers_of(executor) -> list[Follower]:
    """The other nodes of the engine whose node 0 runs EXECUTOR (empty: one node, or not node 0)."""
    local, world = executor.local_world_size, executor.world_size
    if getattr(executor, "rpc_broadcast_mq", None) is None or world <= local:
        return []
    nodes: dict[int, Follower] = {}
    for rank in range(local, world):
        follower = nodes.setdefault(rank // local, Follower(node=rank // local))
        follower.ranks.append(rank)
        if not follower.host:
            follower.host, follower.port = socket_address(executor.response_mqs[rank].handle.remote_subscribe_addr)
    return list(nodes.values())


def read_until_lost(dequeue: Callable, lost: NodeLost) -> Callable:
    """DEQUEUE (a remote answer queue's) read in slices, raising the loss's reason once a node is lost.

    A slice that times out has read nothing (vLLM polls the socket before it
    receives), so the next slice reads the same answer.
    """

    def dequeue_until_lost(timeout: float | None = None, indefinite: bool = False):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if lost.reason is not None:
                raise RuntimeError(lost.reason)
            left = SLICE_S if deadline is None else max(0.0, min(SLICE_S, deadline - time.monotonic()))
            try:
                return dequeue(timeout=left, indefinite=indefinite)
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    return dequeue_until_lost


def failing_with_the_loss(collective_rpc: Callable, lost: NodeLost) -> Callable:
    """COLLECTIVE_RPC whose failure, once a node is lost, says which node (not vLLM's `cancelled`)."""

    def collective_rpc_naming_the_node(*args, **kwargs):
        try:
            return collective_rpc(*args, **kwargs)
        except Exception as exc:
            if lost.reason is not None:
                raise RuntimeError(lost.reason) from exc
            raise

    return collective_rpc_naming_the_node


def end_engine(executor, lost: NodeLost, reason: str) -> None:
    """Node REASON's loss ends the engine: said once, the executor failed and shut down, vLLM told."""
    if lost.reason is not None:
        return
    lost.reason = reason
    sys.stderr.write(f"Error: {reason}\n")
    sys.stderr.flush()
    note = os.environ.get(NODE_LOST_NOTE_ENV)
    if note:
        with open(note, "w", encoding="utf-8") as out:
            out.write(reason)
    executor.is_failed = True
    executor.shutdown()  # this node's workers end; a read from one of them stops
    callback, executor.failure_callback = executor.failure_callback, None
    if callback is not None:
        callback()  # the engine core's busy loop raises and ends the engine


def watch_followers(executor) -> list[PeerWatch]:
    """Watch every other node of EXECUTOR's engine from node 0 (nothing elsewhere); the watches started."""
    followers = followers_of(executor)
    if not followers:
        return []
    lost = NodeLost()
    for rank in range(executor.local_world_size, executor.world_size):
        queue = executor.response_mqs[rank]
        queue.dequeue = read_until_lost(queue.dequeue, lost)
    executor.collective_rpc = failing_with_the_loss(executor.collective_rpc, lost)
    return [PeerWatch(f.host, f.port, lambda reason: end_engine(executor, lost, reason), describe=f.gone).start()
            for f in followers]


def install() -> None:
    """Watch the other nodes from every multiprocessing executor this process builds (idempotent)."""
    vllm_compat.after_executor_ready(watch_followers)
