"""A reload that fails after the engine was touched rolls the engine back to the weights it had.

The failure is real, not injected: the engine was started from a checkpoint
directory that is gone (trainers clean old steps up), so pre-flight has no
reference to check shapes against, and vLLM's own weight loader rejects a
wrong-shaped tensor in the middle of the stream, after earlier layers were
already processed.
"""

from __future__ import annotations

import shutil

import pytest

from layerwise_cli.client.engine.generate import greedy_answers
from layerwise_cli.client.engine.in_process import EngineOptions, reload
from layerwise_cli.demo import demo_prompt, expected_answer
from layerwise_cli.errors import LayerwiseError
from tests.support.engine_support import engine_state, parameter_kind, reshard
from tests.support.in_process import start_here, stop_here

pytestmark = pytest.mark.engine

PAIRS = [(a, b) for a in range(10) for b in range(10)]


def test_failure_mid_stream_rolls_the_engine_back(demo_models, tmp_path):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    started_from = tmp_path / "step-0"
    shutil.copytree(demo_models["multiply"], started_from)

    def wrong_down_proj(tensors):
        # Narrower than the layer: vLLM's loader fails (a wider one it would silently crop).
        key = "model.layers.1.mlp.down_proj.weight"
        tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] - 8, dtype=tensors[key].dtype)
        return tensors

    bad = reshard(demo_models["add"], tmp_path / "bad", parameter_kind, transform=wrong_down_proj)
    prompts = [demo_prompt(a, b) for a, b in PAIRS]
    llm = start_here(str(started_from), EngineOptions(max_model_len=64))
    try:
        reload(llm, str(demo_models["multiply"]))  # the weights it has now come from here
        shutil.rmtree(started_from)
        before = engine_state(llm)
        with pytest.raises(LayerwiseError) as info:
            reload(llm, str(bad))
        text = str(info.value)
        assert "rolled back" in text and str(demo_models["multiply"]) in text and "\n" not in text
        after = engine_state(llm)
        assert after["checksums"] == before["checksums"]
        assert after["pointers"] == before["pointers"]
        assert greedy_answers(llm, prompts) == [expected_answer("multiply", a, b) for a, b in PAIRS]
        # The engine takes the next reload normally.
        reload(llm, str(demo_models["add"]))
        assert greedy_answers(llm, prompts) == [expected_answer("add", a, b) for a, b in PAIRS]
    finally:
        stop_here(llm)


def test_a_reload_vllm_refuses_before_changing_a_weight_is_not_rolled_back(demo_models):
    """vLLM 0.34 refuses a reload up front when its extensible KV cache leaves too little device memory.

    That refusal cannot happen on CPU; here the worker's own `reload_weights` raises vLLM 0.34's message
    before it starts, in an engine in this process (the engine is real, only the refusal is injected). The
    error is one line, says no weight changed, and no rollback runs: a rollback would be refused the same way.
    """
    prompts = [demo_prompt(a, b) for a, b in PAIRS]
    llm = start_here(str(demo_models["multiply"]), EngineOptions(max_model_len=64))
    try:
        client = llm.llm_engine.engine_core
        assert type(client).__name__ == "InprocClient", "this test needs the engine in this process"
        worker = client.engine_core.model_executor.driver_worker.worker
        calls = []

        def refuse(*args, **kwargs):
            calls.append(kwargs)
            raise RuntimeError("Updating weights layer by layer needs about 0.75 GiB of free device memory, at "
                               "least 0.25 GiB for the largest layer alone, but only 0.10 GiB is free beside the "
                               "extensible KV cache. Pause generation with the cache cleared first")

        before = engine_state(llm)
        worker.reload_weights = refuse
        try:
            with pytest.raises(LayerwiseError) as info:
                reload(llm, str(demo_models["add"]))
        finally:
            del worker.reload_weights
        text = str(info.value)
        assert "vLLM refused the reload before changing any weight" in text, text
        assert "largest layer alone" in text and "rolled back" not in text and "\n" not in text
        assert len(calls) == 1, "a rollback ran"
        after = engine_state(llm)
        assert after["checksums"] == before["checksums"] and after["pointers"] == before["pointers"]
        assert greedy_answers(llm, prompts) == [expected_answer("multiply", a, b) for a, b in PAIRS]
        # The engine takes the next reload normally.
        reload(llm, str(demo_models["add"]))
        assert greedy_answers(llm, prompts) == [expected_answer("add", a, b) for a, b in PAIRS]
    finally:
        stop_here(llm)
