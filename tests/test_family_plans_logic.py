"""How the planner follows vLLM's loader on the families the sweep once refused: our own logic, no engine.

Each case is a rule read from vLLM 0.32's source: a container module's own
persistent buffer (Gemma 4's `layer_scalar`), renames a model applies in a
helper of its `load_weights` (ERNIE-4.5-MoE's `_preprocess`) or in an inner
model's `hf_to_vllm_mapper` (Granite MoE's `GraniteMoeModel`), tensors vLLM's
reload writes straight into the engine (`SKIP_LOAD_TENSORS`, the Transformers
backend's `lm_head.bias`), and the Transformers backend's fusions, which it
forms only where the model has every part. The engine tests prove the
predictions against vLLM's buffers; these pin the rules.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from layerwise_cli.checkpoint.format.header import TensorEntry
from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.planning.completion_rule import DIRECT_LOAD_TENSORS
from layerwise_cli.planning.parents import mapping_for_config, merged_parts
from layerwise_cli.planning.plan import PlannedTensor, build_plan, simulate_buffering
from layerwise_cli.worker.stream.rank_plan import _aliases, holder_of_parameters, takes_checkpoint_tensors
from tests.support.synthetic import write_safetensors


def _checkpoint(tmp_path, architecture: str, tensors: dict[str, tuple[int, ...]], **config):
    """A one-shard checkpoint of bf16 zeros named TENSORS, with `config.json` naming ARCHITECTURE."""
    folder = tmp_path / architecture
    folder.mkdir(parents=True)
    write_safetensors(folder / "model.safetensors", [(name, "BF16", shape) for name, shape in tensors.items()])
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture], **config}))
    return open_checkpoint(str(folder))


def test_the_planner_copies_vllms_direct_loads() -> None:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    meta = Path(spec.origin).parent / "model_executor" / "model_loader" / "reload" / "meta.py"
    tree = ast.parse(meta.read_text())
    value = next(node.value for node in tree.body if isinstance(node, ast.AnnAssign)
                 and getattr(node.target, "id", "") == "SKIP_LOAD_TENSORS")
    assert ast.literal_eval(value) == DIRECT_LOAD_TENSORS


def test_a_direct_load_counts_only_while_it_is_handed_over() -> None:
    def item(name: str, size: int, parent: str, buffered: bool = True) -> PlannedTensor:
        return PlannedTensor(TensorEntry(name, "U8", (size,), "s", 0, size), parent, buffered)

    # ERNIE's gate: the correction bias first (sorted), written straight in; the weight completes the gate alone.
    stream = [item("gate.e_score_correction_bias", 16, "gate", buffered=False), item("gate.weight", 100, "gate"),
              item("experts.w", 50, "experts"), item("experts.v", 50, "experts")]
    sim = simulate_buffering(stream, "layer")
    assert sim.curve == [16, 100, 50, 100]
    assert sim.peak_buffer_bytes == 100
    # Buffered with the weight, the bias would keep the gate open: the old prediction, 16 bytes too high.
    assert simulate_buffering([item(t.entry.name, t.entry.nbytes, t.parent) for t in stream]).curve[:2] == [16, 116]


def test_ernie_renames_its_statistics_to_the_gate_and_loads_them_directly(tmp_path) -> None:
    name = "model.layers.1.mlp.moe_statics.e_score_correction_bias"
    checkpoint = _checkpoint(tmp_path, "Ernie4_5_MoeForCausalLM", {
        name: (1, 4), "model.layers.1.mlp.gate.weight": (4, 8),
        **{f"model.layers.1.mlp.experts.{e}.{p}.weight": (8, 8) for e in range(4)
           for p in ("gate_proj", "up_proj", "down_proj")}}, moe_num_experts=4)
    mapping = mapping_for_config(checkpoint.config)
    assert mapping.parent_of(name).name == "model.layers.1.mlp.gate"
    plan = build_plan(checkpoint, mapping)
    assert {item.entry.name: item.buffered for item in plan.file_order}[name] is False
    assert plan.simulate("layer").peak_buffer_bytes == plan.largest_layer_bytes == 12 * 64 * 2


@pytest.mark.parametrize("architecture", ["GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
                                          "GraniteMoeSWAForCausalLM"])
def test_granite_moe_plans_its_fused_experts_under_the_names_its_inner_model_gives(architecture: str) -> None:
    mapping = mapping_for_config({"architectures": [architecture]})
    layer = "model.layers.0.block_sparse_moe"
    assert mapping.parent_of(f"{layer}.input_linear.weight").name == f"{layer}.experts"
    assert mapping.parent_of(f"{layer}.output_linear.weight").name == f"{layer}.experts"
    assert mapping.parent_of(f"{layer}.router.layer.weight").name == f"{layer}.gate"
    # Granite MoE Shared's own shared MLP keeps its names: the rename is the legacy experts' suffix only.
    assert mapping.parent_of("model.layers.0.shared_mlp.input_linear.weight").name == \
        "model.layers.0.shared_mlp.input_linear"


def test_the_transformers_backend_fuses_only_what_the_checkpoint_has(tmp_path) -> None:
    # Arcee's MLP is up_proj and down_proj alone (ReLU^2, no gate): the backend's GLU fuser finds nothing.
    tensors = {"model.embed_tokens.weight": (192, 8), "lm_head.weight": (192, 8),
               **{f"model.layers.0.self_attn.{p}.weight": (8, 8) for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
               "model.layers.0.mlp.up_proj.weight": (16, 8), "model.layers.0.mlp.down_proj.weight": (8, 16)}
    plan = build_plan(_checkpoint(tmp_path, "ArceeForCausalLM", tensors, vocab_size=192), mapping_for_config(
        {"architectures": ["ArceeForCausalLM"]}))
    parents = {item.entry.name: item.parent for item in plan.file_order}
    assert parents["model.layers.0.mlp.up_proj.weight"] == "model.layers.0.mlp.up_proj"
    assert parents["model.layers.0.self_attn.k_proj.weight"] == "model.layers.0.self_attn.qkv_proj"
    # A gated model on the same backend still fuses gate and up (OLMo2).
    olmo = mapping_for_config({"architectures": ["Olmo2ForCausalLM"]})
    assert olmo.for_tensors(["m.mlp.gate_proj.weight", "m.mlp.up_proj.weight"]).packed["up_proj"] == "gate_up_proj"


def test_the_transformers_backends_head_bias_is_loaded_directly_and_holds_the_head(tmp_path) -> None:
    # Phi on the Transformers backend: vocabulary 160, padded to 192; the bias is registered anew on every load.
    tensors = {"model.embed_tokens.weight": (160, 8), "lm_head.weight": (160, 8), "lm_head.bias": (160,),
               "model.layers.0.mlp.fc1.weight": (16, 8), "model.final_layernorm.weight": (8,)}
    for vocab in (160, 192):
        sized = {name: ((vocab, *shape[1:]) if shape[0] == 160 else shape) for name, shape in tensors.items()}
        plan = build_plan(_checkpoint(tmp_path / str(vocab), "PhiForCausalLM", sized, vocab_size=vocab),
                          mapping_for_config({"architectures": ["PhiForCausalLM"]}))
        assert "lm_head" in plan.held, vocab  # padded or not: the count waits for the bias it never gets
        assert "registers it anew" in plan.held["lm_head"].reason
        bias = next(item for item in plan.file_order if item.entry.name == "lm_head.bias")
        assert not bias.buffered
        # Held to the end: the head's weight (and the padded embedding's), the bias only while it is handed over.
        weights = (2 if vocab == 160 else 1) * vocab * 8 * 2
        assert plan.simulate("layer").peak_buffer_bytes == weights


def test_the_transformers_backend_loads_a_tied_heads_bias() -> None:
    # CTRL: the head is tied to the embeddings, and vLLM's Transformers backend takes `lm_head.bias` before
    # its tied-head skip (`TransformersForCausalLM.load_weights`): the weight is skipped, the bias loaded.
    config = {"architectures": ["CTRLLMHeadModel"], "tie_word_embeddings": True}
    mapping = mapping_for_config(config)
    assert mapping.backend == "transformers"
    assert mapping.skip_reason("lm_head.weight") is not None
    assert mapping.skip_reason("lm_head.bias") is None
    assert mapping.parent_of("lm_head.bias").name == "lm_head"
    # On vLLM's own model classes a tied head is skipped whole, bias included (GPT-2 has none to skip).
    assert mapping_for_config({"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}).skip_reason(
        "lm_head.bias") is not None


def test_the_transformers_backend_plans_only_the_fusions_the_engine_formed() -> None:
    # BioGPT: the checkpoint has q/k/v, but the backend's fusers do not recognise its attention: no qkv_proj.
    mapping = mapping_for_config({"architectures": ["BioGptForCausalLM"]})
    assert mapping.backend == "transformers" and mapping.packed.get("q_proj") == "qkv_proj"
    # BioGPT: the backend's fusers leave q_proj (scaled in the forward) and merge k_proj and v_proj.
    merged = "merged_proj_6_k_proj_6_v_proj"
    engine = ["biogpt.layers.0.self_attn.q_proj", f"biogpt.layers.0.self_attn.{merged}", "biogpt.layers.0.fc1"]
    kept = mapping.for_engine(engine)
    assert "q_proj" not in kept.packed
    assert kept.parent_of("biogpt.layers.0.self_attn.q_proj.weight").name == "biogpt.layers.0.self_attn.q_proj"
    for part in ("k_proj", "v_proj"):
        assert kept.parent_of(f"biogpt.layers.0.self_attn.{part}.bias").name == \
            f"biogpt.layers.0.self_attn.{merged}"
    # An engine that formed qkv_proj keeps the fusion; vLLM's own classes are left as they are.
    assert mapping.for_engine([engine[0], "biogpt.layers.0.self_attn.qkv_proj"]).packed["k_proj"] == "qkv_proj"
    llama = mapping_for_config({"architectures": ["LlamaForCausalLM"]})
    assert llama.for_engine(engine) is llama


@pytest.mark.parametrize(("leaf", "parts"), [("merged_proj_6_k_proj_6_v_proj", ("k_proj", "v_proj")),
                                             ("merged_proj_3_a_b_1_c", ("a_b", "c")),
                                             ("merged_proj_1_a_3_b_c", ("a", "b_c")),
                                             ("qkv_proj", ()), ("merged_proj_9_k", ()), ("merged_proj_x_k", ())])
def test_the_transformers_backends_merged_names_are_read_back(leaf: str, parts: tuple[str, ...]) -> None:
    assert merged_parts(leaf) == parts


def test_a_container_modules_persistent_buffer_makes_it_a_parent() -> None:
    layer = torch.nn.Module()
    layer.register_buffer("layer_scalar", torch.ones(1))  # Gemma 4's decoder layer
    rotary = torch.nn.Module()
    rotary.register_buffer("cos_sin_cache", torch.ones(4), persistent=False)  # derived, not loaded
    assert takes_checkpoint_tensors(layer) and not takes_checkpoint_tensors(rotary)
    assert not takes_checkpoint_tensors(None)
    assert mapping_for_config({"architectures": ["Gemma4ForCausalLM"]}).parent_of(
        "model.layers.3.layer_scalar").name == "model.layers.3"


def test_experts_beside_a_router_resolve_to_the_experts_module() -> None:
    class RoutedExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w13_weight = torch.nn.Parameter(torch.zeros(1))

        def get_expert_mapping(self) -> list:
            return []

    runner = torch.nn.Module()  # vLLM's MoERunner on the Transformers backend (Mellum)
    runner.gate = torch.nn.Linear(1, 1)
    runner.routed_experts = RoutedExperts()
    model = torch.nn.Module()
    model.experts = runner
    modules = dict(model.named_modules())
    assert holder_of_parameters(modules, "experts") == "experts.routed_experts"
    assert holder_of_parameters(modules, "experts.gate") == "experts.gate"
    # A decoder layer owning `layer_scalar` is its own holder, not the one experts module under it (Gemma 4).
    layer = torch.nn.Module()
    layer.register_buffer("layer_scalar", torch.ones(1))
    layer.experts = runner
    layer.self_attn = torch.nn.Linear(1, 1)
    modules = dict(layer.named_modules())
    assert holder_of_parameters(modules, "") == ""
    del layer.layer_scalar
    assert holder_of_parameters(dict(layer.named_modules()), "") == ""  # several holders, no experts parent


def test_a_router_registered_twice_is_found_under_the_checkpoints_name() -> None:
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = torch.nn.Module()
    gate = torch.nn.Linear(1, 1)
    model.mlp.experts.gate = gate  # vLLM's experts runner holds the router (Transformers backend, Mellum) ...
    model.mlp.gate = gate  # ... which stays where the checkpoint has it too
    modules = dict(model.named_modules())
    assert "mlp.gate" not in modules
    assert _aliases(model, modules) == {"mlp.gate": "mlp.experts.gate"}


def test_gemma4s_kv_shared_layers_and_router_are_planned_as_its_loader_and_vllms_count_do(tmp_path) -> None:
    config = {"num_hidden_layers": 4, "num_kv_shared_layers": 2}
    mapping = mapping_for_config({"architectures": ["Gemma4ForCausalLM"], **config})
    assert mapping.kv_shared_from == 2
    # Layers 2 and 3 read an earlier layer's KV cache: `q_proj` alone, their K/V dropped by the loader.
    assert mapping.parent_of("model.layers.1.self_attn.q_proj.weight").name == "model.layers.1.self_attn.qkv_proj"
    assert mapping.parent_of("model.layers.2.self_attn.q_proj.weight").name == "model.layers.2.self_attn.q_proj"
    for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
        assert mapping.parent_of(f"model.layers.3.self_attn.{name}") is None
        assert "KV-shared" in mapping.skip_reason(f"model.layers.3.self_attn.{name}")
    assert mapping.parent_of("model.layers.3.self_attn.q_norm.weight") is not None
    # The router owns `scale` and `per_expert_scale` and a derived `root_size` vLLM counts: held to the end.
    tensors = {"model.embed_tokens.weight": (192, 8), "model.layers.0.router.scale": (8,),
               "model.layers.0.router.per_expert_scale": (4,), "model.layers.0.router.proj.weight": (4, 8),
               "model.layers.0.layer_scalar": (1,)}
    plan = build_plan(_checkpoint(tmp_path, "Gemma4ForCausalLM", tensors, vocab_size=192, **config), mapping)
    assert set(plan.held) == {"model.layers.0.router"}
    assert "derived buffer" in plan.held["model.layers.0.router"].reason
    assert "model.layers.0" in {layer.name for layer in plan.layers}  # `layer_scalar`: a parent of its own
