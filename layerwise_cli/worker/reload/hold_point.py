"""A test's hold on a worker's reload, at the moment every rank agreed to change its weights.

With `LAYERWISE_TEST_HOLD_RELOAD=DIR` in a worker's environment and a file
`DIR/armed` present when a reload reaches that moment, the worker creates
`DIR/held` and waits until `armed` is gone. The fault tests arm one node's
workers and kill that node once `held` appears: a reload is then in flight on
every node, however fast or slow the machine. Unset (always, outside the
tests), it costs one environment lookup per reload.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HOLD_ENV = "LAYERWISE_TEST_HOLD_RELOAD"


def hold_if_armed() -> None:
    """Wait here while `DIR/armed` exists (`held` says so), DIR being `LAYERWISE_TEST_HOLD_RELOAD`; else return."""
    folder = os.environ.get(HOLD_ENV)
    if not folder:
        return
    armed = Path(folder) / "armed"
    if not armed.exists():
        return
    (Path(folder) / "held").touch()
    while armed.exists():
        time.sleep(0.1)
