"""The planner: peaks derived by hand, layer order's peak, and file order against vLLM's own loader."""

from __future__ import annotations

import glob
import json
import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerwise_cli.checkpoint.format.header import TensorEntry
from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.planning.parents import LayerMapping, mapping_for_config
from layerwise_cli.planning.plan import PlannedTensor, build_plan, simulate_buffering
from tests.support.synthetic import SyntheticModel, write_checkpoint, write_safetensors

# Tiny dense Qwen3, BF16 (2 bytes per element). Tensor bytes:
#   embed_tokens 32x8 = 512          lm_head 32x8 = 512       norm 8 = 16
#   input_layernorm / post_attention_layernorm 8 = 16 each
#   q_proj (2*4)x8 = 128   k_proj (1*4)x8 = 64   v_proj 64   o_proj 8x8 = 128
#   q_norm / k_norm 4 = 8 each
#   gate_proj 24x8 = 384   up_proj 384   down_proj 8x24 = 384
# Parent layers of one decoder layer: qkv_proj 128+64+64 = 256, o_proj 128,
# gate_up_proj 384+384 = 768, down_proj 384, four norms; the largest parent
# layer is gate_up_proj, 768 (embed_tokens and lm_head are 512).
# The vocabulary, 32, is one vLLM pads (to 64): embed_tokens and lm_head never
# complete in vLLM's layer buffer and stay held, from their tensor to the end
# of the stream: HELD = 1024 bytes on top of whatever else is open. Layer
# order streams them last, so its peak is max(largest layer, HELD) = 1024.
DENSE = {"layers": 2, "hidden": 8, "heads": 2, "kv_heads": 1, "head_dim": 4, "intermediate": 24, "vocab": 32}
# The same with 4 experts of moe_intermediate 4: every expert tensor is 4x8 or
# 8x4 = 32 elements = 64 bytes, one expert 192, the experts module of a layer
# 4 x 192 = 768 (12 tensors); the router mlp.gate is 4x8 = 64.
MOE = {**DENSE, "experts": 4, "moe_intermediate": 4}
LARGEST = 768
HELD = 1024


def _report(tmp_path: Path, layout: str, shards: int, **shape: object):
    folder = tmp_path / f"{layout}-{shards}"
    write_checkpoint(folder, SyntheticModel(**shape), layout, shards)
    return inspect_order(str(folder))


def test_shapes_behind_the_hand_derivations() -> None:
    # Guards the hand derivations below against a change in the generator's shapes.
    shapes = dict(SyntheticModel(**DENSE).tensors())
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (8, 24)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (8, 8)
    assert shapes["lm_head.weight"] == (32, 8)


def test_in_order_single_shard(tmp_path: Path) -> None:
    # One shard: all names sorted, so within layer 0 the order is input_layernorm,
    # mlp.down_proj (384, alone), mlp.gate_proj (384 held), mlp.up_proj (384 + 384 = 768,
    # gate_up_proj complete), post_attention_layernorm, self_attn.k_norm,
    # k_proj (64 held), o_proj (64 + 128 = 192), q_norm (72), q_proj (192),
    # v_proj (256, qkv complete). Peak 768 at layer 0's up_proj, one layer open.
    # lm_head and embed_tokens sort first and stay held: + HELD, 3 layers open.
    report = _report(tmp_path, "in_order", 1, **DENSE)
    assert report.plan.largest_layer_bytes == LARGEST
    assert report.file_order_buffering.peak_buffer_bytes == 768 + HELD
    assert report.file_order_buffering.peak_tensor == "model.layers.0.mlp.up_proj.weight"
    assert report.file_order_buffering.peak_open_layers == 3
    assert report.layer_order_buffering.peak_buffer_bytes == HELD
    assert report.layer_order_buffering.peak_tensor == "lm_head.weight"


def test_in_order_four_shards(tmp_path: Path) -> None:
    # 25 tensors in model order split 7/7/7/4. Shard 2 ends with layer 1's
    # q_proj (128 held); shard 3 brings layer 1's gate_proj (128 + 384 = 512),
    # k_proj (576), o_proj and q_norm pass through, v_proj (640) completes
    # qkv_proj -> 384 held (gate_proj). Shard 4 sorts "lm_head.weight" first:
    # 384 + 512 = 896 with gate_up_proj and lm_head open, then down_proj
    # (640 -> 384), up_proj (768, complete). Peak 896 > largest layer 768.
    # With embed_tokens (shard 1) held throughout and lm_head held once read,
    # the same steps give 896 + 512, then down_proj 1408 + 384 = 1792 with
    # embed_tokens, gate_up_proj, lm_head and down_proj open; up_proj reaches
    # 1792 again but not above.
    report = _report(tmp_path, "in_order", 4, **DENSE)
    assert report.file_order_buffering.peak_buffer_bytes == 1792
    assert report.file_order_buffering.peak_tensor == "model.layers.1.mlp.down_proj.weight"
    assert report.file_order_buffering.peak_open_layers == 4
    assert report.layer_order_buffering.peak_buffer_bytes == HELD


def test_split_layer(tmp_path: Path) -> None:
    # Shard 1 holds everything up to layer 1 except its v_proj and up_proj:
    # at its end layer 1's gate_proj 384 + k_proj 64 + q_proj 128 = 576 are held.
    # Shard 2 sorts lm_head first: 576 + 512 = 1088 with gate_up_proj, qkv_proj
    # and lm_head open; up_proj then completes gate_up_proj (960 -> 192) and
    # v_proj completes qkv_proj (256 -> 0).
    # With embed_tokens held from shard 1 (+512) and lm_head never released:
    # lm_head 1600, then up_proj 1984 (embed_tokens, gate_up_proj, qkv_proj,
    # lm_head open), gate_up_proj completes -> 1600 - 384 = 1216.
    report = _report(tmp_path, "split_layer", 2, **DENSE)
    assert report.file_order_buffering.peak_buffer_bytes == 1984
    assert report.file_order_buffering.peak_tensor == "model.layers.1.mlp.up_proj.weight"
    assert report.file_order_buffering.peak_open_layers == 4
    assert report.layer_order_buffering.peak_buffer_bytes == HELD


def test_trainer_export(tmp_path: Path) -> None:
    # One shard per parameter type, taken round-robin over 4 shards:
    #   1: embed, v_proj, post_attention_layernorm, norm
    #   2: input_layernorm, o_proj, gate_proj, lm_head
    #   3: q_proj, q_norm, up_proj      4: k_proj, k_norm, down_proj
    # After shard 1: v_proj of both layers wait (128). After shard 2: + both
    # gate_proj (896). Shard 3 starts with layer 0's up_proj: 896 + 384 = 1280,
    # with qkv_proj and gate_up_proj of both layers open (4 layers).
    # embed_tokens (shard 1) and lm_head (shard 2) are held by then: + HELD,
    # 6 layers open.
    report = _report(tmp_path, "trainer_export", 4, **DENSE)
    assert report.file_order_buffering.peak_buffer_bytes == 1280 + HELD
    assert report.file_order_buffering.peak_tensor == "model.layers.0.mlp.up_proj.weight"
    assert report.file_order_buffering.peak_open_layers == 6
    assert report.layer_order_buffering.peak_buffer_bytes == HELD


def test_experts_spread_moe(tmp_path: Path) -> None:
    # Expert e of every layer goes to shard e % 2; everything else to shard 1.
    # Shard 1 leaves experts 0 and 2 of both layers waiting: 2 layers x 6
    # tensors x 64 = 768. Shard 2 then adds layer 0's experts 1 and 3 (6 x 64):
    # 768 + 384 = 1152 at layer 0's experts.3.up_proj, which completes that
    # layer's experts module (768, 12 tensors); both experts modules were open.
    # embed_tokens and lm_head (shard 1, padded vocabulary) are held: + HELD.
    report = _report(tmp_path, "experts_spread", 2, **MOE)
    assert report.plan.largest_layer_bytes == 768
    experts = {layer.name: layer for layer in report.plan.layers if layer.name.endswith(".experts")}
    assert {name: (layer.tensors, layer.bytes) for name, layer in experts.items()} == {
        "model.layers.0.mlp.experts": (12, 768),
        "model.layers.1.mlp.experts": (12, 768),
    }
    assert report.file_order_buffering.peak_buffer_bytes == 1152 + HELD
    assert report.file_order_buffering.peak_tensor == "model.layers.0.mlp.experts.3.up_proj.weight"
    assert report.file_order_buffering.peak_open_layers == 4
    assert report.layer_order_buffering.peak_buffer_bytes == HELD


def test_layer_order_keeps_model_order(tmp_path: Path) -> None:
    report = _report(tmp_path, "trainer_export", 4, **DENSE)
    names = [layer.name for layer in report.plan.layers]
    assert names[0] == "model.embed_tokens"
    assert names[-2:] == ["model.norm", "lm_head"]
    # The stream puts the layers vLLM holds to the end (padded vocabulary) last.
    streamed = list(dict.fromkeys(item.parent for item in report.plan.layer_order))
    assert streamed == [n for n in names if n not in report.plan.held] + ["model.embed_tokens", "lm_head"]
    layer_indexes = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layer_indexes == sorted(layer_indexes)
    # Every parent layer's tensors are contiguous in layer order.
    seen: list[str] = []
    for item in report.plan.layer_order:
        if not seen or seen[-1] != item.parent:
            assert item.parent not in seen
            seen.append(item.parent)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layout=st.sampled_from(["in_order", "split_layer", "trainer_export", "experts_spread"]),
    layers=st.integers(1, 3),
    experts=st.integers(0, 3),
    shards=st.integers(1, 5),
    hidden=st.sampled_from([4, 8, 16]),
    intermediate=st.sampled_from([4, 8, 40]),
    vocab=st.sampled_from([8, 64]),
)
def test_layer_order_peak_is_the_largest_layer_or_the_held_layers(
    tmp_path_factory: pytest.TempPathFactory, layout: str, layers: int, experts: int, shards: int,
    hidden: int, intermediate: int, vocab: int,
) -> None:
    if layout == "experts_spread":
        experts = max(experts, 1)
    model = SyntheticModel(layers=layers, hidden=hidden, heads=2, kv_heads=1, head_dim=4, intermediate=intermediate,
                           vocab=vocab, experts=experts, moe_intermediate=intermediate)
    folder = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(folder, model, layout, shards)
    report = inspect_order(str(folder))
    largest = max(layer.bytes for layer in report.plan.layers)
    assert largest == report.plan.largest_layer_bytes
    # vocab 8 is padded (to 64): embed_tokens and lm_head are held to the end.
    held = {"model.embed_tokens", "lm_head"} if vocab % 64 else set()
    assert set(report.plan.held) == held
    held_bytes = sum(layer.bytes for layer in report.plan.layers if layer.name in held)
    assert report.layer_order_buffering.peak_buffer_bytes == max(largest, held_bytes) == report.plan.least_peak_bytes
    assert report.file_order_buffering.peak_buffer_bytes >= report.layer_order_buffering.peak_buffer_bytes
    assert report.plan.total_bytes == sum(n * 2 for n in (_numel(s) for _, s in model.tensors()))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# Pure logic of the simulation, on made-up streams.

def _stream(items: list[tuple[str, int]]) -> list[PlannedTensor]:
    return [
        PlannedTensor(TensorEntry(f"t{i}", "U8", (size,), "s", 0, size), parent)
        for i, (parent, size) in enumerate(items)
    ]


def test_simulation_counts_the_tensor_that_completes_a_layer() -> None:
    # a(10) b(5) a(1): after a: 10; after b: 15 (b completes, counted, then
    # freed); after a's last: 11, a completes. Peak 15 at b with 2 layers open.
    sim = simulate_buffering(_stream([("a", 10), ("b", 5), ("a", 1)]))
    assert sim.curve == [10, 15, 11]
    assert (sim.peak_buffer_bytes, sim.peak_index, sim.peak_open_layers) == (15, 1, 2)


def test_simulation_ignores_skipped_tensors() -> None:
    sim = simulate_buffering(_stream([("a", 4), (None, 100), ("a", 4)]))  # type: ignore[list-item]
    assert sim.curve == [4, 4, 8]
    assert sim.peak_buffer_bytes == 8


@given(st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 1000)), min_size=1, max_size=40))
def test_grouped_order_peaks_at_the_largest_layer(items: list[tuple[str, int]]) -> None:
    sizes: dict[str, int] = {}
    for parent, size in items:
        sizes[parent] = sizes.get(parent, 0) + size
    grouped = sorted(items, key=lambda item: item[0])
    assert simulate_buffering(_stream(grouped)).peak_buffer_bytes == max(sizes.values())
    assert simulate_buffering(_stream(items)).peak_buffer_bytes >= max(sizes.values())


# File order against the installed vLLM's own reader.

def _adversarial_checkpoint(folder: Path, with_index: bool) -> None:
    """12 shards named model-1 ... model-12 (natural order != lexicographic order).

    Shard k holds decoder layer k-1, written in reverse name order so that a
    reader going by header order and one going by sorted names disagree; the
    embeddings go to the last shard and the head to the first.
    """
    model = SyntheticModel(layers=12, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=8, vocab=16)
    shapes = dict(model.tensors())
    groups: list[list[str]] = [[] for _ in range(12)]
    for name in shapes:
        if name.startswith("model.layers."):
            groups[int(name.split(".")[2])].append(name)
        elif name == "lm_head.weight":
            groups[0].append(name)
        else:
            groups[11].append(name)
    folder.mkdir(parents=True)
    weight_map = {}
    for k, names in enumerate(groups, start=1):
        shard = f"model-{k}.safetensors"
        write_safetensors(folder / shard, [(n, "BF16", shapes[n]) for n in sorted(names, reverse=True)])
        weight_map.update({n: shard for n in names})
    (folder / "config.json").write_text(json.dumps(model.config()))
    if with_index:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        # A consolidated file next to the shards: vLLM reads only what the index names.
        write_safetensors(folder / "consolidated.safetensors", [("model.norm.weight", "BF16", (8,))])


def _vllm_read_order(folder: Path) -> list[str]:
    """The names in the order vLLM's default loader yields them, through its own functions."""
    weight_utils = pytest.importorskip("vllm.model_executor.model_loader.weight_utils")
    files = glob.glob(os.path.join(folder, "*.safetensors"))
    random.Random(0).shuffle(files)  # the iterator must sort them itself
    files = weight_utils.filter_duplicate_safetensors_files(files, str(folder), "model.safetensors.index.json")
    return [name for name, _ in weight_utils.safetensors_weights_iterator(files, use_tqdm_on_load=False)]


@pytest.mark.slow  # imports vLLM
@pytest.mark.parametrize("with_index", [False, True], ids=["glob", "index"])
def test_file_order_is_what_vllm_reads(tmp_path: Path, with_index: bool) -> None:
    folder = tmp_path / "ckpt"
    _adversarial_checkpoint(folder, with_index)
    ours = [t.entry.name for t in build_plan(open_checkpoint(str(folder)), LayerMapping("generic", None)).file_order]
    theirs = _vllm_read_order(folder)
    assert ours == theirs
    # The case is adversarial: lexicographic shard order or header order would differ.
    lexicographic = sorted(os.listdir(folder))
    assert lexicographic.index("model-10.safetensors") < lexicographic.index("model-2.safetensors")
    assert ours[0] == "lm_head.weight" and ours[-1] == "model.norm.weight"
    assert ours.index("model.layers.1.input_layernorm.weight") < ours.index("model.layers.10.input_layernorm.weight")


@pytest.mark.slow  # imports vLLM
def test_buffering_of_what_vllm_reads(tmp_path: Path) -> None:
    # The simulation, fed vLLM's own read order, gives the plan's file-order peak.
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, SyntheticModel(**DENSE), "trainer_export", 4)
    checkpoint = open_checkpoint(str(folder))
    plan = build_plan(checkpoint, mapping_for_config(checkpoint.config))
    by_name = {t.entry.name: t for t in plan.file_order}
    replay = [by_name[name] for name in _vllm_read_order(folder)]
    assert simulate_buffering(replay, held=plan.held).peak_buffer_bytes == plan.simulate("file").peak_buffer_bytes
    assert plan.simulate("file").peak_buffer_bytes == 1280 + HELD
