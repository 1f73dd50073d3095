"""Rank-local planning, the merged per-rank report and per-engine failures: our own logic, no engine.

The model trees here are real torch modules shaped like vLLM's Qwen3 model on
one pipeline stage (vLLM's own `PPMissingLayer` where another stage's layers
are); the expert-parallel module is a fake that answers vLLM's expert-map API.
"""

from __future__ import annotations

import pytest
import torch

from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.client.servers.api import HOLDS_MIXED, HOLDS_NEW, HOLDS_PREVIOUS, _engines_failure
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.report.records import LayerReport
from layerwise_cli.report.reload_report import ReloadReport, first_failure, merge_reports
from layerwise_cli.report.verify_result import merge_verify
from layerwise_cli.worker.reload.preflight import preflight
from layerwise_cli.worker.stream.rank_plan import RankPosition, plan_for_worker
from tests.support.reports import report_of
from tests.support.synthetic import SyntheticModel, write_checkpoint


def _stage(layers: int, held: range, *, first: bool, last: bool) -> torch.nn.Module:
    """A Qwen3-shaped model holding decoder layers HELD (and the embedding / head on the first / last stage)."""
    from vllm.model_executor.models.utils import PPMissingLayer  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    def parameterised(*names: str) -> torch.nn.Module:
        module = torch.nn.Module()
        for name in names:
            child = torch.nn.Module()
            child.weight = torch.nn.Parameter(torch.zeros(1))
            setattr(module, name, child)
        return module

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = parameterised("x").x if first else PPMissingLayer()
    decoder = []
    for i in range(layers):
        if i not in held:
            decoder.append(PPMissingLayer())
            continue
        layer = parameterised("input_layernorm", "post_attention_layernorm")
        layer.self_attn = parameterised("qkv_proj", "o_proj", "q_norm", "k_norm")
        layer.mlp = parameterised("gate_up_proj", "down_proj")
        decoder.append(layer)
    model.model.layers = torch.nn.ModuleList(decoder)
    model.model.norm = parameterised("x").x if last else PPMissingLayer()
    model.lm_head = parameterised("x").x if last else PPMissingLayer()
    return model


@pytest.fixture
def four_layers(tmp_path):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, SyntheticModel(layers=4), "trainer_export", 3)
    return open_checkpoint(str(folder))


def test_each_stage_plans_only_its_layers(four_layers):
    first = plan_for_worker(four_layers, _stage(4, range(0, 2), first=True, last=False), None,
                            RankPosition(rank=0, pp_size=2))
    last = plan_for_worker(four_layers, _stage(4, range(2, 4), first=False, last=True), None,
                           RankPosition(rank=1, pp_rank=1, pp_size=2))
    names = [{item.entry.name for item in mine.plan.file_order} for mine in (first, last)]
    assert not names[0] & names[1] and names[0] | names[1] == {t.name for t in four_layers.tensors}
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[1]
    assert all(".layers.0." in n or ".layers.1." in n for n in names[0] if ".layers." in n)
    assert first.elsewhere_tensors == len(names[1]) and last.elsewhere_tensors == len(names[0])
    assert first.plan.total_bytes + first.elsewhere_bytes == last.plan.total_bytes + last.elsewhere_bytes
    # In engine names, in layer order; nothing of the other stage.
    stream = last.engine_stream("layer")
    assert stream[-1].parent == "lm_head" and {i.parent for i in stream} >= {"model.layers.2.mlp.gate_up_proj"}
    # Layer order still completes one layer at a time on each stage.
    assert first.plan.simulate("layer").peak_buffer_bytes == first.plan.largest_layer_bytes


def test_preflight_runs_per_stage_against_a_reference_cut_the_same_way(four_layers, tmp_path):
    model = _stage(4, range(2, 4), first=False, last=True)
    mine = plan_for_worker(four_layers, model, None, RankPosition(pp_rank=1, pp_size=2), reference=four_layers)
    assert {t.name for t in mine.reference.tensors} == {i.entry.name for i in mine.plan.file_order}
    preflight(mine.plan, model, mine.vllm_names, mine.reference, allow_partial=False)
    # Tensors of no stage at all (layers 4-9 of a 4-layer model) stay this rank's, and are refused here.
    folder = tmp_path / "wider"
    write_checkpoint(folder, SyntheticModel(layers=10), "in_order", 1)
    wider = open_checkpoint(str(folder))
    mine = plan_for_worker(wider, model, None, RankPosition(pp_rank=1, pp_size=2))
    assert "model.layers.9.mlp.down_proj.weight" in mine.vllm_names
    with pytest.raises(LayerwiseError, match=r"tensor 'model\.layers\.[4-9]\."):
        preflight(mine.plan, model, mine.vllm_names, None, allow_partial=False)


class _Experts(torch.nn.Module):
    """vLLM's routed-experts API as an expert-parallel rank sees it: experts 0-3 of 8 are local."""

    def __init__(self, use_ep: bool) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(1))
        self.moe_config = type("C", (), {"moe_parallel_config": type("P", (), {"use_ep": use_ep})()})()

    def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:
        return expert_id if expert_id < 4 else -1


@pytest.mark.parametrize("use_ep", [True, False])
def test_expert_parallel_ranks_read_only_their_experts(tmp_path, use_ep):
    folder = tmp_path / "moe"
    write_checkpoint(folder, SyntheticModel(layers=1, experts=8), "in_order", 1)
    checkpoint = open_checkpoint(str(folder))
    model = _stage(1, range(1), first=True, last=True)
    model.model.layers[0].mlp = torch.nn.Module()
    model.model.layers[0].mlp.gate = torch.nn.Linear(1, 1)
    model.model.layers[0].mlp.experts = _Experts(use_ep)
    mine = plan_for_worker(checkpoint, model, None)
    experts = {int(name.split(".experts.")[1].split(".")[0]) for name in mine.vllm_names if ".experts." in name}
    assert experts == (set(range(4)) if use_ep else set(range(8)))
    assert mine.elsewhere_tensors == (4 * 3 if use_ep else 0)


def _report(rank, pp, tp, dp, layers, nbytes, peak):
    return report_of(order="layer", source="S", wall_s=1.0, bytes=nbytes, tensors=len(layers),
                     peak_buffer_bytes=peak, peak_tensor="t", predicted_peak_buffer_bytes=peak,
                     largest_layer_bytes=peak, rank=rank, disk_read_bytes=nbytes,
                     position={"rank": rank, "pp_rank": pp, "tp_rank": tp, "dp_rank": dp},
                     layers=[LayerReport(n, 1, nbytes // len(layers), 0.1, 0.1, peak) for n in layers])


def test_merged_report_lists_every_rank_and_adds_up_the_stages():
    reports = [_report(3, 1, 1, 0, ["c", "d"], 60, 7), _report(0, 0, 0, 0, ["a", "b"], 40, 5),
               _report(2, 1, 0, 0, ["c", "d"], 60, 6), _report(1, 0, 1, 0, ["a", "b"], 40, 9)]
    merged = merge_reports(reports)
    placement = merged.placement
    assert [(r.rank, r.pp_rank, r.tp_rank) for r in placement.ranks] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert [layer.name for layer in merged.layers] == ["a", "b", "c", "d"]
    assert merged.bytes == 100 and merged.volume.tensors == 4 and placement.workers == 4 and placement.engines == 1
    assert merged.peak_buffer_bytes == 9 and merged.placement.ranks[2].layers == ("c", "d")
    again = ReloadReport.from_dict(merged.to_dict())
    assert again.placement.ranks == merged.placement.ranks
    # Two data-parallel engines: the engine's bytes, not twice them.
    both = merge_reports([_report(0, 0, 0, 0, ["a"], 40, 5), _report(0, 0, 0, 1, ["a"], 40, 5)])
    assert both.placement.engines == 2 and both.bytes == 40 and [r.dp_rank for r in both.placement.ranks] == [0, 1]


def test_the_failure_reported_is_the_first_hand_one_named_by_rank():
    position = {"rank": 1, "pp_rank": 1, "tp_rank": 0, "dp_rank": 0, "dp_size": 1}
    results = [{"ok": False, "error": "pre-flight failed on another rank", "followed_another_rank": True,
                "position": {**position, "rank": 0, "pp_rank": 0}},
               {"ok": False, "error": "missing 1 tensor", "position": position}]
    assert first_failure(results) == "rank 1 (pp 1, tp 0, dp 0): missing 1 tensor"
    assert first_failure([{"ok": True}]) is None
    assert first_failure([]) == "no workers answered"


def test_a_data_parallel_failure_names_the_engine_and_what_each_holds():
    error = _engines_failure([(None, HOLDS_NEW, False), ("NaN in x", HOLDS_PREVIOUS, True)], "/ckpt")
    assert str(error).startswith("data-parallel engine 1 of 2: NaN in x")
    assert error.holds == HOLDS_MIXED and error.engines == ["engine 0 holds /ckpt",
                                                           "engine 1 rolled back to its previous weights"]
    alone = _engines_failure([("missing 1 tensor", HOLDS_PREVIOUS, False)], "/ckpt")
    assert str(alone) == "missing 1 tensor; nothing was changed" and alone.holds == HOLDS_PREVIOUS


def test_verify_merges_stages_that_check_different_layers():
    def worker(names, status="match"):
        layers = [{"name": n, "status": status, "detail": "", "compared": ["w"]} for n in names]
        return {"layers": layers, "checked": len(layers), "tensors_compared": len(layers), "kernels_compared": 0}

    merged = merge_verify([worker(["a", "b"]), worker(["c"])])
    assert merged.ok and merged.checked == merged.matched == 3
    assert not merge_verify([worker(["a", "b"]), worker(["c"], "mismatch")]).ok
