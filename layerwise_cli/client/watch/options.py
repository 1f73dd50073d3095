"""The options of `watch` (the `layerwise watch` command's and `layerwise_cli.watch`'s)."""

from __future__ import annotations

from dataclasses import dataclass

from layerwise_cli.checkpoint.steps.local import AUTO, DEFAULT_PATTERNS
from layerwise_cli.worker.rpc import ReloadOptions

# Seconds between two polls by default: a listing of a local root is cheap; each poll of a Hub repo or of a URL
# prefix is a request (or a page of a listing).
LOCAL_INTERVAL_S = 1.0
HUB_INTERVAL_S = 10.0


@dataclass(frozen=True)
class WatchOptions:
    """How `watch` finds steps and reloads them (the `layerwise watch` options).

    Attributes:
        patterns: glob patterns of step directory names under the root (a local root only).
        marker: a file whose presence marks a step complete, or `auto` (every
            shard complete and nothing changed for `settle` seconds).
        interval: seconds between polls of the root; None: 1 s for a local root, 10 s for a Hub repo or a URL
            prefix (each poll of those is a request).
        settle: seconds a step must stay unchanged before `auto` calls it complete (a local root only; a
            Hub root ignores it: a commit is complete as pushed).
        keep: delete steps older than the newest `keep` once every server holds
            the newest; None never deletes (a local root or a URL prefix, not a Hub repo).
        revision: for a Hub repo root, the branch or tag whose commits are the steps; None: the default
            branch. Refused for a local root.
        once: bring every server to the newest complete step, then stop.
        pause_mode: how servers pause during a reload (`wait`, `keep`, `abort`, `none`).
        pause_lease_s: seconds a server with layerwise's pause lease stays paused once this process stops
            renewing it.
        api_key: the servers' API key.
        verify: verify each server against the step after reloading it.
        allow_unchecked: with `verify`, accept layers it cannot check (they are
            listed); otherwise such a layer fails the step on that server. With or
            without it, keep a reload whose completion could not be shown (noted in
            the report; `ReloadOptions.allow_unchecked`).
        timeout: seconds allowed for one server's reload.
        atomic: bring the servers to a step all or nothing (`client/servers/fleet.py`): every server that is up is
            pre-flighted before any is paused, and reloaded back if another fails; None: when there is more
            than one server.
    """

    patterns: tuple[str, ...] = DEFAULT_PATTERNS
    # A file whose presence marks a step complete, or "auto" (files complete and unchanged for `settle` s).
    marker: str = AUTO
    interval: float | None = None
    settle: float = 2.0
    # Delete steps older than the newest N once every server holds the newest; None: never delete.
    keep: int | None = None
    once: bool = False
    pause_mode: str = "wait"
    pause_lease_s: float = 60.0
    api_key: str | None = None
    verify: bool = False
    allow_unchecked: bool = False
    timeout: float = 600.0
    atomic: bool | None = None
    revision: str | None = None

    def poll_interval(self, remote: bool) -> float:
        """Seconds between two polls: `interval`, or its default for a local root or a remote one (REMOTE: a Hub
        repo or a URL prefix)."""
        if self.interval is not None:
            return self.interval
        return HUB_INTERVAL_S if remote else LOCAL_INTERVAL_S

    def reload_options(self) -> ReloadOptions:
        """How every target reloads a step: the defaults, `allow_unchecked`, and no delta base check.

        A delta step is rebuilt from its chain's files whatever the server holds: a server that missed steps,
        or holds a step outside the newest delta's chain (the trainer wrote a full step since), is brought to
        the newest step, every tensor proved by the step's digests as it is read (docs/deltas.md); the layers
        proved to hold a step of the chain are patched in place. A chain whose files are gone fails that step's
        pre-flight, and the server keeps its weights.
        """
        return ReloadOptions(allow_unchecked=self.allow_unchecked, delta_base_check=False)
