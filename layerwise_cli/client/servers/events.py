"""What one server's reload over HTTP reports as it goes: one immutable event per step that happened.

`ServerReload` hands each to the caller's `on_event` as it happens (from the fleet's threads: one server's
events arrive in order, several servers' interleave). A caller matches on the type: the command prints a line
per event, a test records the moment a step ended.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.report.verify_result import VerifyResult


@dataclass(frozen=True)
class ServerEvent:
    """Something that happened to the server at `url` during its reload."""

    url: str

    @property
    def kind(self) -> str:
        """The event's name in snake case (`paused`, `reloaded_back`, ...), for logs and timings."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()


@dataclass(frozen=True)
class Checked(ServerEvent):
    """The server answered and said how it reloads: `layerwise`, or vLLM's own `reload_weights` and why."""

    method: str
    fallback_reason: str | None


@dataclass(frozen=True)
class Preflighted(ServerEvent):
    """The server's pre-flight passed; `back` is the source it could be reloaded back to (None: none)."""

    back: str | None


@dataclass(frozen=True)
class Paused(ServerEvent):
    """Generation paused (`mode` as `/pause` took it), under a lease of `lease_s` (None: no lease)."""

    mode: str
    lease_s: float | None


@dataclass(frozen=True)
class Reloaded(ServerEvent):
    """The new weights are in: the server's report."""

    report: ReloadReport


@dataclass(frozen=True)
class Verified(ServerEvent):
    """`--verify` ran: its result, passed or not."""

    verify: VerifyResult


@dataclass(frozen=True)
class Versioned(ServerEvent):
    """The server's weight version is set to `version`."""

    version: str


@dataclass(frozen=True)
class GoingBack(ServerEvent):
    """Another server (or this one) failed: this one is reloaded back to `source`."""

    source: str
    because: str


@dataclass(frozen=True)
class ReloadedBack(ServerEvent):
    """The server holds `source` again."""

    source: str


@dataclass(frozen=True)
class Resumed(ServerEvent):
    """Generation resumed after `paused_s` seconds paused."""

    paused_s: float


@dataclass(frozen=True)
class Failed(ServerEvent):
    """The reload of this server failed: the one-line error its result carries."""

    error: str


OnEvent = Callable[[ServerEvent], None]
