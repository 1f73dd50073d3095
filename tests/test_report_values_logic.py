"""Reports and checkpoints are values: built once, sequences as tuples, JSON as before."""

from __future__ import annotations

import json

import pytest

from layerwise_cli.checkpoint.header import ShardHeader, TensorEntry
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.client.remote import ServerResult
from layerwise_cli.report.reload_report import ReloadReport, merge_reports
from layerwise_cli.report.report_parts import LayerReport
from layerwise_cli.report.verify_result import VerifyResult, merge_verify


def _report(rank: int = 0, **changes) -> ReloadReport:
    layers = [LayerReport("model.embed_tokens", 1, 1000, 0.0, 0.01, 1000),
              LayerReport("model.norm", 1, 10, 0.0, 0.0, 10, completed_during_stream=False)]
    fields = dict(order="layer", source="/cache/abc", wall_s=0.5, bytes=1010, tensors=2, peak_buffer_bytes=1000,
                  peak_tensor="t", predicted_peak_buffer_bytes=1000, largest_layer_bytes=1000, layers=layers,
                  rank=rank, unexpected=["x"], notes=["a note"])
    return ReloadReport(**{**fields, **changes})


def _verify(**changes) -> VerifyResult:
    fields = dict(ok=False, checked=2, matched=1, tensors_compared=2, kernels_compared=0,
                  mismatched=["model.norm"], skipped={"attn": "attention"}, details={"model.norm": "differs"},
                  derived={"lm_head": "model.embed_tokens"}, wall_s=0.25)
    return VerifyResult(**{**fields, **changes})


def test_lists_given_are_kept_as_tuples():
    report = _report()
    assert isinstance(report.layers, tuple) and isinstance(report.unexpected, tuple)
    assert report.notes == ("a note",)
    assert _verify().mismatched == ("model.norm",)
    assert ServerResult("http://x", warnings=["w"]).warnings == ("w",)
    shard = ShardHeader("a.safetensors", 2, 10, tensors=[TensorEntry("t", "F32", (1,), "a.safetensors", 0, 4)])
    assert Checkpoint("ckpt", "directory", [shard]).shards == (shard,)


def test_json_has_lists_and_round_trips():
    report = merge_reports([_report()], verify=_verify())
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data  # no tuple left: to_dict is what the JSON output holds
    assert data["notes"] == ["a note"] and data["verify"]["mismatched"] == ["model.norm"]
    assert data["layers"][1] == {"name": "model.norm", "tensors": 1, "bytes": 10, "load_s": 0.0, "process_s": 0.0,
                                 "buffered_bytes_at_completion": 10, "completed_during_stream": False,
                                 "held_to_end": None, "skipped": None, "in_place": False,
                                 "read_into_place": False}
    assert ReloadReport.from_dict(data) == report
    assert VerifyResult.from_dict(_verify().to_dict()) == _verify()


def test_a_server_result_serializes_its_report_and_verification():
    result = ServerResult("http://x", ok=True, stage="done", report=_report(), verify=_verify(), warnings=("w",))
    data = result.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["warnings"] == ["w"] and data["report"]["gb_per_s"] == _report().gb_per_s
    assert data["verify"] == _verify().to_dict()


@pytest.mark.parametrize("workers", [1, 2])
def test_merge_names_the_source_and_carries_the_verification_without_changing_its_inputs(workers):
    reports = [_report(rank) for rank in range(workers)]
    merged = merge_reports(reports, source="org/model", verify=_verify())
    assert merged.source == "org/model" and merged.verify == _verify() and merged.workers == workers
    assert all(r.source == "/cache/abc" and r.verify is None for r in reports)
    assert merge_reports(reports).source == "/cache/abc"


def test_merge_verify_takes_the_callers_wall_time():
    answer = {"layers": [{"name": "n", "status": "match", "detail": "", "compared": ["weight"]}], "checked": 1,
              "matched": 1, "tensors_compared": 1, "kernels_compared": 0}
    assert merge_verify([answer], wall_s=1.5).wall_s == 1.5
    assert merge_verify([answer]).ok
