"""QeRL on any CPU: reloads into engines that quantize online (`layerwise_fp8`, `layerwise_int8`), for real.

The engine's linear layers hold FP8 (or int8) weights and scales; every
reload streams the trainer's bf16 checkpoint, which vLLM buffers per layer and
quantizes as each layer completes. Checkpoints come from `save_pretrained`
(tests/support/producers.py, Qwen3, 64KB shards).

Engine starts: 3. A fresh FP8 engine on B (the reference), the FP8 engine under
test (started on A: its first answers are A's fresh answers), and one TP=2
int8 engine started on B (its first answers are B's fresh TP=2 answers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerwise_cli.client.engine.in_process import (
    EngineOptions,
    call_workers,
    reload,
    start_engine,
    stop_engine,
    verify_engine,
)
from layerwise_cli.demo import demo_prompt
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.inspect import inspect_order
from tests.support.engine_support import (
    assert_matches_fresh,
    engine_state,
    fresh_answers,
    greedy_with_logprobs,
    load_tensors,
    remember_fresh,
    reshard,
)
from tests.support.in_process import start_here, stop_here
from tests.support.producers import Producer, save_pretrained_checkpoint
from tests.support.quant_tamper import TAMPER_EXTENSION_CLS

pytestmark = pytest.mark.engine

PRODUCER = Producer("qwen3")
PAIRS = [(a, b) for a in range(1, 10, 2) for b in range(0, 10, 4)]  # 15 prompts
LINEAR = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
NAN_TENSOR = "model.layers.1.mlp.down_proj.weight"


def prompts() -> list[str]:
    return [demo_prompt(a, b) for a, b in PAIRS]


def options(quantization: str, tensor_parallel_size: int = 1):
    return EngineOptions(max_model_len=64, quantization=quantization, tensor_parallel_size=tensor_parallel_size,
                         extra={"worker_extension_cls": TAMPER_EXTENSION_CLS})


def quantized_layers(layers: int = PRODUCER.layers) -> set[str]:
    return {f"model.layers.{i}.{name}" for i in range(layers) for name in LINEAR}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A and B (two seeds); M (B with layer 1 from A); B with NaN in one quantized layer's weight."""
    root = tmp_path_factory.mktemp("online-quant")
    a = save_pretrained_checkpoint(root / "A", PRODUCER, seed=1)
    b = save_pretrained_checkpoint(root / "B", PRODUCER, seed=2)
    from_a = load_tensors(a)

    def layer_one_from_a(tensors: dict) -> dict:
        return {name: from_a[name] if name.startswith("model.layers.1.") else tensor
                for name, tensor in tensors.items()}

    def nan_in_down_proj(tensors: dict) -> dict:
        tensors[NAN_TENSOR] = tensors[NAN_TENSOR].clone()
        tensors[NAN_TENSOR][3, 5] = float("nan")
        return tensors

    assert from_a[NAN_TENSOR].dtype == torch.bfloat16  # the trainer's format: what the engine buffers
    return {"A": a, "B": b,
            "M": reshard(b, root / "M", lambda name: name.split(".")[2] if ".layers." in name else "rest",
                         transform=layer_one_from_a),
            "NaN": reshard(b, root / "NaN", lambda name: "all", transform=nan_in_down_proj)}


def _assert_prediction_is_measured(report, source: Path, order: str) -> None:
    """Measured peak == predicted peak == `inspect_order`'s, in checkpoint-format (bf16) bytes; layers complete."""
    predicted = inspect_order(str(source))
    sim = predicted.layer_order_buffering if order == "layer" else predicted.file_order_buffering
    assert report.peak_buffer_bytes == report.memory.predicted_peak_buffer_bytes == sim.peak_buffer_bytes
    assert report.largest_layer_bytes == predicted.plan.largest_layer_bytes
    assert not report.findings.unexpected
    # Every quantized layer completed on the checkpoint's element count, while streaming (scales are not counted).
    by_name = {layer.name: layer for layer in report.layers}
    assert quantized_layers() <= set(by_name)
    assert all(by_name[name].completed_during_stream and not by_name[name].held_to_end for name in quantized_layers())
    # bf16 bytes: 2 per element of the checkpoint tensor, whatever the engine holds.
    gate_up = by_name["model.layers.0.mlp.gate_up_proj"]
    assert gate_up.bytes == 2 * PRODUCER_INTERMEDIATE * 2 * 64
    if order == "layer":
        assert report.peak_buffer_bytes == report.largest_layer_bytes == gate_up.bytes
    else:
        assert report.peak_buffer_bytes >= report.largest_layer_bytes


PRODUCER_INTERMEDIATE = 128  # tests/support/producers.py: hidden 64, intermediate 128


class TestOnlineQuantFp8:
    """One FP8 engine (started on A) and its fresh reference on B, for the class; stopped after it."""

    QUANT = "layerwise_fp8"

    @pytest.fixture(scope="class")
    def fresh_b(self, checkpoints) -> list:
        """An engine started fresh on B with the same method: started (and stopped) before engine A."""
        return fresh_answers(checkpoints["B"], prompts(), options(self.QUANT))

    @pytest.fixture(scope="class")
    def engine(self, checkpoints, fresh_b):

        llm = start_here(str(checkpoints["A"]), options(self.QUANT))
        remember_fresh(llm, checkpoints["A"], prompts(), options(self.QUANT))
        yield llm
        stop_here(llm)

    def test_online_quant_engine_holds_fp8_weights_and_scales(self, engine):
        held = engine.collective_rpc("layerwise_test_quantized")[0]
        assert set(held) == quantized_layers()  # every linear layer; embeddings and the LM head stay bf16
        assert all(tensors == {"weight": "torch.float8_e4m3fn", "weight_scale": "torch.float32"}
                   for tensors in held.values()), held

    @pytest.mark.parametrize("order", ["layer", "file"])
    def test_online_quant_reload_b_matches_fresh_b_then_a_back(self, engine, checkpoints, fresh_b, order):
        before = engine_state(engine)
        report = reload(engine, str(checkpoints["B"]), order=order)
        assert report.unchanged.skipped_layers == 0
        assert_matches_fresh(engine, checkpoints["B"], prompts(), options=options(self.QUANT))
        # A and B answer differently: the reload had something to prove (A's answers are remembered, no start).
        assert fresh_b != fresh_answers(checkpoints["A"], prompts(), options(self.QUANT))
        _assert_prediction_is_measured(report, checkpoints["B"], order)
        # In place: the quantized tensors changed, their storage did not move.
        after = engine_state(engine)
        assert after["pointers"] == before["pointers"]
        changed = {name for name in after["checksums"] if after["checksums"][name] != before["checksums"][name]}
        assert {f"{name}.weight_scale" for name in quantized_layers()} <= changed
        back = reload(engine, str(checkpoints["A"]), order=order)
        assert back.unchanged.skipped_layers == 0
        assert_matches_fresh(engine, checkpoints["A"], prompts(), options=options(self.QUANT), exact=True)
        assert engine_state(engine)["checksums"] == before["checksums"]

    def test_online_quant_nan_refused_and_rolled_back(self, engine, checkpoints):
        reload(engine, str(checkpoints["A"]), all_layers=True)
        before = engine_state(engine)
        held = engine.collective_rpc("layerwise_test_quantized")[0]
        with pytest.raises(LayerwiseError) as info:
            reload(engine, str(checkpoints["NaN"]))  # layer order: layer 0 is already loaded when layer 1 is read
        text = str(info.value)
        assert NAN_TENSOR in text and "rolled back" in text and "\n" not in text
        after = engine_state(engine)
        # The quantized tensors (FP8 weights and their scales) are bit for bit what they were, in place.
        assert after["checksums"] == before["checksums"] and after["pointers"] == before["pointers"]
        assert engine.collective_rpc("layerwise_test_quantized")[0] == held
        assert_matches_fresh(engine, checkpoints["A"], prompts(), options=options(self.QUANT), exact=True)

    def test_online_quant_skips_unchanged_quantized_layers(self, engine, checkpoints, fresh_b):
        reload(engine, str(checkpoints["A"]), all_layers=True)  # every layer recorded as A's
        layer_one = {name for name in quantized_layers() if name.startswith("model.layers.1.")}
        to_m = reload(engine, str(checkpoints["M"]))  # M: B with layer 1 from A
        skipped = {layer.name for layer in to_m.layers if layer.skipped}
        assert layer_one <= skipped and all(name.startswith("model.layers.1.") for name in skipped)
        # From M to B only layer 1 differs: everything else is skipped, quantized layers included.
        to_b = reload(engine, str(checkpoints["B"]))
        handed = {layer.name for layer in to_b.layers if not layer.skipped}
        assert handed == {layer.name for layer in to_b.layers if layer.name.startswith("model.layers.1.")}
        assert layer_one <= handed and quantized_layers() - layer_one <= {
            layer.name for layer in to_b.layers if layer.skipped}
        assert_matches_fresh(engine, checkpoints["B"], prompts(), options=options(self.QUANT))
        # vLLM's own reload writes every layer behind layerwise's back: no quantized layer may be skipped after.
        engine.collective_rpc("reload_weights", kwargs={"weights_path": str(checkpoints["A"])})
        back = reload(engine, str(checkpoints["B"]))
        assert not any(layer.skipped for layer in back.layers if layer.name in quantized_layers())
        assert back.unchanged.stale_layers > 0
        assert_matches_fresh(engine, checkpoints["B"], prompts(), options=options(self.QUANT))

    def test_online_quant_verify_requantizes_and_names_a_flipped_element(self, engine, checkpoints):
        report = reload(engine, str(checkpoints["B"]), all_layers=True, verify=True)
        verify = report.verify
        assert verify.ok and not verify.skipped and not verify.errors, (verify.skipped, verify.errors)
        assert verify.checked == verify.matched == len(report.layers)
        assert verify.quantized == dict.fromkeys(sorted(quantized_layers()), self.QUANT)
        on_b = greedy_with_logprobs(engine, prompts())
        # One bit of one FP8 element, and one bit of one scale: --verify names exactly those layers.
        engine.collective_rpc("layerwise_test_flip", args=("model.layers.0.self_attn.o_proj", "weight"))
        engine.collective_rpc("layerwise_test_flip", args=("model.layers.1.mlp.down_proj", "weight_scale"))
        wrong = verify_engine(engine, str(checkpoints["B"]))
        assert not wrong.ok
        assert sorted(wrong.mismatched) == ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"]
        assert "weight" in wrong.details["model.layers.0.self_attn.o_proj"]
        assert "weight_scale" in wrong.details["model.layers.1.mlp.down_proj"]
        # The records no longer describe those two layers: the same source reloads exactly them.
        fixed = reload(engine, str(checkpoints["B"]), verify=True)
        assert {layer.name for layer in fixed.layers if not layer.skipped} == {
            "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"}
        assert fixed.verify.ok
        assert greedy_with_logprobs(engine, prompts()) == on_b
        # Checked against A, every quantized layer differs.
        assert quantized_layers() <= set(verify_engine(engine, str(checkpoints["A"])).mismatched)


def test_online_quant_tensor_parallel_two_int8(checkpoints, monkeypatch):
    """TP=2, int8 per channel: each rank quantizes its own shard; B -> A -> B equals the engine's start on B."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    quant = "layerwise_int8"
    llm = start_engine(str(checkpoints["B"]), options(quant, tensor_parallel_size=2))
    try:
        fresh_b = remember_fresh(llm, checkpoints["B"], prompts(), options(quant, 2))
        held = llm.collective_rpc("layerwise_test_quantized")
        assert len(held) == 2 and all(set(rank) == quantized_layers() for rank in held)
        assert all(t == {"weight": "torch.int8", "weight_scale": "torch.float32"} for t in held[0].values())
        start_state = call_workers(llm, "layerwise_checksums")
        assert start_state[0]["checksums"] != start_state[1]["checksums"]  # two shards, two sets of scales
        to_a = reload(llm, str(checkpoints["A"]), verify=True)
        assert to_a.placement.workers == 2 and to_a.verify.ok and not to_a.verify.errors
        assert set(to_a.verify.quantized) == quantized_layers()
        assert greedy_with_logprobs(llm, prompts()) != fresh_b
        report = reload(llm, str(checkpoints["B"]))
        assert_matches_fresh(llm, checkpoints["B"], prompts(), options=options(quant, 2), exact=True)
        assert report.peak_buffer_bytes == report.memory.predicted_peak_buffer_bytes
        # Each rank's quantized shards and scales are bit for bit those of the engine's start on B, in place.
        for rank_start, rank_now in zip(start_state, call_workers(llm, "layerwise_checksums")):
            assert rank_now["checksums"] == rank_start["checksums"]
            assert rank_now["pointers"] == rank_start["pointers"]
    finally:
        stop_engine(llm)
