"""The reload report: merging workers' reports, JSON round trip, and the table a person reads."""

from __future__ import annotations

import io
from dataclasses import replace

from rich.console import Console

from layerwise_cli.cli import _reload_view
from layerwise_cli.report.records import LayerReport
from layerwise_cli.report.reload_report import ReloadReport, merge_reports
from tests.support.reports import report_of


def rendered(monkeypatch, report: ReloadReport, *, width: int, **options) -> str:
    """What `render_report` prints for REPORT on a terminal WIDTH columns wide (no colour)."""
    out = io.StringIO()
    monkeypatch.setattr(_reload_view, "stdout", Console(file=out, width=width, no_color=True))
    _reload_view.render_report(report, **options)
    return out.getvalue()

def report(rank: int, peak: int, load: float) -> ReloadReport:
    layers = [
        LayerReport("model.embed_tokens", 1, 1000, 0.0, 0.01, 1000),
        LayerReport("model.layers.0.self_attn.qkv_proj", 3, 3000, load, 0.02, 3000),
        LayerReport("model.layers.0.self_attn.attn", 0, 0, 0.0, 0.0, 0, completed_during_stream=False),
    ]
    return report_of(order="layer", source="ckpt", wall_s=0.5 + rank, bytes=4000, tensors=4,
                     peak_buffer_bytes=peak, peak_tensor=f"t{rank}", predicted_peak_buffer_bytes=3000,
                     largest_layer_bytes=3000, readahead_peak_bytes=100 * (rank + 1), layers=layers, rank=rank,
                     notes=[f"note {rank % 2}"])


def test_merge_takes_per_worker_maxima_not_sums():
    merged = merge_reports([report(0, 3000, 0.1), report(1, 3500, 0.3)])
    assert merged.placement.workers == 2
    assert merged.wall_s == 1.5
    assert merged.peak_buffer_bytes == 3500 and merged.memory.peak_tensor == "t1"
    assert merged.bytes == 4000  # every worker streams the same checkpoint
    assert merged.layers[1].load_s == 0.3
    assert merged.memory.readahead_peak_bytes == 200
    assert merged.findings.notes == ("note 0", "note 1")
    assert not merged.matches_prediction
    assert merged.layers[2].completed_during_stream is False


def test_json_round_trip_keeps_everything():
    original = report(0, 3000, 0.1)
    data = original.to_dict()
    for key in ("wall_s", "bytes", "peak_buffer_bytes", "largest_layer_bytes", "layers", "order", "gb_per_s"):
        assert key in data
    assert data["matches_prediction"] is True
    again = ReloadReport.from_dict(data)
    assert again == original


def test_table_shows_layers_totals_and_flags_a_difference(monkeypatch):

    text = rendered(monkeypatch, merge_reports([report(0, 3000, 0.1), report(1, 3500, 0.3)]), title="Reload [x]",
                    width=80)
    assert "layers.0.self_attn.qkv_proj" in text  # names fit an 80-column terminal unbroken
    assert "Reload [x]" in text  # user data is escaped, not read as markup
    assert "(finalize)" in text
    assert "DIFFERS" in text
    assert "2 worker(s)" in text


def held_report(rank: int, predicted: int, held: bool) -> ReloadReport:
    """A rank of a TP 2 reload with a padded vocabulary: only rank 1 holds embed_tokens to the end."""
    reason = "vocabulary padded 160 -> 192; rank 1 of 2 fills 64 of its 96 rows" if held else None
    layers = [
        LayerReport("model.layers.0.mlp.gate_up_proj", 2, 3000, 0.0, 0.01, 3000),
        LayerReport("model.embed_tokens", 1, 2000, 0.0, 0.01, 2000, completed_during_stream=not held,
                    held_to_end=reason),
    ]
    because = None if predicted <= 3000 else f"vLLM holds model.embed_tokens to the end ({reason})"
    return report_of(order="layer", source="ckpt", wall_s=0.5, bytes=5000, tensors=3,
                     peak_buffer_bytes=predicted, peak_tensor="t", predicted_peak_buffer_bytes=predicted,
                     largest_layer_bytes=3000, layers=layers, rank=rank, held_to_end_bytes=2000 if held else 0,
                     above_largest_layer_because=because)


def test_merge_takes_the_prediction_of_the_rank_that_holds_most():
    merged = merge_reports([held_report(0, 3000, False), held_report(1, 3000, True)])
    assert merged.memory.predicted_peak_buffer_bytes == 3000 and merged.matches_prediction
    assert merged.memory.held_to_end_bytes == 2000
    assert merged.layers[1].held_to_end.startswith("vocabulary padded 160 -> 192")
    assert merged.layers[1].completed_during_stream is False
    higher = merge_reports([held_report(0, 3000, False), held_report(1, 5000, True)])
    assert higher.memory.predicted_peak_buffer_bytes == 5000 and higher.memory.above_largest_layer_because
    assert ReloadReport.from_dict(higher.to_dict()) == higher


def test_table_names_held_layers_and_why_the_peak_is_above_the_largest_layer(monkeypatch):

    text = " ".join(rendered(monkeypatch, merge_reports([held_report(0, 3000, False), held_report(1, 5000, True)]),
                             width=120).split())
    assert "held to end embed_tokens (vocabulary padded 160 -> 192; rank 1 of 2 fills 64 of its 96 rows)" in text
    assert "above the largest layer: vLLM holds model.embed_tokens to the end" in text
    assert "embed_tokens (finalize)" in text


def test_in_place_layers_merge_as_every_rank_did_them_and_show_in_the_table(monkeypatch):
    """A layer counts as loaded in place only where every rank that holds it loaded it so; the table says how many."""

    def ranked(rank: int, embedding_in_place: bool) -> ReloadReport:
        base = report(rank, 3000, 0.1)
        layers = [replace(base.layers[0], in_place=embedding_in_place), *base.layers[1:]]
        memory = replace(base.memory, in_place_layers=int(embedding_in_place), in_place_bytes=1000 * embedding_in_place)
        return replace(base, layers=layers, memory=memory)

    merged = merge_reports([ranked(0, True), ranked(1, False)])
    assert [layer.in_place for layer in merged.layers] == [False, False, False]
    assert merged.memory.in_place_layers == 1 and merged.memory.in_place_bytes == 1000  # the most on one rank
    both = merge_reports([ranked(0, True), ranked(1, True)])
    assert [layer.in_place for layer in both.layers] == [True, False, False]
    assert ReloadReport.from_dict(both.to_dict()) == both
    assert "1 of 3 layers (1000 B) loaded into the engine's own tensors" in rendered(monkeypatch, both, title="Reload",
                                                                                   width=200)
    assert "none of 3 layers: vLLM materialized each in fresh tensors" in rendered(
        monkeypatch, report(0, 3000, 0.1), title="Reload", width=200)


def test_a_hub_reload_says_what_it_fetched_and_a_local_one_says_nothing(monkeypatch):
    commit = "3f2a" + "0" * 36
    memory = dict(peak_buffer_bytes=4000, peak_tensor="t", predicted_peak_buffer_bytes=4000, largest_layer_bytes=4000)
    fetched = report_of(order="layer", source="org/step", commit=commit, wall_s=0.5, bytes=4000, tensors=4,
                        fetched_bytes=5 << 20, layers=[LayerReport("model.embed_tokens", 1, 4000, 0.0, 0.01, 4000)],
                        **memory)
    text = rendered(monkeypatch, merge_reports([fetched]), width=200, title="Reload")
    line = next(line for line in text.splitlines() if line.startswith("fetched"))
    assert "5.00 MiB" in line and f"org/step@{commit}" in line
    local = report_of(order="layer", source="ckpt", wall_s=0.5, bytes=4000, tensors=4,
                      layers=[LayerReport("model.embed_tokens", 1, 4000, 0.0, 0.01, 4000)], **memory)
    assert not any(line.startswith("fetched") for line in rendered(monkeypatch, local, width=200,
                                                                    title="Reload").splitlines())
