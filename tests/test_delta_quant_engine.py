"""Sparse deltas into an engine that quantizes online (`layerwise_fp8`): A -> B -> A equals fresh FP8 engines.

The rebuilt bf16 tensors are buffered and quantized as each layer completes, as for a full step. Engine
starts: 3 (the engine under test, on A: its first state is A's fresh state; a fresh FP8 engine on B; none
more for A).
"""

from __future__ import annotations

import pytest

from layerwise_cli.client.engine.in_process import EngineOptions, reload
from layerwise_cli.demo import demo_prompt
from tests.support.deltas import write_steps
from tests.support.engine_support import assert_matches_fresh, engine_state, fresh_state, remember_fresh
from tests.support.in_process import start_here, stop_here

pytestmark = pytest.mark.engine

PAIRS = [(3, 4), (2, 5), (9, 9), (7, 8), (1, 6), (4, 4), (8, 2), (6, 3), (5, 7), (0, 9)]


def prompts() -> list[str]:
    return [demo_prompt(a, b) for a, b in PAIRS]


def test_deltas_into_an_fp8_engine_equal_fresh_fp8_engines(demo_models, tmp_path):
    steps = write_steps(tmp_path, demo_models)
    fp8 = EngineOptions(max_model_len=64, quantization="layerwise_fp8")
    # The fresh engine on B first: in this process, where one started beside the engine under test would start
    # with processes of its own (30 s or more).
    fresh_b = fresh_state(steps["B"], prompts(), fp8)
    engine = start_here(str(steps["A"]), fp8)
    try:
        remember_fresh(engine, steps["A"], prompts(), fp8)
        fresh_a = engine_state(engine)["checksums"]
        reload(engine, str(steps["A"]), all_layers=True)
        reload(engine, str(steps["AB"]))
        assert engine_state(engine)["checksums"] == fresh_b
        assert_matches_fresh(engine, steps["B"], prompts(), options=fp8)
        reload(engine, str(steps["BA"]))
        assert engine_state(engine)["checksums"] == fresh_a
        assert_matches_fresh(engine, steps["A"], prompts(), options=fp8)
    finally:
        stop_here(engine)
