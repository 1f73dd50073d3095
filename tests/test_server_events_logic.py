"""Typed server-reload events: their names, and the lines `reload --url` prints for them."""

from __future__ import annotations

import pytest

from layerwise_cli.cli.reload_remote import _event_line
from layerwise_cli.client.servers.events import (
    Checked,
    Failed,
    GoingBack,
    Paused,
    Preflighted,
    ReloadedBack,
    Resumed,
    Versioned,
)
from layerwise_cli.units import human_seconds

URL = "http://127.0.0.1:8000"


def test_each_event_is_named_in_snake_case() -> None:
    assert [event.kind for event in (Paused(URL, "wait", 30.0), GoingBack(URL, "a", "b"), ReloadedBack(URL, "a"),
                                     Failed(URL, "boom"))] == ["paused", "going_back", "reloaded_back", "failed"]


@pytest.mark.parametrize(("event", "line"), [
    (Paused(URL, "wait", 30.0), f"{URL}: generation paused (wait)"),
    (Versioned(URL, "step-7"), f"{URL}: weight version set to step-7"),
    (Preflighted(URL, None), f"{URL}: pre-flight passed"),
    (GoingBack(URL, "run/step_6", "another server failed"),
     f"{URL}: [yellow]reloading it back[/] to run/step_6 (another server failed)"),
    (ReloadedBack(URL, "run/step_6"), f"{URL}: reloaded back to run/step_6"),
    (Resumed(URL, 2.5), f"{URL}: generation resumed after {human_seconds(2.5)} paused"),
    (Checked(URL, "layerwise", None), None),
    (Failed(URL, "boom"), None),  # the result table says it
])
def test_progress_lines(event, line) -> None:
    assert _event_line(event, as_json=False) == line


def test_with_json_only_the_fallback_warning_is_printed() -> None:
    assert _event_line(Paused(URL, "wait", None), as_json=True) is None
    warning = _event_line(Checked(URL, "vllm", "the server has no layerwise extension"), as_json=True)
    assert warning is not None and warning.startswith(f"[yellow]Warning:[/] {URL}: the server has no layerwise")
