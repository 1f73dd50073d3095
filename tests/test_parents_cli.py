"""Tensor -> parent layer mapping: the table, vLLM's model classes, the generic fallback, naming variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.cli.app import app
from layerwise_cli.planning.arch_table import entry
from layerwise_cli.planning.parents import mapping_for_config
from tests.support.synthetic import SyntheticModel, write_checkpoint

FAMILIES = ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM", "MixtralForCausalLM"]
# The table's other entries, checked against vLLM on the names of the closest family.
RELATIVES = {"Qwen2ForCausalLM": "LlamaForCausalLM", "MistralForCausalLM": "LlamaForCausalLM",
             "Qwen2MoeForCausalLM": "Qwen3MoeForCausalLM"}


def _layer(i: int, names: list[str]) -> list[str]:
    return [f"model.layers.{i}.{n}" for n in names]


_ATTENTION = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight"]


def checkpoint_names(architecture: str, layers: int = 2, experts: int = 3) -> list[str]:
    """Tensor names as these families' Hugging Face checkpoints spell them."""
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        if architecture == "LlamaForCausalLM":
            names += _layer(i, _ATTENTION + ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                             "self_attn.rotary_emb.inv_freq"])
        elif architecture == "MixtralForCausalLM":
            names += _layer(i, _ATTENTION + ["block_sparse_moe.gate.weight"])
            names += _layer(i, [f"block_sparse_moe.experts.{e}.{w}.weight" for e in range(experts)
                                for w in ("w1", "w2", "w3")])
        else:
            model = SyntheticModel(layers=layers, experts=experts if "Moe" in architecture else 0)
            return [name for name, _ in model.tensors()]
    return names + ["model.norm.weight", "lm_head.weight"]


def parents(architecture: str, names: list[str], prefer: str = "table", tied: bool = False) -> dict[str, object]:
    mapping = mapping_for_config({"architectures": [architecture], "tie_word_embeddings": tied}, prefer)
    out: dict[str, object] = {}
    for name in names:
        parent = mapping.parent_of(name)
        out[name] = None if parent is None else (parent.name, parent.order_key)
    return out


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def test_qwen3_maps_exactly() -> None:
    got = parents("Qwen3ForCausalLM", checkpoint_names("Qwen3ForCausalLM"))
    L = "model.layers.1."
    assert got["model.embed_tokens.weight"] == ("model.embed_tokens", (0, 0))
    for part in ("q_proj", "k_proj", "v_proj"):
        assert got[f"{L}self_attn.{part}.weight"] == (f"{L}self_attn.qkv_proj", (1, 1))
    for part in ("gate_proj", "up_proj"):
        assert got[f"{L}mlp.{part}.weight"] == (f"{L}mlp.gate_up_proj", (1, 1))
    for own in ("self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.down_proj",
                "input_layernorm", "post_attention_layernorm"):
        assert got[f"{L}{own}.weight"] == (f"{L}{own}", (1, 1))
    assert got["model.norm.weight"] == ("model.norm", (2, 0))
    assert got["lm_head.weight"] == ("lm_head", (3, 0))
    # 2 layers x 8 modules + embeddings, norm, head.
    assert len({p[0] for p in got.values() if p}) == 2 * 8 + 3


def test_qwen3_moe_maps_exactly() -> None:
    names = checkpoint_names("Qwen3MoeForCausalLM", experts=3)
    got = parents("Qwen3MoeForCausalLM", names)
    L = "model.layers.0."
    experts = [n for n in names if n.startswith(L + "mlp.experts.")]
    assert len(experts) == 9
    assert {got[n] for n in experts} == {(f"{L}mlp.experts", (1, 0))}  # one fused module per layer
    assert got[f"{L}mlp.gate.weight"] == (f"{L}mlp.gate", (1, 0))  # the router is its own layer
    assert got[f"{L}self_attn.k_proj.weight"] == (f"{L}self_attn.qkv_proj", (1, 0))
    # A dense MLP in a MoE model (mlp_only_layers) still fuses gate/up.
    dense = parents("Qwen3MoeForCausalLM", [f"{L}mlp.gate_proj.weight", f"{L}mlp.up_proj.weight"])
    assert set(dense.values()) == {(f"{L}mlp.gate_up_proj", (1, 0))}
    assert len({p[0] for p in got.values() if p}) == 2 * 8 + 3


def test_llama_maps_exactly() -> None:
    got = parents("LlamaForCausalLM", checkpoint_names("LlamaForCausalLM"))
    L = "model.layers.0."
    assert got[f"{L}self_attn.q_proj.weight"] == (f"{L}self_attn.qkv_proj", (1, 0))
    assert got[f"{L}mlp.up_proj.weight"] == (f"{L}mlp.gate_up_proj", (1, 0))
    assert got[f"{L}mlp.down_proj.weight"] == (f"{L}mlp.down_proj", (1, 0))
    assert got[f"{L}self_attn.rotary_emb.inv_freq"] is None  # a buffer vLLM never loads
    assert got["lm_head.weight"] == ("lm_head", (3, 0))
    assert len({p[0] for p in got.values() if p}) == 2 * 6 + 3


def test_mixtral_maps_exactly() -> None:
    names = checkpoint_names("MixtralForCausalLM", experts=3)
    got = parents("MixtralForCausalLM", names)
    L = "model.layers.1."
    experts = [n for n in names if n.startswith(L + "block_sparse_moe.experts.")]
    assert len(experts) == 9
    assert {got[n] for n in experts} == {(f"{L}block_sparse_moe.experts", (1, 1))}
    assert got[f"{L}block_sparse_moe.gate.weight"] == (f"{L}block_sparse_moe.gate", (1, 1))
    assert got[f"{L}self_attn.v_proj.weight"] == (f"{L}self_attn.qkv_proj", (1, 1))
    assert got[f"{L}self_attn.o_proj.weight"] == (f"{L}self_attn.o_proj", (1, 1))
    assert len({p[0] for p in got.values() if p}) == 2 * 6 + 3


@pytest.mark.slow  # imports vLLM
@pytest.mark.parametrize("architecture", FAMILIES + list(RELATIVES))
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_table_equals_vllm(architecture: str, tied: bool) -> None:
    pytest.importorskip("vllm")
    names = checkpoint_names(RELATIVES.get(architecture, architecture))
    # Names a variant of the family may carry: a dense MLP and a shared expert in a MoE model.
    names += ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
              "model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.0.mlp.shared_expert.up_proj.weight",
              "model.layers.0.mlp.shared_expert.down_proj.weight", "model.layers.0.mlp.shared_expert_gate.weight"]
    from_vllm = mapping_for_config({"architectures": [architecture], "tie_word_embeddings": tied}, "vllm")
    assert from_vllm.kind == "vllm"
    assert from_vllm.fused_experts == bool(entry(architecture)["experts"])
    assert parents(architecture, names, "table", tied) == parents(architecture, names, "vllm", tied)


@pytest.mark.slow  # imports vLLM
def test_vllm_mapping_through_the_cli(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    folder = tmp_path / "moe"
    write_checkpoint(folder, SyntheticModel(experts=4), "experts_spread", 3)
    runner = CliRunner()
    table = runner.invoke(app, ["inspect-order", str(folder), "--json", "--top", "0", "--mapping", "table"])
    vllm = runner.invoke(app, ["inspect-order", str(folder), "--json", "--top", "0", "--mapping", "vllm"])
    assert table.exit_code == 0 and vllm.exit_code == 0, (table.stderr, vllm.stderr)
    t, v = json.loads(table.stdout), json.loads(vllm.stdout)
    assert (t["mapping"]["kind"], v["mapping"]["kind"]) == ("table", "vllm")
    for doc in (t, v):
        doc.pop("mapping")
    assert t == v
    assert any(layer["name"] == "model.layers.0.mlp.experts" and layer["tensors"] == 12 for layer in v["layers"])


@pytest.mark.slow  # auto asks vLLM for the unknown architecture: imports vLLM
def test_guess_for_an_unknown_architecture(tmp_path: Path) -> None:
    names = checkpoint_names("LlamaForCausalLM")
    mapping = mapping_for_config({"architectures": ["NoSuchModelForCausalLM"]})
    assert mapping.kind == "guess"
    assert "a guess" in mapping.description and "NoSuchModelForCausalLM" in mapping.description
    got = {n: mapping.parent_of(n) for n in names}
    # One parent per module, with the fusions vLLM applies almost everywhere.
    assert got["model.layers.1.self_attn.q_proj.weight"].name == "model.layers.1.self_attn.qkv_proj"
    assert got["model.layers.1.self_attn.v_proj.weight"].name == "model.layers.1.self_attn.qkv_proj"
    assert got["model.layers.1.mlp.up_proj.weight"].name == "model.layers.1.mlp.gate_up_proj"
    assert got["model.layers.1.mlp.down_proj.weight"].name == "model.layers.1.mlp.down_proj"
    assert got["model.layers.1.self_attn.rotary_emb.inv_freq"] is None
    assert mapping_for_config({"architectures": ["NoSuchMoeForCausalLM"]}).parent_of(
        "model.layers.0.mlp.experts.3.w1.weight").name == "model.layers.0.mlp.experts"
    # The CLI says it is a guess, and how far it can be off.
    folder = tmp_path / "unknown"
    write_checkpoint(folder, SyntheticModel(), "in_order", 2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    result = CliRunner().invoke(app, ["inspect-order", str(folder), "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    guess = data["mapping"]["guess"]
    low, high = guess["layer_order_peak_without_fusions"], guess["layer_order_peak_with_whole_layers_fused"]
    assert low <= data["layer_order"]["peak_buffer_bytes"] <= high and low < high
    generic = CliRunner().invoke(app, ["inspect-order", str(folder), "--json", "--mapping", "generic"])
    assert json.loads(generic.stdout)["layer_order"]["peak_buffer_bytes"] == high
    text = CliRunner().invoke(app, ["inspect-order", str(folder)])
    assert "a guess" in text.stdout and f"between {low} B" in text.stdout.replace("\n", " ")


def test_generic_fallback_without_config() -> None:
    mapping = mapping_for_config(None)
    assert mapping.kind == "generic" and "unknown architecture" in mapping.description


def test_malformed_config_falls_back_to_generic() -> None:
    for config in ({"architectures": "Qwen3ForCausalLM"}, {"architectures": [1]}, {"text_config": []}, []):
        assert mapping_for_config(config).kind == "generic"  # type: ignore[arg-type]


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_prefixed_language_model_names(architecture: str) -> None:
    model = SyntheticModel(layers=2, experts=2 if "Moe" in architecture else 0, prefix="model.language_model.")
    names = [n for n, _ in model.tensors()]
    got = parents(architecture, names)
    P = "model.language_model."
    assert got[f"{P}embed_tokens.weight"] == (f"{P}embed_tokens", (0, 0))
    assert got[f"{P}layers.1.self_attn.q_proj.weight"] == (f"{P}layers.1.self_attn.qkv_proj", (1, 1))
    assert got[f"{P}norm.weight"] == (f"{P}norm", (2, 0))
    assert got["lm_head.weight"] == ("lm_head", (3, 0))
    if model.experts:
        assert got[f"{P}layers.0.mlp.experts.1.down_proj.weight"] == (f"{P}layers.0.mlp.experts", (1, 0))


def test_tied_embeddings_skip_lm_head(tmp_path: Path) -> None:
    names = checkpoint_names("Qwen3ForCausalLM")
    assert parents("Qwen3ForCausalLM", names, tied=True)["lm_head.weight"] is None
    assert parents("Qwen3ForCausalLM", names, tied=False)["lm_head.weight"] == ("lm_head", (3, 0))
    # A tied checkpoint that still carries lm_head: planned as skipped, not as a layer.
    folder = tmp_path / "tied"
    model = SyntheticModel(tie_word_embeddings=False)
    write_checkpoint(folder, model, "in_order", 1)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    result = CliRunner().invoke(app, ["inspect-order", str(folder), "--json", "--top", "0"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["skipped_tensors"] == ["lm_head.weight"]
    assert "lm_head" not in {layer["name"] for layer in data["layers"]}
    # A tied checkpoint without lm_head (what such exports usually write) needs nothing skipped.
    folder2 = tmp_path / "tied2"
    write_checkpoint(folder2, SyntheticModel(tie_word_embeddings=True), "in_order", 1)
    data2 = json.loads(CliRunner().invoke(app, ["inspect-order", str(folder2), "--json"]).stdout)
    assert data2["skipped_tensors"] == []
    assert data2["total_bytes"] == data["total_bytes"] - 128 * 64 * 2


@pytest.mark.parametrize(("architecture", "tower"), [
    ("Qwen3_5ForConditionalGeneration", "model.visual.blocks.0.attn.qkv.weight"),
    ("Gemma3ForConditionalGeneration", "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"),
    ("Mistral3ForConditionalGeneration", "model.vision_tower.transformer.layers.0.attention.q_proj.weight"),
])
def test_wrapped_text_models_plan_the_text_part(architecture: str, tower: str) -> None:
    """Checkpoints that wrap the text model: the table knows them although vLLM cannot import them here."""
    mapping = mapping_for_config({"architectures": [architecture]})
    assert mapping.kind == "table"
    P = "model.language_model."
    q = mapping.parent_of(f"{P}layers.1.self_attn.q_proj.weight")
    assert (q.name, q.order_key) == (f"{P}layers.1.self_attn.qkv_proj", (1, 1))
    assert mapping.parent_of(f"{P}layers.1.mlp.up_proj.weight").name == f"{P}layers.1.mlp.gate_up_proj"
    assert mapping.parent_of(f"{P}embed_tokens.weight").order_key == (0, 0)
    # The parts beside the text model: planned after it, and named as what vLLM reloads.
    part = mapping.parent_of(tower)
    assert part is not None and part.order_key[0] == 4
    assert any(tower.startswith(prefix) for prefix in mapping.towers)
    assert "vLLM reloads them unless the engine runs text-only" in mapping.description


def test_qwen3_5_fuses_its_gated_delta_net_and_drops_mtp() -> None:
    mapping = mapping_for_config({"architectures": ["Qwen3_5ForConditionalGeneration"]})
    P = "model.language_model.layers.0.linear_attn."
    assert {mapping.parent_of(P + n).name for n in ("in_proj_qkv.weight", "in_proj_z.weight")} == {
        P + "in_proj_qkvz"}
    assert {mapping.parent_of(P + n).name for n in ("in_proj_a.weight", "in_proj_b.weight")} == {P + "in_proj_ba"}
    assert mapping.parent_of("mtp.layers.0.mlp.gate_proj.weight") is None  # hf_to_vllm_mapper drops `mtp.`
    assert mapping.parent_of("model.language_model.layers.0.self_attn.rotary_emb.inv_freq") is None
