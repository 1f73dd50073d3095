"""The loop's two `layerwise serve` servers: started one after the other (each takes cores the other's worker does
not hold), killed and restarted, and their pause metrics read."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.server_support import SMALL, RunningServer

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# A restarted server must answer within this; how long it took is in the run's record (on a 2-core machine shared
# with other work, a start takes 30 s to minutes: a bound here would be a timed assertion).
RESTART_TIMEOUT_S = 600.0
START_TIMEOUT_S = 600.0


@contextlib.contextmanager
def cores_chosen_by_serve() -> Iterator[None]:
    """No `VLLM_CPU_OMP_THREADS_BIND` in this process's environment while servers start: `layerwise serve`
    chooses their cores (the test suite sets one per pytest worker)."""
    before = os.environ.pop(BIND_ENV, None)
    try:
        yield
    finally:
        if before is not None:
            os.environ[BIND_ENV] = before


class Fleet:
    """Two servers on MODEL, reading steps with ENV (the store's credentials)."""

    def __init__(self, model: Path, env: dict[str, str], extra: list[str] | None = None) -> None:
        # The CPU backend's layout, workers in processes of their own, as `layerwise serve` runs for users: it binds
        # each worker to cores the other's does not hold, and says which.
        self.servers = [RunningServer(model, env=env, extra=extra or SMALL, start_timeout=START_TIMEOUT_S,
                                      worker_process=True) for _ in range(2)]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self) -> Fleet:
        # One after the other: the second sees the first's worker and takes other cores.
        with cores_chosen_by_serve():
            for server in self.servers:
                server.start()
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.__exit__(None, None, None)

    def kill_and_restart(self, index: int) -> float:
        """SIGKILL server INDEX's process group and start it again; the seconds until it answered."""
        server = self.servers[index]
        server.kill()
        started = time.monotonic()
        server._start_timeout = RESTART_TIMEOUT_S
        with cores_chosen_by_serve():
            server.start()
        return time.monotonic() - started

    def start_lines(self, index: int) -> list[str]:
        """The `Serving ...` lines server INDEX printed (one per start), naming its CPU cores."""
        return self.servers[index].start_lines()


def weight_version(url: str) -> str | None:
    try:
        return httpx.get(f"{url}/weight_info", timeout=30).json()["weight_version"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


_TOTALS = ("layerwise_pause_seconds", "layerwise_pause_drain_seconds", "layerwise_engine_stall_seconds")
_SUM = re.compile(rf"^({'|'.join(_TOTALS)})_sum(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", re.M)


def pause_totals(url: str) -> tuple[float, float, float] | None:
    """The server's `layerwise_pause_seconds`, `layerwise_pause_drain_seconds` and
    `layerwise_engine_stall_seconds` histogram sums (every pause under a lease, and every reload's hold on the
    engine core, since it started); None when it does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    sums = {name: float(value) for name, value in _SUM.findall(text)}
    return tuple(sums.get(name, 0.0) for name in _TOTALS)


class PauseMeter:
    """Per (server, step): how much the server's pause, drain and engine-stall histograms grew for that step's
    reload."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, ...]] = {}
        self.pauses: dict[tuple[str, int], float] = {}
        self.drains: dict[tuple[str, int], float] = {}
        self.stalls: dict[tuple[str, int], float] = {}

    def reloaded(self, url: str, step: int) -> None:
        totals = pause_totals(url)
        if totals is None:
            return
        before = self.last.get(url, (0.0,) * len(_TOTALS))
        # A restarted server starts its histograms again.
        grew = [now - then if now >= then else now for now, then in zip(totals, before)]
        self.pauses[(url, step)], self.drains[(url, step)], self.stalls[(url, step)] = grew
        self.last[url] = totals

    def restarted(self, url: str, fleet_total: bool = False) -> None:
        """URL (re)started: its histograms count from 0 (FLEET_TOTAL: from what they hold now, at a run's start)."""
        zero = (0.0,) * len(_TOTALS)
        self.last[url] = (pause_totals(url) or zero) if fleet_total else zero
