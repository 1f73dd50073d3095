"""worker/rpc.py: each call names a method the extension has, with the extension's own arguments, and each answer
reads back what the extension sends."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from layerwise_cli.worker import rpc

EXTENSION = Path(__file__).resolve().parent.parent / "layerwise_cli" / "worker" / "extension.py"
CALLS = (rpc.PingCall, rpc.ReloadCall, rpc.ChecksumsCall, rpc.FingerprintsCall, rpc.VerifyCall, rpc.PreflightCall)


def _extension_methods() -> dict[str, list[str]]:
    """Method name -> its keyword parameters, read from the extension's source (no torch or vLLM import)."""
    tree = ast.parse(EXTENSION.read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LayerwiseWorkerExtension")
    return {f.name: [a.arg for a in f.args.args[1:]] + ([f.args.kwarg.arg] if f.args.kwarg else [])
            for f in cls.body if isinstance(f, ast.FunctionDef)}


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__)
def test_every_call_names_an_extension_method_with_its_arguments(call) -> None:
    methods = _extension_methods()
    assert call.method in methods
    assert [f.name for f in dataclasses.fields(call)] == methods[call.method]


def test_every_extension_method_has_a_call() -> None:
    assert {c.method for c in CALLS} == {name for name in _extension_methods() if name.startswith("layerwise_")}


def test_a_reload_call_sends_the_defaults_it_always_sent_and_the_rest_only_when_set() -> None:
    assert rpc.ReloadCall(source="/ckpt").kwargs() == {"source": "/ckpt", "order": "layer", "allow_partial": False,
                                                       "readahead": True, "revision": None}
    sent = rpc.ReloadCall(source="/ckpt", options=rpc.ReloadOptions(order="file", all_layers=True, repairs=False,
                                                                     in_place=False, progress_path="/tmp/p")).kwargs()
    assert sent == {"source": "/ckpt", "order": "file", "allow_partial": False, "readahead": True, "revision": None,
                    "progress_path": "/tmp/p", "all_layers": True, "repairs": False, "in_place": False}


def test_answers_carry_the_wire_shape_of_their_outcome_and_read_back() -> None:
    ok = rpc.ReloadAnswer(ok=True, report={"wall_s": 1.0})
    assert ok.to_json() == {"ok": True, "report": {"wall_s": 1.0}}
    failed = rpc.ReloadAnswer(ok=False, error="boom", engine_touched=True, rolled_back=True,
                              position={"tp_rank": 1}, traceback="tb")
    assert failed.to_json() == {"ok": False, "error": "boom", "engine_touched": True, "rolled_back": True,
                                "followed_another_rank": False, "position": {"tp_rank": 1}, "traceback": "tb"}
    assert rpc.ReloadAnswer.from_json(failed.to_json()) == failed
    assert rpc.VerifyAnswer.from_json({"ok": True, "rank": 0, "verify": {"layers": []}, "later_key": 1}) == \
        rpc.VerifyAnswer(ok=True, rank=0, verify={"layers": []})


def test_an_answer_that_is_no_object_is_a_failure_saying_what_came() -> None:
    answer = rpc.PingAnswer.from_json(["not", "a", "dict"])
    assert not answer.ok
    assert "['not', 'a', 'dict']" in answer.error


def test_reload_options_cross_as_they_are_and_leave_out_what_this_version_does_not_know() -> None:
    options = rpc.ReloadOptions(order="file", allow_unchecked=True, progress_path="/tmp/p")
    assert rpc.ReloadOptions.from_json(options.to_json()) == options
    assert rpc.ReloadOptions.from_json({**options.to_json(), "from_a_newer_client": 1}) == options
    assert "allow_unchecked" not in rpc.ReloadOptions().to_json()


def test_the_diagnostic_switches_of_this_process_travel_with_the_options(monkeypatch) -> None:
    monkeypatch.delenv("LAYERWISE_FRESH_BUFFERS", raising=False)
    monkeypatch.setenv("LAYERWISE_NO_REPAIRS", "1")
    switched = rpc.ReloadOptions(all_layers=True).with_switches()
    assert switched == rpc.ReloadOptions(all_layers=True, repairs=False)
    monkeypatch.setenv("LAYERWISE_NO_REPAIRS", "0")
    assert rpc.ReloadOptions().with_switches() == rpc.ReloadOptions()


def test_a_preflight_sends_the_delta_base_check_only_when_off():
    # An older extension's `layerwise_preflight` takes no such keyword: sent only when a caller turns it off
    # (`watch`, whose reload rebuilds a delta whatever the engine holds).
    assert "delta_base_check" not in rpc.PreflightCall(source="s").kwargs()
    assert rpc.PreflightCall(source="s", delta_base_check=False).kwargs()["delta_base_check"] is False
    # Sent only when on: a server of an earlier version still answers the usual call.
    assert "allow_nonfinite" not in rpc.PreflightCall(source="s").kwargs()
    assert rpc.PreflightCall(source="s", allow_nonfinite=True).kwargs()["allow_nonfinite"] is True
