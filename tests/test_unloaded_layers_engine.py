"""Layers vLLM's reload cannot load: loaded by layerwise after it, and without that repair a reload that says no.

gpt-oss's `load_weights` writes its attention sinks and fused routed experts
with a bare `param.copy_`, which vLLM's layerwise reload cannot see: vLLM
logs `Failed to load weights`, puts the old tensors back, and its reload
returns as if it had succeeded. layerwise lists those layers by vLLM's own
count (`worker/reload/completion_check.py`) and hands their tensors to the model's
own loader once vLLM has put them back (`worker/repairs/put_back_layers.py`).
With the repairs off (`LAYERWISE_NO_REPAIRS=1`) the reload fails, rolled
back and naming them; `allow_unchecked` keeps it, with a note.
"""

from __future__ import annotations

import pytest

import layerwise_cli
from layerwise_cli.errors import LayerwiseError
from tests.support.engine_support import engine_state, greedy_with_logprobs
from tests.support.in_process import start_here, stop_here
from tests.support.producers import PADDED_VOCAB, Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

PROMPTS = ["The capital of France is", "1, 2, 3,", "hello"]
# Every attention layer (its sinks) and every routed-expert layer of the two-layer model.
UNLOADED = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.0.mlp.experts.routed_experts",
            "model.layers.1.mlp.experts.routed_experts")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    producer = Producer("gpt_oss", vocab_size=PADDED_VOCAB, max_shard_size="150KB")
    a = save_pretrained_checkpoint(root / "A", producer, seed=1)
    b = save_pretrained_checkpoint(root / "B", producer, seed=2)
    fresh = start_here(str(b))
    try:
        # The state after a generate: the rotary cache takes its final form on the first forward pass.
        fresh_b = (greedy_with_logprobs(fresh, PROMPTS), engine_state(fresh)["checksums"])
    finally:
        stop_here(fresh)
    llm = start_here(str(a))
    try:
        llm.answers_a = greedy_with_logprobs(llm, PROMPTS)  # a fresh engine on A: the one under test, not reloaded
        yield llm, a, b, fresh_b
    finally:
        stop_here(llm)


def test_gpt_oss_reloads_equal_to_a_fresh_engine_every_time(gpt_oss):
    """A, B, A, B into one engine: after each B every tensor is byte-equal to a fresh engine's, and its answers."""
    llm, a, b, (answers_b, state_b) = gpt_oss
    for _ in range(2):
        report = layerwise_cli.reload(llm, str(b))
        note = next(n for n in report.findings.notes if "vLLM's reload could not" in n)
        assert all(name in note for name in UNLOADED), note
        assert greedy_with_logprobs(llm, PROMPTS) == answers_b
        state = engine_state(llm)["checksums"]
        assert sorted(name for name in state_b if state.get(name) != state_b[name]) == []
        assert layerwise_cli.reload(llm, str(a)).findings.notes
    assert greedy_with_logprobs(llm, PROMPTS) == llm.answers_a


def test_verify_passes_on_gpt_oss_with_nothing_unchecked(gpt_oss):
    llm, a, b, _ = gpt_oss
    report = layerwise_cli.reload(llm, str(b), verify=True)
    assert report.verify.ok and not report.verify.skipped
    layerwise_cli.reload(llm, str(a))


def test_without_the_repair_the_reload_fails_rolled_back_naming_the_layers(gpt_oss, monkeypatch):
    llm, _, b, _ = gpt_oss
    answers, state = greedy_with_logprobs(llm, PROMPTS), engine_state(llm)["checksums"]
    monkeypatch.setenv("LAYERWISE_NO_REPAIRS", "1")
    with pytest.raises(LayerwiseError) as failed:
        layerwise_cli.reload(llm, str(b))
    message = str(failed.value)
    assert "vLLM could not load 4 layer(s) it was handed" in message, message
    assert all(name in message for name in UNLOADED)
    assert "rolled back" in message and "\n" not in message
    # Nothing was lost: the engine holds and answers what it did before.
    assert engine_state(llm)["checksums"] == state
    assert greedy_with_logprobs(llm, PROMPTS) == answers


def test_allow_unchecked_keeps_the_reload_and_says_which_layers_kept_their_weights(gpt_oss, monkeypatch):
    llm, a, b, _ = gpt_oss
    monkeypatch.setenv("LAYERWISE_NO_REPAIRS", "1")
    before = engine_state(llm)["checksums"]
    report = layerwise_cli.reload(llm, str(b), allow_unchecked=True)
    note = next(n for n in report.findings.notes if "could not load" in n)
    assert all(name in note for name in UNLOADED) and "accepted by --allow-unchecked" in note
    after = engine_state(llm)["checksums"]
    changed = {name for name in after if after[name] != before.get(name)}
    # The layers vLLM loaded changed; the sinks and routed experts did not.
    assert any(".qkv_proj." in name for name in changed)
    assert not any(name.endswith(".sinks") or ".experts." in name for name in changed), sorted(changed)
    monkeypatch.delenv("LAYERWISE_NO_REPAIRS")
    layerwise_cli.reload(llm, str(a))
