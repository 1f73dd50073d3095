"""Loading in place on a real engine whose linear layers keep the loaded layout.

On AVX-512 and AMX CPUs vLLM moves every dense linear weight into a packed
kernel handle (the stored weight is emptied), so only the embedding, the head
and the norms load in place there (`tests/test_equivalence_engine.py`). Where
oneDNN has no bf16 matmul (AVX2 CPUs) vLLM falls back to `F.linear` on the
stored weight, which keeps its layout, as on a GPU: then the fused linear
layers (qkv, gate/up) load in place too. This test makes vLLM's own CPU
dispatch take that fallback on any CPU (no oneDNN, no SGL kernel), in this
process, and proves the engine ends bit for bit where vLLM's fresh tensors
leave it, with its storage kept, answering as an engine started fresh on the
new weights under the same dispatch.
"""

from __future__ import annotations

import os

import pytest

from layerwise_cli.client.engine.in_process import EngineOptions, reload
from layerwise_cli.engine_defaults import FRESH_BUFFERS_ENV
from tests.support.cpu_kernels import take_linear_fallback
from tests.support.engine_support import differing_prompts, engine_state, greedy_with_logprobs
from tests.support.in_process import start_here, stop_here
from tests.support.producers import Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

PROMPTS = [f"{a} {b} = " for a, b in [(1, 2), (3, 4), (15, 7), (99, 0), (42, 42), (8, 13), (5, 55), (60, 6),
                                      (21, 12), (7, 70)]]
LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture
def linear_weights_kept(monkeypatch):
    """vLLM's CPU GEMM dispatch as on an AVX2 CPU: no oneDNN and no SGL kernel, so `F.linear` on the stored weight."""
    take_linear_fallback(monkeypatch.setattr)


def options():
    return EngineOptions(max_model_len=64)


def test_linear_layers_vllm_keeps_as_loaded_load_in_place_too(linear_weights_kept, tmp_path):
    a = save_pretrained_checkpoint(tmp_path / "a", Producer("qwen3", max_shard_size="96KB"), seed=1)
    b = save_pretrained_checkpoint(tmp_path / "b", Producer("qwen3", max_shard_size="40KB"), seed=2)
    fresh = start_here(str(b), options())
    try:
        want = greedy_with_logprobs(fresh, PROMPTS)
    finally:
        stop_here(fresh)

    llm = start_here(str(a), options())
    try:
        before = engine_state(llm)
        assert "model.layers.0.self_attn.qkv_proj.weight" in before["pointers"], "the linear weight was not kept"
        os.environ[FRESH_BUFFERS_ENV] = "1"
        try:
            through_fresh = reload(llm, str(b))
        finally:
            del os.environ[FRESH_BUFFERS_ENV]
        fresh_state = engine_state(llm)
        fresh_answers = greedy_with_logprobs(llm, PROMPTS)
        reload(llm, str(a))
        report = reload(llm, str(b))
        state = engine_state(llm)
        got = greedy_with_logprobs(llm, PROMPTS)
    finally:
        stop_here(llm)

    assert through_fresh.memory.in_place_layers == 0
    in_place = {layer.name for layer in report.layers if layer.in_place}
    linear = {layer.name for layer in report.layers if layer.name.endswith(LINEAR)}
    assert len(linear) == 4 * 2 and linear <= in_place, sorted(linear - in_place)
    assert {"model.embed_tokens", "lm_head", "model.norm"} <= in_place
    assert report.memory.in_place_layers == len(in_place)
    assert state["pointers"] == before["pointers"] == fresh_state["pointers"]
    assert state["checksums"] == fresh_state["checksums"] != before["checksums"]
    assert not differing_prompts(got, fresh_answers, exact=True)
    assert not differing_prompts(got, want), "the reloaded engine answers unlike an engine started fresh on B"
