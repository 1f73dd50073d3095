"""Sparse deltas into a tensor-parallel engine (TP=2 on CPU): each rank checks its base and rebuilds its shards.

One engine start, on *multiply* (A, bit for bit: `tests/support/deltas.py` writes A from its tensors), whose
first per-rank checksums are A's fresh state.
"""

from __future__ import annotations

import pytest

from layerwise_cli.client.engine.generate import greedy_answers
from layerwise_cli.client.engine.in_process import EngineOptions, call_workers, reload, start_engine, stop_engine
from layerwise_cli.demo import demo_prompt, expected_answer
from layerwise_cli.errors import LayerwiseError
from tests.support.deltas import write_steps

pytestmark = pytest.mark.engine

PAIRS = [(a, b) for a in range(0, 10, 3) for b in range(10)]


def test_deltas_both_ways_on_two_ranks(demo_models, tmp_path, monkeypatch):
    steps = write_steps(tmp_path, demo_models)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    llm = start_engine(str(demo_models["multiply"]), EngineOptions(max_model_len=64, tensor_parallel_size=2))
    try:
        prompts = [demo_prompt(a, b) for a, b in PAIRS]
        fresh_a = [rank["checksums"] for rank in call_workers(llm, "layerwise_checksums")]
        reload(llm, str(steps["A"]), all_layers=True)
        to_b = reload(llm, str(steps["AB"]), verify=True)
        # Both ranks' shards match the full step B, layer by layer.
        assert to_b.placement.workers == 2 and to_b.verify.ok
        assert to_b.verify.checked == to_b.verify.matched == len(to_b.layers)
        same = reload(llm, str(steps["B"]))  # each rank's records say B: skipped whole on both
        assert [rank.skipped_layers for rank in same.placement.ranks] == [len(same.layers)] * 2
        with pytest.raises(LayerwiseError, match="holds other weights"):
            reload(llm, str(steps["AB"]))
        reload(llm, str(steps["BA"]))
        assert [rank["checksums"] for rank in call_workers(llm, "layerwise_checksums")] == fresh_a
        assert greedy_answers(llm, prompts) == [expected_answer("multiply", a, b) for a, b in PAIRS]
    finally:
        stop_engine(llm)
