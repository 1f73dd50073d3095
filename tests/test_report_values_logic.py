"""Reports and checkpoints are values: built once, sequences as tuples, JSON as before."""

from __future__ import annotations

import json

import pytest

from layerwise_cli.checkpoint.format.header import ShardHeader, TensorEntry
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.client.servers.reload_servers import ServerResult
from layerwise_cli.report.records import LayerReport
from layerwise_cli.report.reload_report import ReloadReport, merge_reports
from layerwise_cli.report.sections import Timings
from layerwise_cli.report.verify_result import VerifyResult, merge_verify
from tests.support.reports import report_of

# The JSON keys of a report (`--json`, the workers' HTTP answers), one flat object as before the report had
# sections: a key renamed or moved under a section would break clients and servers of another version.
FLAT_KEYS = {
    "order", "source", "commit", "wall_s", "bytes", "tensors", "peak_buffer_bytes", "peak_tensor",
    "predicted_peak_buffer_bytes",
    "largest_layer_bytes", "readahead_peak_bytes", "layers", "workers", "rank", "unexpected", "mapping", "device",
    "finalize_s", "notes", "verify", "held_to_end_bytes", "above_largest_layer_because", "position",
    "elsewhere_tensors", "elsewhere_bytes", "fetched_bytes", "disk_read_bytes", "ranks", "engines", "skipped_layers",
    "skipped_bytes",
    "read_bytes", "engine_id", "all_layers", "digests", "stale_layers", "hash_s", "fingerprint_s", "read_s",
    "sample_s", "check_s", "handover_s", "vllm_s", "hashed_after_handover", "unhashed_layers", "hash_wait_s",
    "reader_cpus", "spot_checked_layers", "spot_check_bytes", "spot_check_s", "stale_header_digests", "refreshed",
    "in_place_layers", "in_place_bytes", "patched_layers", "patched_bytes", "rebuilt_layers", "rebuilt_reason",
    "patch_s", "plan_s",
    "gb_per_s", "peak_over_largest_layer", "matches_prediction",
}


def _report(rank: int = 0, **changes) -> ReloadReport:
    layers = [LayerReport("model.embed_tokens", 1, 1000, 0.0, 0.01, 1000),
              LayerReport("model.norm", 1, 10, 0.0, 0.0, 10, completed_during_stream=False)]
    fields = dict(order="layer", source="/cache/abc", wall_s=0.5, bytes=1010, tensors=2, peak_buffer_bytes=1000,
                  peak_tensor="t", predicted_peak_buffer_bytes=1000, largest_layer_bytes=1000, layers=layers,
                  rank=rank, unexpected=["x"], notes=["a note"])
    return report_of(**{**fields, **changes})


def _verify(**changes) -> VerifyResult:
    fields = dict(ok=False, checked=2, matched=1, tensors_compared=2, kernels_compared=0,
                  mismatched=["model.norm"], skipped={"attn": "attention"}, details={"model.norm": "differs"},
                  derived={"lm_head": "model.embed_tokens"}, wall_s=0.25)
    return VerifyResult(**{**fields, **changes})


def test_lists_given_are_kept_as_tuples():
    report = _report()
    assert isinstance(report.layers, tuple) and isinstance(report.findings.unexpected, tuple)
    assert report.findings.notes == ("a note",)
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
                                 "held_to_end": None, "skipped": None, "in_place": False, "patched": False}
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
    assert merged.placement.source == "org/model" and merged.verify == _verify()
    assert merged.placement.workers == workers
    assert all(r.placement.source == "/cache/abc" and r.verify is None for r in reports)
    assert merge_reports(reports).placement.source == "/cache/abc"


def test_merge_verify_takes_the_callers_wall_time():
    answer = {"layers": [{"name": "n", "status": "match", "detail": "", "compared": ["weight"]}], "checked": 1,
              "matched": 1, "tensors_compared": 1, "kernels_compared": 0}
    assert merge_verify([answer], wall_s=1.5).wall_s == 1.5
    assert merge_verify([answer]).ok


def test_the_json_keeps_its_flat_keys_and_reads_an_older_workers_report():
    data = merge_reports([_report(0), _report(1)], verify=_verify()).to_dict()
    assert set(data) == FLAT_KEYS
    # A worker of the version before sections also sent reading into place, now gone: its keys are ignored.
    older = {**data, "read_into_place_layers": 1, "read_into_place_bytes": 10,
             "layers": [{**layer, "read_into_place": True} for layer in data["layers"]]}
    assert ReloadReport.from_dict(older).to_dict() == data


def test_the_headline_figures_read_their_sections():
    report = _report(wall_s=2.0, bytes=4e9, verify=_verify())
    assert (report.wall_s, report.bytes, report.gb_per_s) == (2.0, 4e9, 2.0)
    assert (report.peak_buffer_bytes, report.largest_layer_bytes) == (report.memory.peak_buffer_bytes,
                                                                      report.memory.largest_layer_bytes)
    assert report.verify is report.findings.verify


def test_each_timer_merges_as_its_longest_on_one_worker():
    merged = Timings.merged([Timings(wall_s=1.0, hash_s=3.0, vllm_s=0.5), Timings(wall_s=2.0, hash_s=1.0)])
    assert merged == Timings(wall_s=2.0, hash_s=3.0, vllm_s=0.5)
