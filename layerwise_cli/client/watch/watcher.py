"""The watch loop: poll the root, pick the newest complete step, bring every target to it, report events.

The root is a `step_source.StepSource`: a local directory of step directories or a URL prefix of step folders in
object storage (`listed_steps.ListedSteps`: found by listing, each store step pinned to its objects' ETags), or a
Hub repo whose ref's commits are the steps (`hub_source.HubStepSource`). The loop never asks which.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from layerwise_cli.checkpoint.sources import looks_like_repo_id
from layerwise_cli.checkpoint.steps.hub_run import is_hub_run
from layerwise_cli.client.servers.api import HOLDS_PREVIOUS
from layerwise_cli.client.servers.fleet import all_or_nothing
from layerwise_cli.client.watch import events as ev
from layerwise_cli.client.watch.events import WatchEvent
from layerwise_cli.client.watch.hub_source import HubStepSource
from layerwise_cli.client.watch.hub_steps import refuse_folder_options
from layerwise_cli.client.watch.listed_steps import ListedSteps
from layerwise_cli.client.watch.options import WatchOptions
from layerwise_cli.client.watch.state import ServerState, WatchState
from layerwise_cli.client.watch.step_source import Step, StepSource
from layerwise_cli.client.watch.targets import Outcome, Target, TargetDown, call_caught, error_line, reload_together
from layerwise_cli.errors import UsageError

# Backoff for a server that does not answer: 0.5 s, 1 s, 2 s, ... up to this.
_BACKOFF_MAX_S = 10.0
# With --once, a server that failed this many times in a row is given up (and a Hub ref polled in vain).
_ONCE_TRIES = 3


def open_step_source(root: str | Path, options: WatchOptions, *, clock: Callable[[], float] = time.monotonic
                     ) -> StepSource:
    """ROOT's steps: a Hub repo's ref when ROOT is no local path but looks like `org/name`; else a local
    directory, or a URL prefix (`s3://bucket/run/`) whose step folders are found by listing.

    Raises:
        UsageError: an option that does not apply to that kind of root (`refuse_folder_options`), or a poll
            interval that is not positive, or a negative settle time.
    """
    hub = looks_like_repo_id(str(root))
    refuse_folder_options(str(root) if hub else None, options, hub_run=is_hub_run(str(root)))
    if (options.interval is not None and options.interval <= 0) or options.settle < 0:
        raise UsageError("--interval must be positive and --settle not negative")
    if hub:
        return HubStepSource(str(root), options, clock=clock, backoff_max_s=_BACKOFF_MAX_S)
    return ListedSteps(root, options, clock)


class Watcher:
    """The watch loop. Iterate `run()` for events; call `stop()` (also from a signal handler) to end it.

    One thread owns all state; reloads and probes of servers run in a pool
    (one thread per server), so a slow or dead server holds back no other.
    """

    def __init__(self, root: str | Path, targets: list[Target], options: WatchOptions | None = None, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.options = options or WatchOptions()
        if not targets:
            raise UsageError("nothing to watch for: give at least one --url (or an engine)")
        names = [t.name for t in targets]
        if len(set(names)) != len(names):
            raise UsageError("the same server URL is given twice")
        if self.options.keep is not None and self.options.keep < 1:
            raise UsageError(f"--keep must be at least 1, not {self.options.keep}")
        self.source = open_step_source(root, self.options, clock=clock)
        self.where = self.source.where
        self.interval = self.source.interval
        self._servers = {t.name: ServerState(t) for t in targets}
        self._clock = clock
        self._wall = wall
        self._stopping = False
        self._results: queue.Queue = queue.Queue()
        self._skipped: set[str] = set()
        self._broken: dict[str, str] = {}
        self._target: Step | None = None
        # The target before the current one: servers fall back to it when the current one is broken.
        self._fallback: Step | None = None
        self._floor = -1
        self._pending: list[WatchEvent] = []
        self._settling = False
        # The target was dropped since the last poll: --once must look again before it gives up.
        self._repoll = False
        self.state = WatchState()
        # Set when --once ends: None (all hold the newest step) or why not.
        self.failure: str | None = None

    def stop(self) -> None:
        """Ask the loop to end: it starts nothing new, lets running reloads finish (servers resumed), returns."""
        self._stopping = True

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> Iterator[WatchEvent]:
        """Watch until `stop()` (or, with `once`, until every server holds the newest complete step)."""
        self.source.open()  # a missing root (or bucket, or wrong credentials) fails now, with its name
        threaded = [s for s in self._servers.values() if s.target.threaded]
        pool = ThreadPoolExecutor(max_workers=max(1, len(threaded)), thread_name_prefix="layerwise-watch")
        try:
            while not self._stopping:
                poll_at = self._clock()
                self._poll()
                self._schedule(pool)
                yield from self._drain()
                if self.options.once and self._once_finished():
                    break
                yield from self._wait(poll_at + self.interval)
        except BaseException:
            self._finish(pool)  # closed early, interrupted or failed: no more yields, but no paused server
            raise
        self._finish(pool)
        yield from self._drain()

    def _finish(self, pool: ThreadPoolExecutor) -> None:
        # Never leave a server paused: reload_server resumes in its own `finally`; wait for it to get there.
        self._stopping = True
        while any(s.busy for s in self._servers.values()):
            try:
                self._handle(*self._results.get(timeout=1.0))
            except queue.Empty:
                continue
        pool.shutdown(wait=True)

    def _wait(self, until: float) -> Iterator[WatchEvent]:
        # Blocks on the results queue, not a sleep: a finished reload is handled at once. The short
        # slices only let a signal handler's stop() be seen within 0.2 s.
        while not self._stopping:
            left = until - self._clock()
            if left <= 0:
                return
            try:
                item = self._results.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            self._handle(*item)
            yield from self._drain()
            # A server just became idle: give it work without waiting for the next poll.
            return

    def _drain(self) -> Iterator[WatchEvent]:
        while self._pending:
            yield self._pending.pop(0)

    def _emit(self, kind: str, **fields) -> None:
        self._pending.append(WatchEvent(kind, self._wall(), **fields))

    # --- steps -------------------------------------------------------------------------------

    def _poll(self) -> None:
        self._repoll = False
        polled = self.source.poll(self._target, self._floor, self._broken)
        for kind, fields in polled.events:
            self._emit(kind, **fields)
        if polled.newest_seen is not None:
            self.state.newest_seen = polled.newest_seen
        if polled.target_gone:
            # Deleted before every server got it: wait for a newer one, never go back to an older one.
            self._target = None
            self.state.target = None
        self._settling = polled.settling
        if polled.target is not None:
            self._set_target(polled.target, polled.passed_over)

    def _set_target(self, step: Step, passed_over: list[Step]) -> None:
        floor = self._floor
        self._fallback = self._target
        self._target = step
        self._floor = step.number
        self.state.target = step.name
        self._emit(ev.STEP_COMPLETE, step=step.name)
        for other in passed_over:
            if other.name not in self._skipped and other.name not in self._broken:
                self._skipped.add(other.name)
                if floor >= 0:  # on start, older steps are history, not news
                    self._emit(ev.STEP_SKIPPED, step=other.name, message=f"passed over: {step.name} is newer")

    # --- servers -----------------------------------------------------------------------------

    def _schedule(self, pool: ThreadPoolExecutor) -> None:
        now = self._clock()
        together = self._together()
        waiting: list[ServerState] = []  # the servers to bring to the target together (--atomic)
        target = self._target
        if target is not None and target.name in self._broken:
            target = None
        for server in self._servers.values():
            if server.busy or self._stopping:
                continue
            if self.options.once and server.failures >= _ONCE_TRIES:
                continue
            wants = server.seen and server.up and target is not None and (server.dirty or server.version != target.name)
            if wants and together and server.target.threaded:
                waiting.append(server)
            elif now < server.next_try:
                continue
            elif wants:
                self._start(pool, server, "reload", target)
            elif now >= server.next_probe:
                # Once per interval: a server restarted on its base weights is found by its weight version.
                server.next_probe = now + self.interval
                self._start(pool, server, "probe", None)
        # Together: once no server is busy (a probe may find one down) and none is waiting out a backoff.
        if waiting and target is not None and not any(s.busy for s in self._servers.values()) \
                and all(now >= s.next_try for s in waiting):
            self._start_together(pool, waiting, target)

    def _together(self) -> bool:
        return all_or_nothing(self.options.atomic, sum(1 for s in self._servers.values() if s.target.threaded))

    def _start(self, pool: ThreadPoolExecutor, server: ServerState, job: str, step: Step | None) -> None:
        if job == "reload":
            assert step is not None
            server.busy = step.name
            self._emit(ev.RELOAD_STARTED, step=step.name, server=server.target.name)
            run = lambda: server.target.reload(step.source, step.name, step.revision)  # noqa: E731
        else:
            server.busy = "probe"
            run = server.target.weight_version
        if not server.target.threaded:
            self._handle(server.target.name, job, step, call_caught(run))
            return
        future = pool.submit(call_caught, run)
        future.add_done_callback(lambda f: self._results.put((server.target.name, job, step, f.result())))

    def _start_together(self, pool: ThreadPoolExecutor, servers: list[ServerState], step: Step) -> None:
        """One all-or-nothing reload of SERVERS to STEP (`reload_together`); each server's outcome comes back alone."""
        for server in servers:
            server.busy = step.name
            self._emit(ev.RELOAD_STARTED, step=step.name, server=server.target.name)
        names = [server.target.name for server in servers]
        targets = [server.target for server in servers]

        def done(future) -> None:
            ok, value = future.result()
            for name in names:
                self._results.put((name, "reload", step, (True, value[name]) if ok else (False, value)))

        run = lambda: reload_together(targets, step.source, step.name, step.revision)  # noqa: E731
        pool.submit(call_caught, run).add_done_callback(done)

    def _handle(self, name: str, job: str, step: Step | None, result: tuple[bool, object]) -> None:
        server = self._servers[name]
        server.busy = None
        ok, value = result
        if job == "probe":
            if not ok:
                self._down(server, value)
                return
            self._up(server, value)
            server.version = value
            server.last_version = value
        else:
            assert step is not None
            outcome: Outcome = value if ok else Outcome(ok=False, holds="unknown", error=str(value), reached=False)
            self._reloaded(server, step, outcome)
        self._refresh_state()
        if not self._stopping:
            for kind, fields in self.source.delete_old(self._target, self._servers.values()):
                self._emit(kind, **fields)

    def _up(self, server: ServerState, version) -> None:
        if server.up is False:
            self._emit(ev.SERVER_BACK, server=server.target.name, version=version)
        elif not server.seen:
            self._emit(ev.SERVER_SEEN, server=server.target.name, version=version)
        server.seen = True
        server.up = True
        server.failures = 0
        server.next_try = 0.0

    def _down(self, server: ServerState, error) -> None:
        message = str(error) if isinstance(error, TargetDown) else error_line(error)
        if server.up is not False:
            self._emit(ev.SERVER_DOWN, server=server.target.name, message=message)
        server.up = False
        server.version = None
        server.error = message
        server.failures += 1
        server.next_try = self._clock() + min(_BACKOFF_MAX_S, 0.5 * 2 ** (server.failures - 1))

    def _reloaded(self, server: ServerState, step: Step, outcome: Outcome) -> None:
        name = server.target.name
        if outcome.ok:
            server.version = server.last_version = step.name
            server.dirty = False
            server.failures = 0
            server.wall_s, server.peak_bytes, server.error = outcome.wall_s, outcome.peak_bytes, None
            self._emit(ev.RELOAD_DONE, step=step.name, server=name, version=step.name, wall_s=outcome.wall_s,
                       peak_bytes=outcome.peak_bytes, paused_s=outcome.paused_s, report=outcome.report,
                       message=ev.off_chain(outcome.report))
            return
        server.error = outcome.error
        server.dirty = outcome.holds != HOLDS_PREVIOUS
        server.version = outcome.version if outcome.holds == HOLDS_PREVIOUS else None
        # Not the step's fault when it is gone (deleted, vanished from the Hub), or the Hub did not say.
        excuse, vanished = step.excuse() if step.name not in self._broken else (None, False)
        message = outcome.error or "failed"
        if excuse is not None:
            message = f"{message}; {excuse}"
        elif not outcome.reached:
            message = f"{message}; the server did not answer"
        self._emit(ev.RELOAD_FAILED, step=step.name, server=name, version=server.version, message=message,
                   report=outcome.report)
        if not outcome.reached:
            self._down(server, outcome.error)
            return
        # Whatever failed, this server waits before its next try: never a tight loop of failing reloads.
        server.failures += 1
        server.next_try = self._clock() + min(_BACKOFF_MAX_S, 0.5 * 2 ** (server.failures - 1))
        if vanished:
            self._give_up(step, message, f"vanished: {excuse}")
            return
        if excuse is not None or not outcome.failed_in_reload or step.name in self._broken:
            return  # not the step's fault (gone, or the server refused before loading), or already reported
        self._give_up(step, message, f"broken: {message}")

    def _give_up(self, step: Step, message: str, why: str) -> None:
        """STEP is never tried again (reported once): servers go back to the target before it."""
        self._broken[step.name] = message
        self._emit(ev.STEP_SKIPPED, step=step.name, message=why)
        if self._target is not None and self._target.name == step.name:
            # Back to the step before it; the next poll still takes any valid step newer than that.
            fallback = self._fallback
            if fallback is not None and fallback.name in self._broken:
                fallback = None
            self._target = fallback
            self._floor = fallback.number if fallback is not None else -1
            self.state.target = fallback.name if fallback is not None else None
            self._repoll = True

    def _once_finished(self) -> bool:
        servers = list(self._servers.values())
        if self._repoll or any(s.busy for s in servers):
            return False
        target = self._target
        if target is not None and all(s.version == target.name and not s.dirty for s in servers):
            return True
        given_up = [s for s in servers if s.failures >= _ONCE_TRIES]
        if given_up:
            self.failure = "; ".join(f"{s.target.name}: {s.error or 'failed'}" for s in given_up)
            return True
        if target is None and all(s.seen or s.failures for s in servers):
            self.failure = self.source.once_failure(self._broken, tries=_ONCE_TRIES, settling=self._settling)
            return self.failure is not None
        return False

    def _refresh_state(self) -> None:
        self.state.show(self._servers)
