"""Buffers derived at load (views of a parameter), found by vLLM's own record; and `--verify`'s verdict on
what it could not check. Toy modules recorded by vLLM's real `record_metadata_for_reloading`; no engine."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from layerwise_cli.cli._reload_view import render_verify
from layerwise_cli.report.records import DerivedRefresh
from layerwise_cli.report.reload_report import ReloadReport, merge_reports
from layerwise_cli.report.verify_result import merge_verify, verify_failure
from layerwise_cli.worker.repairs.derived_state import (
    expected_alias_value,
    find_derived_state,
    refresh_alias_buffers,
)
from tests.support.reports import report_of


class _Mixer(torch.nn.Module):
    """As vLLM's Mamba2 mixer: `conv_weights`, a non-persistent buffer viewing `conv1d.weight`, made at init."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter(torch.zeros(6, 1, 4), requires_grad=False)
        self.conv1d.bias = torch.nn.Parameter(torch.zeros(6), requires_grad=False)
        self.D = torch.nn.Parameter(torch.zeros(6), requires_grad=False)
        self.register_buffer("conv_weights", self.conv1d.weight.view(6, 4), persistent=False)
        # Not derived from a weight, and recorded by vLLM: never an alias.
        self.register_buffer("cache", torch.arange(3.0), persistent=False)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = _Mixer()

    def load_weights(self, weights):
        for name, tensor in weights:
            self.get_parameter(name).data.copy_(tensor)
        return set()


def _loaded(values: torch.Tensor) -> _Model:
    """A model recorded for reloading (as vLLM does before loading), then loaded with VALUES."""
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    model = _Model()
    record_metadata_for_reloading(model)
    model.load_weights([("mixer.conv1d.weight", values)])
    return model


def _repack(model: _Model) -> None:
    """What vLLM's CPU backend does after loading (`dispatch_cpu_unquantized_gemm`): a new storage."""
    weight = model.mixer.conv1d.weight
    weight.data = weight.data.view(6, 4).t().contiguous().clone()


def test_a_view_that_still_shares_its_parameter_is_live_and_never_refreshed():
    """GPU: nothing repacks, vLLM's in-place copy keeps the view current; the repair must not act."""
    model = _loaded(torch.randn(6, 1, 4))
    state = find_derived_state(model)
    assert [(a.name, a.source, a.parameter, a.live) for a in state.aliases] == [
        ("mixer.conv_weights", "mixer.conv1d", "weight", True)]
    assert state.unknown == {} and state.stale_after_reload() == []
    assert refresh_alias_buffers(model, state, lambda parent: pytest.fail("nothing to refresh")) == []


def test_a_view_left_on_the_load_time_storage_is_found_and_refreshed_from_source():
    a, b = torch.randn(6, 1, 4), torch.randn(6, 1, 4)
    model = _loaded(a)
    _repack(model)
    state = find_derived_state(model)
    (alias,) = state.aliases
    assert (alias.name, alias.source, alias.parameter, alias.live) == ("mixer.conv_weights", "mixer.conv1d",
                                                                     "weight", False)
    assert state.on_module("mixer") == {"conv_weights"}
    pointer = model.mixer.conv_weights.data_ptr()
    assert torch.equal(model.mixer.conv_weights, a.view(6, 4))
    # A reload wrote B into the repacked parameter; the view still holds A.
    source = {"mixer.conv1d": [("mixer.conv1d.weight", b)]}
    assert torch.equal(expected_alias_value(model, alias, source["mixer.conv1d"]), b.view(6, 4))
    refreshed = refresh_alias_buffers(model, state, source.get)
    assert [(r["module"], r["tensor"]) for r in refreshed] == [("mixer", "conv_weights")]
    assert "mixer.conv1d.weight" in refreshed[0]["reason"]
    assert torch.equal(model.mixer.conv_weights, b.view(6, 4))
    assert model.mixer.conv_weights.data_ptr() == pointer  # in place
    # A source without that layer leaves the buffer alone.
    assert refresh_alias_buffers(model, state, lambda parent: None) == []


def test_a_buffer_whose_source_cannot_be_told_is_unknown():
    model = _loaded(torch.randn(6, 1, 4))
    _repack(model)
    # Two parameters of the buffer's size below its module: ambiguous, never guessed.
    model.mixer.other = torch.nn.Module()
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    model.mixer.other.weight = torch.nn.Parameter(torch.zeros(6, 1, 4), requires_grad=False)
    record_metadata_for_reloading(model.mixer.other)
    state = find_derived_state(model)
    assert state.aliases == () and list(state.unknown) == ["mixer.conv_weights"]
    assert "mixer.conv1d.weight" in state.unknown["mixer.conv_weights"]


def _worker(statuses: dict[str, str]) -> dict:
    layers = [{"name": name, "status": status, "detail": f"{name} {status}", "compared": ["weight"]}
              for name, status in statuses.items()]
    checked = sum(1 for s in statuses.values() if s in ("match", "mismatch"))
    return {"layers": layers, "tensors_compared": checked, "kernels_compared": 0}


def test_a_layer_verify_could_not_check_fails_it_unless_accepted():
    worker = _worker({"model.embed_tokens": "match", "model.layers.0.mixer.conv_weights": "skipped"})
    strict = merge_verify([worker])
    assert not strict.ok and not strict.unchecked_accepted
    assert verify_failure(strict) == ("--verify: 1 layer(s) could not be checked: model.layers.0.mixer.conv_weights: "
                                      "model.layers.0.mixer.conv_weights skipped (--allow-unchecked accepts them)")
    accepted = merge_verify([worker], allow_unchecked=True)
    assert accepted.ok and accepted.unchecked_accepted
    # Accepting unchecked layers never accepts a difference.
    assert not merge_verify([_worker({"a": "mismatch", "b": "skipped"})], allow_unchecked=True).ok
    # Nothing skipped: nothing was accepted, and the output has nothing to repeat.
    assert not merge_verify([_worker({"a": "match"})], allow_unchecked=True).unchecked_accepted


def test_the_verdict_line_never_puts_not_checked_beside_success(capsys):
    worker = _worker({"model.embed_tokens": "match", "model.layers.0.mixer": "skipped"})
    render_verify(merge_verify([worker]), "engine")
    strict = capsys.readouterr().out
    assert "1 not checked: verify fails" in strict and "not checked: model.layers.0.mixer" in strict
    render_verify(merge_verify([worker], allow_unchecked=True), "engine")
    accepted = capsys.readouterr().out
    assert "1 NOT CHECKED, accepted by --allow-unchecked" in accepted.splitlines()[0]


def test_the_report_lists_every_refreshed_tensor_in_json_and_merges_them_once():
    entry = DerivedRefresh(module="model.layers.0.mixer", tensor="conv_weights", reason="a view of conv1d.weight")
    report = report_of(order="layer", source="b", wall_s=0.1, bytes=1, tensors=1, peak_buffer_bytes=1,
                       peak_tensor="x", predicted_peak_buffer_bytes=1, largest_layer_bytes=1, refreshed=[entry])
    data = report.to_dict()
    assert data["refreshed"] == [{"module": "model.layers.0.mixer", "tensor": "conv_weights",
                                  "reason": "a view of conv1d.weight"}]
    assert ReloadReport.from_dict(data) == report
    ranks = [replace(report, placement=replace(report.placement, rank=rank, position={"tp_rank": rank}))
             for rank in (0, 1)]
    assert merge_reports(ranks).findings.refreshed == (entry,)
