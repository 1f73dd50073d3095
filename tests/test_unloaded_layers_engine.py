"""A reload in which vLLM could not load a layer it was handed says no, and leaves the engine as it was.

gpt-oss's `load_weights` writes its attention sinks and fused routed experts
with a bare `param.copy_`, which vLLM's layerwise reload cannot see: vLLM
logs `Failed to load weights` and puts the old tensors back, and its reload
returns as if it had succeeded. layerwise lists those layers by vLLM's own
count, fails the reload, rolls the engine back and names them;
`allow_unchecked` keeps today's reload, with a note.
"""

from __future__ import annotations

import pytest

import layerwise_cli
from layerwise_cli.errors import LayerwiseError
from tests.support.engine_support import engine_state, greedy_with_logprobs
from tests.support.in_process import start_here, stop_here
from tests.support.producers import PADDED_VOCAB, Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

PROMPTS = ["The capital of France is", "1, 2, 3,"]
# Every attention layer (its sinks) and every routed-expert layer of the two-layer model.
UNLOADED = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    producer = Producer("gpt_oss", vocab_size=PADDED_VOCAB, max_shard_size="150KB")
    a = save_pretrained_checkpoint(root / "A", producer, seed=1)
    b = save_pretrained_checkpoint(root / "B", producer, seed=2)
    llm = start_here(str(a))
    try:
        yield llm, a, b
    finally:
        stop_here(llm)


def test_a_reload_vllm_cannot_complete_fails_rolled_back_naming_the_layers(gpt_oss):
    llm, _, b = gpt_oss
    answers, state = greedy_with_logprobs(llm, PROMPTS), engine_state(llm)["checksums"]
    with pytest.raises(LayerwiseError) as failed:
        layerwise_cli.reload(llm, str(b))
    message = str(failed.value)
    assert "vLLM could not load 4 layer(s) it was handed" in message, message
    for name in UNLOADED:
        assert name in message
    assert "rolled back" in message and "\n" not in message
    # Nothing was lost: the engine holds and answers what it did before.
    assert engine_state(llm)["checksums"] == state
    assert greedy_with_logprobs(llm, PROMPTS) == answers


def test_allow_unchecked_keeps_the_reload_and_says_which_layers_kept_their_weights(gpt_oss):
    llm, a, b = gpt_oss
    before = engine_state(llm)["checksums"]
    report = layerwise_cli.reload(llm, str(b), allow_unchecked=True)
    note = next(n for n in report.notes if "could not load" in n)
    assert all(name in note for name in UNLOADED) and "accepted by --allow-unchecked" in note
    after = engine_state(llm)["checksums"]
    changed = {name for name in after if after[name] != before.get(name)}
    # The layers vLLM loaded changed; the sinks and routed experts did not.
    assert any(".qkv_proj." in name for name in changed)
    assert not any(name.endswith(".sinks") or ".experts." in name for name in changed), sorted(changed)
    layerwise_cli.reload(llm, str(a), allow_unchecked=True)  # back to A for the next test
