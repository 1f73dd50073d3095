"""How a range fetch meets faults, for every source: the stall bound, retries and backoff (`FetchPolicy`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from layerwise_cli.errors import LayerwiseError

# The answers a later try may cure: rate limits and the Hub's or its CDN's bad moments (huggingface_hub's own
# `http_backoff` retries the same ones).
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# The stall bound of a fetch (a Hub commit's or a URL's), in seconds: read where a `FetchPolicy` is made.
STALL_ENV = "LAYERWISE_STALL_S"
DEFAULT_STALL_S = 60.0


def stall_bound() -> float:
    """Seconds without a byte after which a fetch fails: `$LAYERWISE_STALL_S`, else 60.

    Raises:
        LayerwiseError: the variable is set to something other than a positive number of seconds.
    """
    text = os.environ.get(STALL_ENV, "").strip()
    if not text:
        return DEFAULT_STALL_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise LayerwiseError(f"{text!r} is not a positive number of seconds", where=STALL_ENV)
    return seconds


@dataclass(frozen=True)
class FetchPolicy:
    """How a range fetch meets faults.

    Attributes:
        stall_s: seconds without a byte (connect or read) after which the fetch fails, naming the file
            (default: `stall_bound()`, `$LAYERWISE_STALL_S` or 60).
        retries: tries after a 429/5xx answer or a connection dropped before any new byte arrived; a drop
            after progress resumes from the last byte received and does not count.
        backoff_s: the first wait before a retry; doubled each time, up to `max_backoff_s`.
        max_backoff_s: the longest wait, also for a server's `Retry-After`.
    """

    stall_s: float = field(default_factory=stall_bound)
    retries: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 16.0

    def wait_s(self, failures: int, retry_after: str | None = None) -> float:
        """Seconds to wait before try `failures + 1`: the server's `Retry-After` when it gives one."""
        if retry_after and retry_after.strip().isdigit():
            return min(float(retry_after), self.max_backoff_s)
        return min(self.backoff_s * 2 ** max(0, failures - 1), self.max_backoff_s)
