"""What `watch` reports: one immutable event per thing that happened."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from layerwise_cli.checkpoint.hub.pin import is_commit
from layerwise_cli.units import human_bytes
from layerwise_cli.worker.reload.delta_base import OFF_CHAIN_NOTE

STEP_SEEN = "step_seen"  # a new step directory appeared under the root
STEP_COMPLETE = "step_complete"  # the newest complete step changed: servers are brought to it
STEP_SKIPPED = "step_skipped"  # a step will never be loaded: passed over by a newer one, or broken
STEP_DELETED = "step_deleted"  # a step directory vanished (by the trainer, or by --keep)
SERVER_SEEN = "server_seen"  # first answer of a server, with the weight version it holds
SERVER_DOWN = "server_down"  # a server stopped answering; retried with backoff
SERVER_BACK = "server_back"  # a server answers again
RELOAD_STARTED = "reload_started"
RELOAD_DONE = "reload_done"
RELOAD_FAILED = "reload_failed"
SOURCE_DOWN = "source_down"  # a poll of a watched Hub ref failed (the Hub down, a 5xx); polled again with backoff
SOURCE_BACK = "source_back"  # a poll of the watched Hub ref succeeded again
EVENT_KINDS = (STEP_SEEN, STEP_COMPLETE, STEP_SKIPPED, STEP_DELETED, SERVER_SEEN, SERVER_DOWN, SERVER_BACK,
               RELOAD_STARTED, RELOAD_DONE, RELOAD_FAILED, SOURCE_DOWN, SOURCE_BACK)


# Commits are named by their first characters in one-line output (lines, the live table); in full elsewhere.
SHORT = 12


def short(name: str | None) -> str | None:
    """A step name for one line: a commit's first `SHORT` characters; a folder step's name as it is."""
    return name[:SHORT] if name is not None and is_commit(name) else name


@dataclass(frozen=True)
class WatchEvent:
    """One thing that happened while watching a run.

    Attributes:
        kind: one of `EVENT_KINDS` (step_seen, step_complete, reload_started, ...).
        time: wall-clock time, Unix seconds.
        step: a step directory's name, or a Hub step's commit (in full; `line` shortens it).
        server: a server URL, or `engine` for an in-process engine.
        message: a one-line explanation (why a step was skipped, a reload failed, ...).
        version: the weight version the server holds after the event
            (reloads, server_seen, server_back).
        wall_s: for reloads, the reload's wall time from the server's report.
        peak_bytes: for reloads, the peak buffered bytes from the server's report.
        paused_s: for reloads, how long the server was paused.
        by: for step_deleted, `watch` (--keep) or `other` (the trainer, a person).
        report: the full per-server result (written by `--log`, left out of `--json`).
    """

    kind: str
    time: float
    step: str | None = None
    server: str | None = None
    message: str | None = None
    # The weight version the server holds after the event (reloads, server_seen, server_back).
    version: str | None = None
    wall_s: float | None = None
    peak_bytes: int | None = None
    paused_s: float | None = None
    # For step_deleted: "watch" (--keep) or "other" (the trainer, a person).
    by: str | None = None
    report: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"unknown watch event kind {self.kind!r}")

    def to_dict(self, *, full: bool = False) -> dict[str, Any]:
        """The event as JSON-ready data: fields that are None left out; `report` only when FULL."""
        data = {"event": self.kind, "time": self.time}
        for name in ("step", "server", "message", "version", "wall_s", "peak_bytes", "paused_s", "by"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        if full and self.report is not None:
            data["report"] = self.report
        return data

    def line(self) -> str:
        """The event as one human line (no markup; a commit by its first characters)."""
        where = " ".join(part for part in (self.server, short(self.step)) if part)
        parts = [self.kind.replace("_", " "), where]
        if self.version is not None and self.kind in (SERVER_SEEN, SERVER_BACK):
            parts.append(f"holds {short(self.version)}")
        if self.wall_s is not None:
            parts.append(f"in {self.wall_s:.2f} s")
        if self.peak_bytes is not None:
            parts.append(f"peak {human_bytes(self.peak_bytes)}")
        if self.by is not None:
            parts.append(f"by {self.by}")
        if self.message:
            parts.append(f"({self.message})")
        return " ".join(p for p in parts if p)


def off_chain(report: dict | None) -> str | None:
    """The report's note that the server held no step of the delta's chain (it was given the chain's full step
    and links: `delta_base.off_chain_note`), for the event's message; None otherwise."""
    report = report or {}
    inner = report.get("report") if isinstance(report.get("report"), dict) else {}
    notes = report.get("notes") or inner.get("notes") or []
    return next((note for note in notes if isinstance(note, str) and note.startswith(OFF_CHAIN_NOTE)), None)
