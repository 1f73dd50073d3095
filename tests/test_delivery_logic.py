"""How a reload's bytes arrive: decided once per operation, beside its pin (`client/delivery.py`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from layerwise_cli.checkpoint.hub.pin import HubPin
from layerwise_cli.client import delivery
from layerwise_cli.client.delivery import DOWNLOAD, LOCAL, PREFETCH, STREAM, decide_delivery, plan_operation
from layerwise_cli.worker.rpc import ReloadOptions

COMMIT = "a" * 40


@pytest.mark.parametrize(("source", "engine_model", "in_process", "bounded", "expected"), [
    ("./run/step_2", "./run/step_1", True, False, LOCAL),
    ("./run/step_2", None, False, False, LOCAL),
    ("org/model", None, True, False, DOWNLOAD),  # the engine starts on it: fetched whole first
    ("org/model", "org/model", True, False, DOWNLOAD),
    ("org/model", "./base", True, False, PREFETCH),  # fetched whole while the engine starts on another model
    ("org/model", "./base", True, True, STREAM),  # --bounded-disk keeps nothing: the workers fetch ranges
    ("org/model", None, False, False, STREAM),  # running servers, watch, the Python API
    ("s3://bucket/run/step_2", "./base", True, False, STREAM),
    ("https://host/run/step_2", None, False, True, STREAM),
    ("hf://org/run/step_2", None, False, False, STREAM),
])
def test_each_kind_of_operation_gets_one_delivery(source, engine_model, in_process, bounded, expected):
    assert decide_delivery(source, engine_model=engine_model, in_process=in_process, bounded_disk=bounded) \
        == expected


def test_an_operation_is_pinned_once(monkeypatch):
    """The first plan pins (one Hub request here); options carrying the delivery are not pinned again."""
    calls = []

    def pin_reload(source, options):
        calls.append(source)
        return replace(options, revision=COMMIT), HubPin(source, COMMIT)

    monkeypatch.setattr(delivery, "pin_reload", pin_reload)
    options, pin = plan_operation("org/model", ReloadOptions(revision="main"), engine_model="./base",
                                  in_process=True)
    assert (options.revision, options.delivery, pin.commit) == (COMMIT, PREFETCH, COMMIT)
    again, pin_again = plan_operation("org/model", options)
    assert again == options and pin_again == pin and calls == ["org/model"]


def test_the_delivery_travels_to_the_workers_only_when_decided():
    assert "delivery" not in ReloadOptions().to_json()
    assert ReloadOptions.from_json(ReloadOptions(delivery=STREAM).to_json()).delivery == STREAM
