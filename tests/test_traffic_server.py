"""A live server under client traffic while the tool reloads add/multiply alternately (CI form)."""

from __future__ import annotations

import pytest

from benchmarks.load_test import run_load
from tests.support.server_support import server_fixture

pytestmark = pytest.mark.server

multiply_server = server_fixture("multiply")


def test_reloads_under_traffic_never_fail_or_tear(multiply_server, demo_models):
    sources = {"multiply": str(demo_models["multiply"]), "add": str(demo_models["add"])}
    result = run_load(multiply_server.url, sources, threads=4, min_reloads=10, max_seconds=45, idle_seconds=3)
    print()
    print(result.summary())
    assert len(result.reloads) >= 10 and all(window.ok for window in result.reloads), [
        window.error for window in result.reloads if not window.ok]
    assert not result.failed, result.failed[:3]
    assert not result.wrong, result.wrong[:3]
    assert not result.torn, result.torn[:3]
    during, idle = result.latencies()
    # Traffic really overlapped the reloads, and ran when idle.
    assert during and idle
    assert not multiply_server.is_paused()
