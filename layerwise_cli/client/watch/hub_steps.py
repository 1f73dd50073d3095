"""`watch` on a Hub repo: each new commit of the watched ref is a step, named by its commit.

A poll is one cheap request (`hub.pin.pin_commit`: a HEAD of `config.json` at the ref). A step is reloaded
as the repo id with `ReloadOptions.revision` set to its commit, never the branch, so a ref moved during a
reload changes nothing for that reload; the next poll finds the newer commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from layerwise_cli.checkpoint.hub.pin import VANISHED, commit_vanished, offline, pin_commit
from layerwise_cli.checkpoint.steps.local import AUTO, DEFAULT_PATTERNS
from layerwise_cli.client.watch import events as ev
from layerwise_cli.client.watch.events import short
from layerwise_cli.client.watch.options import WatchOptions
from layerwise_cli.errors import LayerwiseError, UsageError


@dataclass(frozen=True)
class HubStep:
    """One commit of the watched ref, as a step: `name` is the commit (also the servers' weight version).

    Attributes:
        name: the 40-hex commit.
        number: the order in which the watch saw it (the ref's 1st, 2nd, ... commit), never the Hub's.
        source: the repo id every target reloads.
        revision: the commit, handed to every target as the revision to read.
        ref: the watched ref it came from (asked whether the commit vanished).
    """

    name: str
    number: int
    source: str
    revision: str
    ref: HubRef

    def excuse(self) -> tuple[str | None, bool]:
        """Why a failed reload of this commit is not its fault, and whether it vanished (`HubRef.excuse`)."""
        return self.ref.excuse(self.name)


class PollFailed(Exception):
    """A poll that got no commit: the Hub did not answer, or answered an error. `lasting`: not found (a typo)."""

    def __init__(self, message: str, *, lasting: bool) -> None:
        super().__init__(message)
        self.lasting = lasting


class HubRef:
    """The watched ref of a Hub repo: what it names now, and whether a commit is still there.

    Args:
        repo_id: `org/name`.
        revision: the branch or tag to follow (None: the default branch). A commit never moves: allowed, and
            the watch loads it once.
    """

    def __init__(self, repo_id: str, revision: str | None = None) -> None:
        self.repo_id = repo_id
        self.revision = revision

    @property
    def where(self) -> str:
        """`org/name@revision` (or `org/name`), as messages name the watched ref."""
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id

    def commit(self) -> str:
        """The commit the ref names now: one request.

        Raises:
            PollFailed: one line naming the repo and ref; `lasting` when the Hub says the repo or ref does not
                exist (else it did not answer, or answered a 5xx).
        """
        from huggingface_hub.errors import RepositoryNotFoundError  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

        try:
            return pin_commit(self.repo_id, self.revision).commit
        except LayerwiseError as exc:
            # A typo'd local path looks like a repo id too: say that it was looked for here first.
            here = " (and it is not a local directory)" if isinstance(exc.__cause__, RepositoryNotFoundError) else ""
            raise PollFailed(f"{exc}{here}", lasting=commit_vanished(exc.__cause__)) from None

    def vanished(self, commit: str) -> bool | None:
        """Whether COMMIT is gone from the Hub (force-pushed away, repo deleted): one request.

        None when the Hub did not tell (it did not answer): the caller cannot blame the commit.
        """
        from huggingface_hub import get_hf_file_metadata, hf_hub_url  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source
        from huggingface_hub.errors import RemoteEntryNotFoundError  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

        try:
            get_hf_file_metadata(hf_hub_url(self.repo_id, "config.json", revision=commit))
        except RemoteEntryNotFoundError:
            return False  # the commit is there, without a config.json
        except Exception as exc:  # noqa: BLE001 - a missing revision is the answer; anything else is no answer
            return True if commit_vanished(exc) else None
        return False

    def excuse(self, commit: str) -> tuple[str | None, bool]:
        """Why a failed reload of COMMIT is not the commit's fault (None: it may be), and whether it vanished.

        One request (`vanished`). Vanished: one line naming repo and commit, and True (never try it again).
        The Hub not answering: the commit is not blamed, and is tried again.
        """
        vanished = self.vanished(commit)
        if vanished is None:
            return "the Hub did not answer whether the commit is still there", False
        return (f"{self.repo_id}@{commit}: {VANISHED}", True) if vanished else (None, False)


@dataclass(frozen=True)
class Polled:
    """What one poll of the watched ref found.

    Attributes:
        new: the ref names a commit other than at the last poll: the next step; None: nothing new.
        failed: why the poll got no commit (one line naming repo and ref); None: it got one.
        down: the first failed poll in a row (report it once).
        back: the first good poll after failed ones.
    """

    new: HubStep | None = None
    failed: str | None = None
    down: bool = False
    back: bool = False

    def events(self, ref: HubRef) -> list[tuple[str, dict]]:
        """The watch events this poll of REF makes, as (kind, fields): source_down, source_back, step_seen."""
        events = []
        if self.down:
            events.append((ev.SOURCE_DOWN, {"message": self.failed}))
        if self.back:
            events.append((ev.SOURCE_BACK, {"message": f"{ref.where} answers again"}))
        if self.new is not None:
            events.append((ev.STEP_SEEN, {"step": self.new.name}))
        return events


class HubSteps:
    """The watched ref, polled with backoff: each commit it names that differs from the last is a new step.

    A failed poll (the Hub down, a 5xx, a timeout) is retried after 0.5 s, doubling to `backoff_max_s`, and
    never sooner than `interval`. A repo or ref the Hub does not know on the very first poll is bad input:
    `poll` raises; later (the repo deleted while watched) it is a failed poll like any other.

    Raises:
        UsageError: HF_HUB_OFFLINE=1 (no poll could ever see a new commit).
    """

    def __init__(self, ref: HubRef, *, interval: float, clock: Callable[[], float] = time.monotonic,
                 backoff_max_s: float = 10.0) -> None:
        if offline():
            raise UsageError(f"watching the Hub repo {ref.repo_id} needs the Hub, and HF_HUB_OFFLINE=1 is set")
        self.ref = ref
        self.interval = interval
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self.commit: str | None = None  # what the ref named at the last good poll
        self.failures = 0  # failed polls in a row
        self.error: str | None = None  # the last failed poll's reason
        self._number = 0
        self._next_try = 0.0

    def poll(self) -> Polled | None:
        """Ask the Hub once what the ref names; None while a failed poll's backoff runs.

        Raises:
            LayerwiseError: the first poll found no such repo or ref.
        """
        now = self._clock()
        if now < self._next_try:
            return None
        try:
            commit = self.ref.commit()
        except PollFailed as exc:
            if exc.lasting and self.commit is None:
                raise LayerwiseError(str(exc)) from None
            self.failures += 1
            self.error = str(exc)
            wait = min(self.backoff_max_s, 0.5 * 2 ** (self.failures - 1))
            self._next_try = now + max(self.interval, wait)
            return Polled(failed=self.error, down=self.failures == 1)
        back = self.failures > 0
        self.failures, self.error = 0, None
        if commit == self.commit:
            return Polled(back=back)
        self.commit = commit
        self._number += 1
        return Polled(new=HubStep(commit, self._number, self.ref.repo_id, commit, self.ref), back=back)

    def once_failure(self, skipped: dict[str, str], *, tries: int) -> str | None:
        """With `--once` and no commit to load: why to give up, or None to poll again.

        Gives up after TRIES failed polls in a row, or when the ref names a commit that failed or vanished
        (SKIPPED: commit -> why).
        """
        if self.failures:
            return f"{self.failures} polls in a row failed: {self.error}" if self.failures >= tries else None
        if self.commit is None:
            return None
        names = ", ".join(f"{short(name)} ({why})" for name, why in skipped.items())
        return f"{self.ref.where}: no commit to load (skipped: {names or 'none'})"


def refuse_folder_options(repo_id: str | None, options: WatchOptions, hub_run: bool = False) -> None:
    """A local root's options given for a Hub root (REPO_ID), `--keep` for a Hub run (HUB_RUN), or `revision` for a
    local root (REPO_ID None): one UsageError line.

    `settle` is ignored for a Hub root (a commit is complete as pushed): harmless, so not refused. A Hub run
    (HUB_RUN: `hf://org/run`, a folder per step) takes `--revision` (the branch it follows), not `--keep`.
    """
    if hub_run:
        if options.keep is not None:
            raise UsageError("--keep applies to a local directory of steps or a URL prefix, not to a Hub run: "
                             "watch deletes no folder of a Hub repo")
        return
    if repo_id is None:
        if options.revision is not None:
            raise UsageError("--revision applies to a Hub repo id (org/name), not to a directory of steps or a URL "
                             "prefix")
        return
    given = [name for name, used in (("--keep", options.keep is not None), ("--marker", options.marker != AUTO),
                                     ("--pattern", tuple(options.patterns) != DEFAULT_PATTERNS)) if used]
    if given:
        raise UsageError(f"{', '.join(given)} applies to a local directory of steps, not to the Hub repo "
                         f"{repo_id}: each commit of its ref is a complete step, and no commit is deleted")
