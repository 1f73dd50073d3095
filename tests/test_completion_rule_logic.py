"""vLLM's completion rule as the planner knows it: padded vocabularies and partly covered fused layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerwise_cli.checkpoint.format.header import TensorEntry
from layerwise_cli.planning.completion_rule import (
    HeldLayer,
    padded_vocab,
    partial_fused_hold,
    vocab_hold,
    vocab_shard_rows,
)
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.planning.parents import _USUAL_FUSIONS as _DENSE_PACKED
from layerwise_cli.planning.plan import PlannedTensor, simulate_buffering
from tests.support.producers import Producer, save_pretrained_checkpoint
from tests.support.synthetic import SyntheticModel, write_checkpoint, write_safetensors

VOCABS = [1, 10, 63, 64, 65, 128, 130, 160, 192, 1000, 50257, 151643, 151936]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_vocab_rule_equals_vllms_own_shard_indices(tp: int) -> None:
    """Our rows per rank are what vLLM's VocabParallelEmbedding computes, for every rank."""
    vocab_module = pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")
    for vocab in VOCABS:
        padded = vocab_module.pad_vocab_size(vocab, vocab_module.DEFAULT_VOCAB_PADDING_SIZE)
        assert padded_vocab(vocab) == padded
        if padded % tp:
            continue  # vLLM refuses to build this layer
        for rank in range(tp):
            indices = vocab_module.VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp)
            loaded, partition = vocab_shard_rows(vocab, tp, rank)
            assert loaded == indices.num_org_elements, (vocab, tp, rank)
            assert partition == indices.num_elements_padded == padded // tp, (vocab, tp, rank)


def test_vllms_vocab_loader_copies_only_the_checkpoint_rows() -> None:
    """The element count vLLM's layer buffer sees for an embedding: the checkpoint's rows, not the padding.

    vLLM's `get_numel_loaded` counts `copy_` calls (`CopyCounter`); the
    padding rows are `fill_`ed. This is why a padded layer never completes.
    """
    torch = pytest.importorskip("torch")
    meta = pytest.importorskip("vllm.model_executor.model_loader.reload.meta")
    vocab_module = pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")

    class Layer:  # the attributes `VocabParallelEmbedding.weight_loader` reads, for TP 1
        shard_indices = vocab_module.VocabParallelEmbedding._get_indices(192, 192, 160, 160, 0, 1)
        org_vocab_size = 160

    param = torch.nn.Parameter(torch.empty(192, 8), requires_grad=False)
    param.output_dim = 0
    with meta.CopyCounter() as counter:
        vocab_module.VocabParallelEmbedding.weight_loader(Layer(), param, torch.ones(160, 8))
    assert counter.copied_numel == 160 * 8 < param.numel()
    assert vocab_shard_rows(160, 1, 0) == (160, 192)


def test_vocab_hold_reasons() -> None:
    assert vocab_hold("model.embed_tokens", 192) is None
    assert vocab_hold("model.embed_tokens", 160) == HeldLayer(
        "model.embed_tokens", "vocabulary padded 160 -> 192", (0,))
    # With tensor parallelism the padding falls on the last rank(s) only.
    assert vocab_hold("lm_head", 160, 2) == HeldLayer(
        "lm_head", "vocabulary padded 160 -> 192; rank 1 of 2 fills 64 of its 96 rows", (1,))
    assert vocab_hold("lm_head", 130, 4) == HeldLayer(
        "lm_head", "vocabulary padded 130 -> 192; ranks 2, 3 of 4 fill 34, 0 of their 48 rows", (2, 3))
    assert vocab_hold("lm_head", 128, 2) is None


def test_partial_fused_hold() -> None:
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qk"]
    hold = partial_fused_hold("model.layers.0.self_attn.qkv_proj", names, _DENSE_PACKED, None)
    assert hold is not None and hold.reason == "v_proj.weight not in the checkpoint"
    everything = names + ["model.layers.0.self_attn.v_proj.weight"]
    assert partial_fused_hold("model.layers.0.self_attn.qkv_proj", everything, _DENSE_PACKED, None) is None
    # A bias present on some members must be present on all.
    with_bias = everything + ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"]
    hold = partial_fused_hold("model.layers.0.self_attn.qkv_proj", with_bias, _DENSE_PACKED, None)
    assert hold is not None and hold.reason == "v_proj.bias not in the checkpoint"
    # A checkpoint that already stores the fused module is complete.
    fused = ["model.layers.0.self_attn.qkv_proj.weight"]
    assert partial_fused_hold("model.layers.0.self_attn.qkv_proj", fused, _DENSE_PACKED, None) is None
    # Not a fused layer: nothing to miss.
    assert partial_fused_hold("model.layers.0.self_attn.o_proj", ["model.layers.0.self_attn.o_proj.weight"],
                              _DENSE_PACKED, None) is None


def test_partial_experts_hold() -> None:
    layer = "model.layers.1.mlp.experts"
    names = [f"{layer}.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    config = {"num_experts": 4}
    assert partial_fused_hold(layer, names, _DENSE_PACKED, config) is None
    missing_one = [n for n in names if n != f"{layer}.2.up_proj.weight"]
    hold = partial_fused_hold(layer, missing_one, _DENSE_PACKED, config)
    assert hold is not None and hold.reason == "expert 2 of 4 not in the checkpoint"
    hold = partial_fused_hold(layer, names, _DENSE_PACKED, {"num_experts": 6})
    assert hold is not None and hold.reason == "experts 4, 5 of 6 not in the checkpoint"
    # Without a count in config.json the rule cannot tell: no hold claimed.
    assert partial_fused_hold(layer, missing_one, _DENSE_PACKED, None) is None


def _stream(items: list[tuple[str, int]]) -> list[PlannedTensor]:
    return [PlannedTensor(TensorEntry(f"t{i}", "U8", (size,), "s", 0, size), parent)
            for i, (parent, size) in enumerate(items)]


def test_simulation_keeps_held_layers_to_the_end() -> None:
    # h(5) is held: it stays after its only tensor; a completes at its second tensor.
    stream = _stream([("a", 10), ("h", 5), ("a", 1), ("b", 3)])
    assert simulate_buffering(stream).curve == [10, 15, 11, 3]
    assert simulate_buffering(stream, held={"h"}).curve == [10, 15, 16, 8]


# Checkpoints written by transformers' save_pretrained (tests/producers.py):
# Qwen3, hidden 64, 2 layers. Largest layer 32 KiB (qkv_proj and gate_up_proj,
# 256 x 64 bf16 each); embed_tokens and lm_head 160 x 64 bf16 = 20 KiB each.
LARGEST = 32768
VOCAB_LAYER = 160 * 64 * 2


@pytest.fixture(scope="module")
def producer_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("producers")
    out = {}
    for producer in (Producer("qwen3", tied=False, vocab_size=160), Producer("qwen3", tied=True, vocab_size=160),
                     Producer("qwen3", tied=False, vocab_size=192), Producer("llama", tied=False, vocab_size=160)):
        out[producer.label] = save_pretrained_checkpoint(root / producer.label, producer, seed=1)
    return out


def test_untied_padded_producer_checkpoint(producer_checkpoints: dict[str, Path]) -> None:
    for label in ("qwen3-untied-v160-64KB", "llama-untied-v160-64KB"):
        report = inspect_order(str(producer_checkpoints[label]))
        plan = report.plan
        assert plan.largest_layer_bytes == LARGEST
        assert {name: hold.reason for name, hold in plan.held.items()} == {
            "model.embed_tokens": "vocabulary padded 160 -> 192", "lm_head": "vocabulary padded 160 -> 192"}
        # Held layers stream last; layer order then holds both at the end: 40 KiB > 32 KiB.
        streamed = list(dict.fromkeys(item.parent for item in plan.layer_order))
        assert streamed[-2:] == ["model.embed_tokens", "lm_head"]
        assert report.layer_order_buffering.peak_buffer_bytes == 2 * VOCAB_LAYER == plan.least_peak_bytes
        assert "vocabulary padded 160 -> 192" in report.layer_order_excess_reason()
        # File order cannot do better (tests/test_padded_engine.py measures both in the engine).
        assert report.file_order_buffering.peak_buffer_bytes >= report.layer_order_buffering.peak_buffer_bytes


def test_tied_padded_producer_checkpoint(producer_checkpoints: dict[str, Path]) -> None:
    report = inspect_order(str(producer_checkpoints["qwen3-tied-v160-64KB"]))
    assert list(report.plan.held) == ["model.embed_tokens"]
    # One held layer of 20 KiB: layer order is back at the largest layer.
    assert report.layer_order_buffering.peak_buffer_bytes == LARGEST
    assert report.layer_order_excess_reason() is None
    assert report.file_order_buffering.peak_buffer_bytes > LARGEST


def test_unpadded_producer_checkpoint(producer_checkpoints: dict[str, Path]) -> None:
    report = inspect_order(str(producer_checkpoints["qwen3-untied-v192-64KB"]))
    assert report.plan.held == {}
    assert report.layer_order_buffering.peak_buffer_bytes == report.plan.largest_layer_bytes


def test_tensor_parallel_moves_the_hold_to_the_last_rank(producer_checkpoints: dict[str, Path]) -> None:
    folder = str(producer_checkpoints["qwen3-untied-v160-64KB"])
    one, two = inspect_order(folder), inspect_order(folder, tensor_parallel_size=2)
    assert {hold.ranks for hold in two.plan.held.values()} == {(1,)}
    assert two.plan.held_on(0) == frozenset()
    # The prediction is the rank that buffers most: rank 1, as with one rank.
    assert two.file_order_buffering.rank == 1
    assert two.file_order_buffering.peak_buffer_bytes == one.file_order_buffering.peak_buffer_bytes
    assert two.plan.simulate("file", rank=0).peak_buffer_bytes < two.file_order_buffering.peak_buffer_bytes
    # 192 rows split over 2 ranks: 96 each; a vocabulary of 192 splits evenly and is held nowhere.
    assert inspect_order(str(producer_checkpoints["qwen3-untied-v192-64KB"]), tensor_parallel_size=2).plan.held == {}


def test_partial_synthetic_checkpoint_holds_the_fused_layer(tmp_path: Path) -> None:
    """A checkpoint without one v_proj (what --allow-partial accepts): its qkv_proj never completes in vLLM."""
    model = SyntheticModel(layers=2, hidden=64, vocab=128)
    folder = tmp_path / "partial"
    write_checkpoint(folder, model, "in_order", 1)
    shapes = [(n, "BF16", s) for n, s in model.tensors() if n != "model.layers.0.self_attn.v_proj.weight"]
    write_safetensors(folder / "model.safetensors", shapes)
    report = inspect_order(str(folder))
    assert {name: hold.reason for name, hold in report.plan.held.items()} == {
        "model.layers.0.self_attn.qkv_proj": "v_proj.weight not in the checkpoint"}
    assert report.plan.layer_order[-1].parent == "model.layers.0.self_attn.qkv_proj"


def test_synthetic_padded_vocabulary(tmp_path: Path) -> None:
    model = SyntheticModel(layers=2, vocab=160)  # the producers' shapes: hidden 64, intermediate 128
    folder = tmp_path / "padded"
    write_checkpoint(folder, model, "trainer_export", 4)
    report = inspect_order(str(folder))
    assert set(report.plan.held) == {"model.embed_tokens", "lm_head"}
    assert report.layer_order_buffering.peak_buffer_bytes == 2 * VOCAB_LAYER
    assert report.plan.largest_layer_bytes == LARGEST


def test_generic_mapping_applies_only_the_vocabulary_rule(tmp_path: Path) -> None:
    model = SyntheticModel(layers=1, hidden=64, vocab=100)
    path = tmp_path / "alone.safetensors"  # no config.json: the generic mapping
    write_safetensors(path, [(n, "BF16", s) for n, s in model.tensors()
                             if n != "model.layers.0.self_attn.v_proj.weight"])
    report = inspect_order(str(path))
    assert report.plan.mapping.kind == "generic"
    assert set(report.plan.held) == {"model.embed_tokens", "lm_head"}
