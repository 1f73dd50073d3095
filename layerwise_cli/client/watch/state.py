"""What `watch` knows of each target and of the whole watch (the watcher updates both)."""

from __future__ import annotations

from dataclasses import dataclass, field

from layerwise_cli.client.watch.targets import Target


@dataclass
class ServerState:
    """What the watch knows of one target."""

    target: Target
    version: str | None = None  # what it holds, by its weight version; None: unknown
    last_version: str | None = None  # the last version it was known to hold (kept while it is down)
    seen: bool = False
    up: bool | None = None
    busy: str | None = None  # "probe", or the name of the step it is loading
    # Its weights may differ from what its version names (a reload failed half-way): reload whatever it says.
    dirty: bool = False
    failures: int = 0
    next_try: float = 0.0
    next_probe: float = 0.0
    wall_s: float | None = None
    peak_bytes: int | None = None
    error: str | None = None


@dataclass
class WatchState:
    """Where the watch stands, for a live view (read it between events; the watcher updates it)."""

    newest_seen: str | None = None
    target: str | None = None
    servers: dict[str, dict] = field(default_factory=dict)

    def show(self, servers: dict[str, ServerState]) -> None:
        """Copy what the live view shows of each of SERVERS (name -> its state) into `servers`."""
        self.servers = {
            name: {"up": s.up, "version": s.version, "busy": s.busy if s.busy != "probe" else None,
                   "wall_s": s.wall_s, "peak_bytes": s.peak_bytes, "error": s.error}
            for name, s in servers.items()}
