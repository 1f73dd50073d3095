"""One engine across two node processes on loopback: `layerwise serve --nnodes 2`, node 1 headless.

Each node runs in a working directory of its own (its disk: a relative
SOURCE resolves there) and is bound to a core of its own. Node 1 serves no
HTTP: it is started first and not polled; node 0 is healthy once both
nodes' workers joined.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.support.server_support import SMALL, RunningServer, free_port, own_core


class HeadlessNode(RunningServer):
    """`layerwise serve --headless`: started, never polled (it has no API server); `exited` waits for its end."""

    def start(self) -> HeadlessNode:
        argv, env = self.command()
        self._proc = subprocess.Popen(argv, env=env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        return self

    def exited(self, within: float) -> int | None:
        """Its exit code once it has ended, waiting up to WITHIN seconds (None: still running then)."""
        assert self._proc is not None
        try:
            return self._proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            return None

    def processes(self) -> list[int]:
        """Its process group's live processes (itself and its workers)."""
        return self._group()


def node_options(rank: int, master_port: int, tp: int = 2) -> list[str]:
    """`layerwise serve`'s options for node RANK of 2 (TP=TP over both), its small engine settings included."""
    headless = ["--headless"] if rank else []
    return ["--tensor-parallel-size", str(tp), "--nnodes", "2", "--node-rank", str(rank), "--master-addr",
            "127.0.0.1", "--master-port", str(master_port), *headless, *SMALL]


def two_nodes(model: Path | str, disks: tuple[Path, Path]) -> tuple[RunningServer, HeadlessNode]:
    """Node 0 (API server) and node 1 (headless), not started; node I runs in DISKS[I], on core I."""
    master_port = free_port()
    leader = RunningServer(model, cwd=disks[0], env=own_core(0), extra=node_options(0, master_port),
                           start_timeout=600)
    follower = HeadlessNode(model, cwd=disks[1], env=own_core(1), extra=node_options(1, master_port))
    return leader, follower


def start_nodes(leader: RunningServer, follower: HeadlessNode) -> None:
    """Start node 1, then node 0, and wait until node 0 serves (both nodes' workers joined)."""
    follower.start()
    try:
        leader.start()
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n--- node 1's log:\n{follower.log_tail()}") from None


def wait_for_port(port: int, within: float) -> bool:
    """Whether something listens on loopback PORT within WITHIN seconds."""
    from layerwise_cli.server.leader_watch import reachable

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if reachable("127.0.0.1", port, 1.0):
            return True
        time.sleep(0.5)
    return False
