"""One engine across two node processes on loopback: `layerwise serve --nnodes 2`, node 1 headless.

Each node runs in a working directory of its own (its disk: a relative
SOURCE resolves there) and is bound to a core of its own. Node 1 serves no
HTTP: it is started first and not polled; node 0 is healthy once both
nodes' workers joined.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from layerwise_cli.server.peer_watch import reachable
from tests.support.server_support import SMALL, RunningServer, free_port, own_core


class HeadlessNode(RunningServer):
    """`layerwise serve --headless`: started, never polled (it has no API server); `exited` waits for its end."""

    def start(self) -> HeadlessNode:
        argv, env = self.command()
        self._proc = subprocess.Popen(argv, env=env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                      process_group=0)  # as RunningServer: a group of its own, the run's session
        return self

    def exited(self, within: float) -> int | None:
        """Its exit code once it has ended, waiting up to WITHIN seconds (None: still running then)."""
        return ended(self, within)

    def processes(self) -> list[int]:
        """Its process group's live processes (itself and its workers)."""
        return group_processes(self)


def node_options(rank: int, master_port: int, tp: int = 2, pp: int = 1) -> list[str]:
    """`layerwise serve`'s options for node RANK of 2 (TP x PP over both), its small engine settings included."""
    headless = ["--headless"] if rank else []
    pipeline = ["--pipeline-parallel-size", str(pp)] if pp > 1 else []
    return ["--tensor-parallel-size", str(tp), *pipeline, "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(master_port), *headless, *SMALL]


def two_nodes(model: Path | str, disks: tuple[Path, Path], *, tp: int = 2, pp: int = 1,
              node_0_env: dict[str, str] | None = None,
              node_1_env: dict[str, str] | None = None) -> tuple[RunningServer, HeadlessNode]:
    """Node 0 (API server) and node 1 (headless), not started; node I runs in DISKS[I], on core I.

    NODE_0_ENV, NODE_1_ENV: more environment for node 0 and node 1 (their workers inherit it).
    """
    master_port = free_port()
    leader = RunningServer(model, cwd=disks[0], env={**own_core(0), **(node_0_env or {})},
                           extra=node_options(0, master_port, tp, pp), start_timeout=600)
    follower = HeadlessNode(model, cwd=disks[1], env={**own_core(1), **(node_1_env or {})},
                            extra=node_options(1, master_port, tp, pp))
    return leader, follower


def start_nodes(leader: RunningServer, follower: HeadlessNode) -> None:
    """Start node 1, then node 0, and wait until node 0 serves (both nodes' workers joined)."""
    follower.start()
    try:
        leader.start()
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n--- node 1's log:\n{follower.log_tail()}") from None


def start_together(*starts: Callable[[], object]) -> None:
    """Run each of STARTS in a thread of its own (engines start side by side); raise the first failure."""
    errors: list[BaseException] = []

    def run(start: Callable[[], object]) -> None:
        try:
            start()
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(start,)) for start in starts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def ended(server: RunningServer, within: float) -> int | None:
    """SERVER's exit code once it has ended, waiting up to WITHIN seconds (None: still running then)."""
    try:
        return server._proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        return None


def group_processes(server: RunningServer) -> list[int]:
    """SERVER's process group's live processes (itself, its engine core and its workers)."""
    return server._group()


def wait_for_port(port: int, within: float) -> bool:
    """Whether something listens on loopback PORT within WITHIN seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if reachable("127.0.0.1", port, 1.0):
            return True
        time.sleep(0.5)
    return False
