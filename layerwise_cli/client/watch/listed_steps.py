"""`watch` on a listed root: a local directory of step directories, or step folders under a URL prefix.

The root is listed afresh at every poll (`checkpoint/steps/local.py`'s `list_steps`, or `checkpoint/steps/store.py`'s
`list_store_steps`: one listing of the store, every page, each step pinned to its objects' ETags). A step is
loaded once it is complete (its marker, or settled); `--keep` deletes old ones. A Hub repo's commits are
`hub_source.py`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from layerwise_cli.checkpoint.steps.hub_run import is_hub_run, list_hub_run_steps
from layerwise_cli.checkpoint.steps.local import AUTO, COMPLETE, SETTLING, CompletenessTracker, StepDir, list_steps
from layerwise_cli.checkpoint.steps.store import StoreStep, list_store_steps
from layerwise_cli.checkpoint.store.objects import display_url, is_store_url
from layerwise_cli.client.watch import events as ev
from layerwise_cli.client.watch.keep import OldSteps
from layerwise_cli.client.watch.options import WatchOptions
from layerwise_cli.client.watch.state import ServerState
from layerwise_cli.client.watch.step_source import Event, Poll, Step
from layerwise_cli.errors import LayerwiseError


class ListedSteps:
    """A `StepSource` listed afresh at every poll: a local directory, or a URL prefix (`s3://bucket/run/`).

    Args:
        root: the directory, the URL (`s3://bucket/run/`, `gs://...`, `az://...`), or a Hub run (`hf://org/run`:
            a folder per step, listed at the commit `options.revision` names now, `steps.hub_run`).
        options: the watch's options (`patterns`, `marker`, `settle`, `keep`, `revision`).
        clock: the monotonic clock a step's settling is timed by.
    """

    heading_words = ("step", "complete")

    def __init__(self, root: str | Path, options: WatchOptions, clock: Callable[[], float] = time.monotonic) -> None:
        # A Hub run is listed as a URL prefix is: remote, polled, its failures reported and survived.
        self.hub_run = str(root) if is_hub_run(str(root)) else None
        self.revision = options.revision
        self.url = str(root) if is_store_url(str(root)) or self.hub_run else None
        self.path = Path(root)
        self.remote = self.url is not None
        self.interval = options.poll_interval(self.remote)
        # How messages and the live view name the root (a URL without credentials).
        self.where = display_url(self.url) if self.url is not None and not self.hub_run else str(root)
        self.patterns = tuple(options.patterns)
        self.marker = options.marker
        self._tracker = CompletenessTracker(options.marker, options.settle, clock)
        self._keep = OldSteps(self.list, options)
        self._known: dict[str, StepDir | StoreStep] = {}
        self._deleted_by_us: set[str] = set()
        self._down = False  # the last listing of a URL failed (reported once)

    def list(self) -> list[StepDir] | list[StoreStep]:
        """The root's steps now, oldest first.

        Raises:
            LayerwiseError: one line naming the root: a directory missing or unreadable; a bucket missing, wrong
                credentials, the store not reachable.
        """
        if self.hub_run is not None:
            return list_hub_run_steps(self.hub_run, self.revision, self.patterns)
        if self.url is not None:
            return list_store_steps(self.url, self.patterns)
        return list_steps(self.path, self.patterns)

    def open(self) -> None:
        self.list()

    def poll(self, target: Step | None, floor: int, broken: dict[str, str]) -> Poll:
        """List the root: new and vanished steps, and the newest complete one above FLOOR that is not BROKEN.

        A URL's failed listing is `source_down` once, then `source_back` once one answers; the watch goes on.
        A local directory's failure raises (`list`).
        """
        steps, events = self._listing()
        if steps is None:
            return Poll(events=events)
        events += self._changes(steps)
        names = {s.name for s in steps}
        self._tracker.forget(names)
        newest, settling = None, False
        # Newest first; nothing at or below the floor (the newest step ever chosen) matters any more.
        for step in reversed(steps):
            if step.number <= floor:
                break
            if step.name in broken:
                continue
            state = self._tracker.check(step)
            if state.state == COMPLETE:
                # A store step comes pinned at the objects its check read: every target loads that.
                newest = state.loadable or step
                break
            settling = settling or state.state == SETTLING
        passed = [] if newest is None else [s for s in steps if floor < s.number < newest.number]
        return Poll(events=events, newest_seen=steps[-1].name if steps else None, target=newest,
                    passed_over=passed, target_gone=target is not None and target.name not in names,
                    settling=settling)

    def _listing(self) -> tuple[list[StepDir] | list[StoreStep] | None, list[Event]]:
        try:
            steps = self.list()
        except LayerwiseError as exc:
            if self.url is None:
                raise
            events = [] if self._down else [(ev.SOURCE_DOWN, {"message": str(exc)})]
            self._down = True
            return None, events
        events = [(ev.SOURCE_BACK, {"message": f"{self.where} answers again"})] if self._down else []
        self._down = False
        return steps, events

    def _changes(self, steps: list[StepDir] | list[StoreStep]) -> list[Event]:
        """Steps that vanished (deleted by someone other than `--keep`) and steps seen for the first time."""
        events: list[Event] = []
        names = {s.name for s in steps}
        for name in list(self._known):
            if name not in names:
                del self._known[name]
                if name not in self._deleted_by_us:  # else reported when deleted
                    events.append((ev.STEP_DELETED, {"step": name, "by": "other"}))
        for step in steps:
            if step.name not in self._known:
                self._known[step.name] = step
                events.append((ev.STEP_SEEN, {"step": step.name}))
        return events

    def delete_old(self, target: Step | None, servers: Iterable[ServerState]) -> Iterator[Event]:
        for kind, fields in self._keep.delete(target, list(servers)):
            if kind == ev.STEP_DELETED:
                self._deleted_by_us.add(fields["step"])
            yield kind, fields

    def once_failure(self, broken: dict[str, str], *, tries: int, settling: bool) -> str | None:
        """Why `--once` ends without a step: none complete under the root (the marker, the broken steps named)."""
        if settling:
            return None
        names = list(broken)
        return (f"{self.where}: no complete step (looked for {', '.join(self.patterns)}"
                f"{'' if self.marker == AUTO else ' with a ' + self.marker + ' marker'}"
                f"{'; broken: ' + ', '.join(names) if names else ''})")
