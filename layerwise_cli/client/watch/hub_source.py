"""`watch` on a Hub repo as a `StepSource`: each new commit of the watched ref is the next step.

The ref is polled with backoff (`hub_steps.HubSteps`); a commit is complete as pushed, and nothing is deleted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from layerwise_cli.client.watch.hub_steps import HubRef, HubSteps
from layerwise_cli.client.watch.options import WatchOptions
from layerwise_cli.client.watch.state import ServerState
from layerwise_cli.client.watch.step_source import Event, Poll, Step


class HubStepSource:
    """The commits of a Hub repo's ref, as steps.

    Args:
        repo_id: `org/name`.
        options: the watch's options (`revision`: the branch or tag to follow).
        interval: seconds between polls (a failed poll's backoff is never shorter).
        clock: the monotonic clock the backoff is timed by.
        backoff_max_s: the longest wait after failed polls.

    Raises:
        UsageError: HF_HUB_OFFLINE=1 (no poll could ever see a new commit).
    """

    remote = True
    heading_words = ("commit", "target")

    def __init__(self, repo_id: str, options: WatchOptions, *, clock: Callable[[], float] = time.monotonic,
                 backoff_max_s: float = 10.0) -> None:
        self.ref = HubRef(repo_id, options.revision)
        self.where = self.ref.where
        self.interval = options.poll_interval(self.remote)
        self.steps = HubSteps(self.ref, interval=self.interval, clock=clock, backoff_max_s=backoff_max_s)

    def open(self) -> None:
        """Nothing to read first: the first poll says whether the repo and ref exist."""

    def poll(self, target: Step | None, floor: int, broken: dict[str, str]) -> Poll:
        """One request (none while a failed poll's backoff runs): a new commit of the ref is the next step."""
        polled = self.steps.poll()
        if polled is None:
            return Poll()
        new = polled.new
        return Poll(events=polled.events(self.ref), newest_seen=new.name if new is not None else None,
                    target=new if new is not None and new.name not in broken else None)  # a failed commit: never again

    def delete_old(self, target: Step | None, servers: Iterable[ServerState]) -> Iterator[Event]:
        return iter(())

    def once_failure(self, broken: dict[str, str], *, tries: int, settling: bool) -> str | None:
        return self.steps.once_failure(broken, tries=tries)
