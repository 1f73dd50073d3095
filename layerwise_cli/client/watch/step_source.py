"""Where `watch` finds its steps: one protocol for a local folder, a URL prefix and a Hub repo's ref.

The watch loop (`watcher.Watcher`) asks its `StepSource` once per poll what changed, and never branches on the
kind of root. A listed root (a local directory of step directories, or step folders under a URL prefix) is
`listed_steps.ListedSteps`; a Hub repo, whose ref's commits are the steps, is `hub_source.HubStepSource`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from layerwise_cli.checkpoint.steps.local import StepDir
from layerwise_cli.checkpoint.steps.store import StoreStep
from layerwise_cli.client.watch.hub_steps import HubStep
from layerwise_cli.client.watch.state import ServerState

Step = StepDir | StoreStep | HubStep  # a local root's directory, a URL prefix's folder, a Hub ref's commit
Event = tuple[str, dict]  # a watch event's kind and fields, made into a `WatchEvent` by the loop


@dataclass(frozen=True)
class Poll:
    """What one poll of a step source found.

    Attributes:
        events: what happened since the last poll (step_seen, step_deleted, source_down, source_back), in order.
        newest_seen: the newest step the root shows now (None: unchanged, or nothing there).
        target: a step newer than the current target to bring every server to (None: none).
        passed_over: the steps TARGET passes over (reported as skipped, never loaded).
        target_gone: the current target is no longer there: wait for a newer one, never go back.
        settling: a step newer than the target is still being written.
    """

    events: list[Event] = field(default_factory=list)
    newest_seen: str | None = None
    target: Step | None = None
    passed_over: list[Step] = field(default_factory=list)
    target_gone: bool = False
    settling: bool = False


class StepSource(Protocol):
    """A run's steps as `watch` sees them, whatever holds them.

    Attributes:
        where: how messages and the live view name the root (a URL without credentials, `org/name@ref`).
        remote: polled over a network (a URL prefix, the Hub): the slower default poll interval.
        interval: seconds between two polls (`WatchOptions.poll_interval` for this kind of root).
        heading_words: what the live view's heading calls the newest step and the target (`step`, `complete`;
            a Hub ref's `commit`, `target`).
    """

    where: str
    remote: bool
    interval: float
    heading_words: tuple[str, str]

    def open(self) -> None:
        """Fail now, one line naming the root, on a root that cannot be read (missing, wrong credentials)."""
        ...

    def poll(self, target: Step | None, floor: int, broken: dict[str, str]) -> Poll:
        """Look once: TARGET is the step servers are brought to, FLOOR the newest step number ever chosen,
        BROKEN the steps never to load again (name -> why)."""
        ...

    def delete_old(self, target: Step | None, servers: Iterable[ServerState]) -> Iterator[Event]:
        """What `--keep` deletes now that SERVERS are where they are, as events (a Hub ref deletes nothing)."""
        ...

    def once_failure(self, broken: dict[str, str], *, tries: int, settling: bool) -> str | None:
        """With `--once`, no step to load and every server seen: why to give up now, or None to poll again."""
        ...
