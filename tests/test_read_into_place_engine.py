"""Reading into place on a real engine: the bytes go from the file straight into the engine's tensors.

Two dispatches of vLLM's CPU GEMM: the engine's own (on an AVX-512 or AMX
CPU the dense linear weights move into packed kernel handles, so only the
embedding, the head and the norms load in place) and, as on an AVX2 CPU or a
GPU, its `F.linear` fallback, where the fused linear layers load in place too
(`test_in_place_engine`). On each: reload A, B, A, B into one engine and
compare every B, every tensor, with what vLLM's own fresh buffers leave, and
the answers with an engine started fresh on B; refuse a NaN in a layer read
into place and roll back; and the switch turns it off.
"""

from __future__ import annotations

import pytest

from tests.support.cpu_kernels import take_linear_fallback
from tests.support.engine_support import differing_prompts, engine_state, greedy_with_logprobs, reshard
from tests.support.in_process import start_here, stop_here
from tests.support.producers import Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

PROMPTS = [f"{a} {b} = " for a, b in [(1, 2), (3, 4), (15, 7), (99, 0), (42, 42), (8, 13), (5, 55), (60, 6)]]
LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(params=["own", "linear-fallback"])
def dispatch(request, monkeypatch):
    """vLLM's CPU GEMM dispatch: this CPU's own, or `F.linear` on the stored weight (AVX2, as on a GPU)."""
    if request.param == "linear-fallback":
        take_linear_fallback(monkeypatch.setattr)
    return request.param


@pytest.fixture
def checkpoints(tmp_path):
    # Real producers: float32 weights sharded small, so most layers straddle shards.
    a = save_pretrained_checkpoint(tmp_path / "a", Producer("qwen3", max_shard_size="96KB"), seed=1)
    b = save_pretrained_checkpoint(tmp_path / "b", Producer("qwen3", max_shard_size="40KB"), seed=2)
    return a, b


def options():
    from layerwise_cli.client.local import EngineOptions

    return EngineOptions(max_model_len=64)


def test_a_b_a_b_reads_into_place_and_every_b_equals_vllms_fresh_buffers(dispatch, checkpoints, monkeypatch):
    from layerwise_cli.client.local import reload
    from layerwise_cli.engine_defaults import FRESH_BUFFERS_ENV, READ_INTO_PLACE_ENV

    a, b = checkpoints
    fresh = start_here(str(b), options())
    try:
        want = greedy_with_logprobs(fresh, PROMPTS)
    finally:
        stop_here(fresh)

    llm = start_here(str(a), options())
    try:
        before = engine_state(llm)
        with monkeypatch.context() as switch:  # the switches are read in this process (the engine's too)
            switch.setenv(FRESH_BUFFERS_ENV, "1")
            reload(llm, str(b))
        vllms = engine_state(llm)  # what vLLM's own fresh buffers leave: the reference for every tensor
        reports, states, answers = [], [], []
        with monkeypatch.context() as switch:
            switch.setenv(READ_INTO_PLACE_ENV, "1")
            for source in (a, b, a, b):
                reports.append(reload(llm, str(source)))
                states.append(engine_state(llm))
                answers.append(greedy_with_logprobs(llm, PROMPTS))
        switched_off = reload(llm, str(a)), reload(llm, str(b))  # the default: off
        off_state = engine_state(llm)
    finally:
        stop_here(llm)

    # The first reload with it on (after one through fresh buffers) knows no loader yet: it only learns.
    assert reports[0].read_into_place_layers == 0
    read = [{layer.name for layer in report.layers if layer.read_into_place} for report in reports[1:]]
    in_place = {layer.name for layer in reports[-1].layers if layer.in_place}
    assert read[0] and read[0] == read[1] == read[2], read
    assert {"model.embed_tokens", "lm_head", "model.norm"} <= read[-1] <= in_place
    if dispatch == "linear-fallback":
        linear = {layer.name for layer in reports[-1].layers if layer.name.endswith(LINEAR)}
        assert len(linear) == 4 * 2 and linear <= read[-1], sorted(linear - read[-1])
    assert reports[-1].read_into_place_bytes > 0
    for i in (1, 3):
        assert states[i]["checksums"] == vllms["checksums"] != before["checksums"], f"reload {i + 1}"
        assert states[i]["pointers"] == before["pointers"]
        assert not differing_prompts(answers[i], want), "the reloaded engine answers unlike a fresh engine on B"
    assert states[2]["checksums"] == before["checksums"]  # A again, after B had changed every tensor
    assert all(report.read_into_place_layers == 0 for report in switched_off)
    assert off_state["checksums"] == vllms["checksums"]


def test_nan_in_a_layer_read_into_place_is_refused_and_rolled_back(dispatch, checkpoints, tmp_path, monkeypatch):
    import torch

    from layerwise_cli.client.local import reload
    from layerwise_cli.engine_defaults import READ_INTO_PLACE_ENV
    from layerwise_cli.errors import LayerwiseError
    from tests.support.engine_support import parameter_kind

    a, b = checkpoints
    key = "model.layers.1.mlp.down_proj.weight" if dispatch == "linear-fallback" else "model.norm.weight"

    def poisoned(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[-1] = torch.nan  # the last element: read in the last chunk
        return tensors

    bad = reshard(b, tmp_path / "bad", parameter_kind, transform=poisoned)
    monkeypatch.setenv(READ_INTO_PLACE_ENV, "1")
    llm = start_here(str(a), options())
    try:
        reload(llm, str(b))  # learns which loaders are plain copies
        known = reload(llm, str(a)).read_into_place_layers  # A is held, read into place
        before = engine_state(llm)
        with pytest.raises(LayerwiseError) as info:
            reload(llm, str(bad))
        after = engine_state(llm)
        again = reload(llm, str(b))  # the next reload reads into place again once one completed
    finally:
        stop_here(llm)

    assert known > 0  # the bad checkpoint's layers are read into place up to the NaN
    text = str(info.value)
    assert "NaN" in text and key in text and "rolled back" in text and "\n" not in text
    assert after["checksums"] == before["checksums"]
    assert after["pointers"] == before["pointers"]
    # A failure forgets what loads in place; the rollback, a completed reload, learns it again.
    assert again.read_into_place_layers > 0
