"""Renewing a server's pause lease while this client works, and the test-only stop after a named step."""

from __future__ import annotations

import os
import signal
import threading

# Test-only: `LAYERWISE_TEST_KILL_AFTER=STEP` makes the client SIGKILL itself right after STEP of a reload over
# HTTP (connect, check, pause, reload, verify, version, resume), as a scheduler or the OOM killer would.
KILL_AFTER_ENV = "LAYERWISE_TEST_KILL_AFTER"


def step_done(step: str) -> None:
    """Mark STEP of a remote reload done (the kill-at-every-step tests stop the client here)."""
    if os.environ.get(KILL_AFTER_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


class LeaseKeeper:
    """Renews a pause lease every third of its length from a thread, until stopped.

    Attributes:
        lost: why a renewal failed (the lease ran out and the server resumed by itself), or None.
    """

    def __init__(self, client, lease_s: float) -> None:
        self._client = client
        self._lease_s = lease_s
        self._stop = threading.Event()
        self.lost: str | None = None
        self._thread = threading.Thread(target=self._run, name="layerwise-pause-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._lease_s / 3):
            try:
                self._client.renew(self._lease_s)
            except Exception as exc:  # noqa: BLE001 - reported by the caller, never raised in this thread
                self.lost = str(exc)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
