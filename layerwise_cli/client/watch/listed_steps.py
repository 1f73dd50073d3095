"""Where `watch` finds its steps when they are listed: a local directory of step directories, or a URL prefix of
step folders in object storage (a Hub repo's commits are `watch_hub.py`'s)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from layerwise_cli.checkpoint.steps.hub_run import is_hub_run, list_hub_run_steps
from layerwise_cli.checkpoint.steps.local import AUTO, StepDir, list_steps
from layerwise_cli.checkpoint.steps.store import StoreStep, list_store_steps
from layerwise_cli.checkpoint.store.objects import display_url, is_store_url
from layerwise_cli.client.watch import events as ev
from layerwise_cli.errors import LayerwiseError


class StepsRoot:
    """A root listed afresh at every poll: a local directory (`steps.list_steps`), or a URL prefix
    (`store_steps.list_store_steps`: one listing of the store, every page).

    Args:
        root: the directory, the URL (`s3://bucket/run/`, `gs://...`, `az://...`), or a Hub run (`hf://org/run`:
            a folder per step, listed at the commit REVISION names now, `steps.hub_run`).
        patterns: shell globs a step's name must match.
        revision: a Hub run's branch (None: the default branch).
    """

    def __init__(self, root: str | Path, patterns: Iterable[str], revision: str | None = None) -> None:
        # A Hub run is listed as a URL prefix is: remote, polled, its failures reported and survived.
        self.hub_run = str(root) if is_hub_run(str(root)) else None
        self.revision = revision
        self.store = str(root) if is_store_url(str(root)) or self.hub_run else None
        self.path = Path(root)
        # How messages and the live view name the root (a URL without credentials).
        self.where = display_url(self.store) if self.store is not None and not self.hub_run else str(root)
        self.patterns = tuple(patterns)
        self._down = False  # the last listing of a URL failed (reported once)

    def list(self) -> list[StepDir] | list[StoreStep]:
        """The root's steps now, oldest first.

        Raises:
            LayerwiseError: one line naming the root: a directory missing or unreadable; a bucket missing, wrong
                credentials, the store not reachable.
        """
        if self.hub_run is not None:
            return list_hub_run_steps(self.hub_run, self.revision, self.patterns)
        if self.store is not None:
            return list_store_steps(self.store, self.patterns)
        return list_steps(self.path, self.patterns)

    def poll(self) -> tuple[list[StepDir] | list[StoreStep] | None, list[tuple[str, dict]]]:
        """`list`, and this poll's events (kind, fields); None for the steps when a URL's listing failed.

        A URL's failed listing is `source_down` once, then `source_back` once one answers; the watch goes on.
        A local directory's failure raises (`list`).
        """
        try:
            steps = self.list()
        except LayerwiseError as exc:
            if self.store is None:
                raise
            events = [] if self._down else [(ev.SOURCE_DOWN, {"message": str(exc)})]
            self._down = True
            return None, events
        events = [(ev.SOURCE_BACK, {"message": f"{self.where} answers again"})] if self._down else []
        self._down = False
        return steps, events

    def no_step(self, marker: str, broken: Iterable[str]) -> str:
        """Why `--once` ends without a step: none complete under the root (MARKER, the BROKEN steps named)."""
        broken = list(broken)
        return (f"{self.where}: no complete step (looked for {', '.join(self.patterns)}"
                f"{'' if marker == AUTO else ' with a ' + marker + ' marker'}"
                f"{'; broken: ' + ', '.join(broken) if broken else ''})")
