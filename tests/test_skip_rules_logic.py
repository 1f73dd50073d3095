"""vLLM's skip rules: what they skip, where they come from, and how pre-flight and the planner use them."""

from __future__ import annotations

import json

import pytest

from layerwise_cli.checkpoint.format.header import ShardHeader, TensorEntry
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning import skip_rules
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.planning.plan import build_plan
from layerwise_cli.planning.reference import check_against_reference
from layerwise_cli.planning.skip_rules import skip_rules_for, skip_summary, skipped_by_vllm
from layerwise_cli.planning.vllm_mapping import model_class_from_vllm

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2}
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 4, "mtp_num_hidden_layers": 1}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 3, "num_nextn_predict_layers": 1}

LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"]


def _names(layers: int, extra: tuple[str, ...] = (), head: bool = True) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", *extra]
    names += [f"model.layers.{i}.{leaf}" for i in range(layers) for leaf in LAYER]
    return names + (["lm_head.weight"] if head else [])


def _checkpoint(names: list[str], config: dict, source: str = "ckpt") -> Checkpoint:
    tensors, offset = [], 0
    for name in sorted(names):
        tensors.append(TensorEntry(name, "BF16", (4, 4), "model.safetensors", offset, offset + 32))
        offset += 32
    shard = ShardHeader("model.safetensors", 100, None, tensors=tensors)
    return Checkpoint(source, "directory", [shard], config=config)


def _vllm_class(architecture: str):
    pytest.importorskip("vllm")
    return model_class_from_vllm(architecture)


def test_rotary_buffers_are_skipped_for_every_architecture_and_a_typo_is_not():
    names = ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.0.self_attn.rotary_emb.cos_cached",
             "model.layers.0.self_attn.rotary_emb.sin_cached", "model.layers.0.self_attn.rotary_emb.inv_frq",
             "model.layers.0.mlp.gate_prj.weight"]
    for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM", None):
        found = skipped_by_vllm(arch, QWEN3, names)
        assert list(found) == names[:3]
        assert all("rotary buffer" in why for why in found.values())


def test_tied_head_is_skipped_only_when_tied():
    assert "lm_head.weight" in skipped_by_vllm("Qwen3ForCausalLM", {**QWEN3, "tie_word_embeddings": True},
                                               ["lm_head.weight"])
    assert skipped_by_vllm("Qwen3ForCausalLM", QWEN3, ["lm_head.weight"]) == {}
    # A head inside a decoder layer is not the output head.
    assert skipped_by_vllm("Qwen3ForCausalLM", {**QWEN3, "tie_word_embeddings": True},
                           ["model.layers.0.lm_head.weight"]) == {}


def test_qwen3_next_mtp_tensors_are_skipped_whatever_the_config_says():
    names = ["mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "model.layers.0.mtp.weight",
             "model.layers.3.mlp.gate.weight"]
    for config in (QWEN3_NEXT, {**QWEN3_NEXT, "mtp_num_hidden_layers": 0}):
        assert list(skipped_by_vllm("Qwen3NextForCausalLM", config, names)) == names[:2]
    assert skipped_by_vllm("Qwen3ForCausalLM", QWEN3, names) == {}


def test_deepseek_nextn_layers_are_the_layers_after_the_last_one():
    names = ["model.layers.2.mlp.gate.weight", "model.layers.3.mlp.gate.weight", "model.layers.3.eh_proj.weight",
             "model.layers.4.mlp.gate.weight", "model.layers.30.mlp.gate.weight"]
    found = skipped_by_vllm("DeepseekV3ForCausalLM", DEEPSEEK, names)
    assert list(found) == names[1:3]
    assert "nextn (MTP) layer 3" in found[names[1]]
    assert skipped_by_vllm("DeepseekV3ForCausalLM", {**DEEPSEEK, "num_nextn_predict_layers": 2}, names).keys() \
        == set(names[1:4])
    assert skipped_by_vllm("DeepseekV3ForCausalLM", {**DEEPSEEK, "num_nextn_predict_layers": 0}, names) == {}
    # Another architecture's layer 3 is a decoder layer like any other.
    assert skipped_by_vllm("Qwen3ForCausalLM", DEEPSEEK, names) == {}


def test_rules_are_read_from_vllms_model_class(monkeypatch):
    """With the package's table emptied, vLLM's class alone still skips MTP (its mapper, its spec-layer helper)."""
    qwen3_next, deepseek = _vllm_class("Qwen3NextForCausalLM"), _vllm_class("DeepseekV3ForCausalLM")
    monkeypatch.setattr(skip_rules, "SKIPPED_PREFIXES", {})
    monkeypatch.setattr(skip_rules, "SPEC_LAYER_ARCHITECTURES", frozenset())
    assert skipped_by_vllm("Qwen3NextForCausalLM", QWEN3_NEXT, ["mtp.fc.weight"]) == {}
    found = skipped_by_vllm("Qwen3NextForCausalLM", QWEN3_NEXT, ["mtp.fc.weight", "model.norm.weight"],
                            model_cls=qwen3_next)
    assert found == {"mtp.fc.weight": "Qwen3NextForCausalLM.hf_to_vllm_mapper maps it to None"}
    rules = skip_rules_for("DeepseekV3ForCausalLM", DEEPSEEK, model_cls=deepseek)
    assert rules.origin == "vllm" and rules.spec_layer_of is not None
    assert list(rules.skipped(["model.layers.3.mlp.gate.weight", "model.layers.2.mlp.gate.weight"])) == \
        ["model.layers.3.mlp.gate.weight"]
    assert "rotary_emb.inv_freq" in skip_rules_for("Qwen3ForCausalLM", QWEN3, model_cls=qwen3_next).substrings


def test_pre_flight_accepts_what_vllm_skips_on_either_side_and_refuses_a_typo():
    base = _checkpoint(_names(2), QWEN3)
    mapping = mapping_for_config(QWEN3)
    inv = tuple(f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(2))
    check_against_reference(_checkpoint(_names(2, inv), QWEN3), base, mapping, allow_partial=False)
    # BASE has them, SOURCE does not: not missing.
    check_against_reference(_checkpoint(_names(2), QWEN3), _checkpoint(_names(2, inv), QWEN3), mapping,
                            allow_partial=False)
    typo = [n.replace("gate_proj", "gate_prj") if n.startswith("model.layers.1.") else n for n in _names(2)]
    with pytest.raises(LayerwiseError, match=r"^typo: unknown tensor 'model\.layers\.1\.mlp\.gate_prj\.weight'"):
        check_against_reference(_checkpoint(typo, QWEN3, "typo"), base, mapping, allow_partial=True)


def test_pre_flight_mtp_layers_on_one_side_only():
    mtp = ("mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight")
    plain, with_mtp = _checkpoint(_names(4), QWEN3_NEXT), _checkpoint(_names(4, mtp), QWEN3_NEXT)
    mapping = mapping_for_config(QWEN3_NEXT, "generic")  # the package rules, without importing vLLM
    check_against_reference(with_mtp, plain, mapping, allow_partial=False)
    check_against_reference(plain, with_mtp, mapping, allow_partial=False)
    # A tensor under a name vLLM loads, absent from BASE, is still unknown.
    with pytest.raises(LayerwiseError, match=r"unknown tensor 'model\.layers\.0\.mtp\.weight'"):
        check_against_reference(_checkpoint(_names(4, ("model.layers.0.mtp.weight",)), QWEN3_NEXT), plain,
                                mapping, allow_partial=False)


def test_plan_leaves_skipped_tensors_out_of_layer_order_and_the_buffer():
    inv = tuple(f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(2))
    with_inv, plain = _checkpoint(_names(2, inv), QWEN3), _checkpoint(_names(2), QWEN3)
    plan, reference = build_plan(with_inv, mapping_for_config(QWEN3)), build_plan(plain, mapping_for_config(QWEN3))
    assert [t.name for t in plan.skipped] == sorted(inv)
    assert set(plan.skip_reasons) == set(inv)
    assert all(item.parent is not None for item in plan.layer_order)
    assert [i.entry.name for i in plan.layer_order] == [i.entry.name for i in reference.layer_order]
    assert plan.loaded_bytes == plan.total_bytes - 2 * 32 == reference.total_bytes
    for order in ("file", "layer"):
        assert plan.simulate(order).peak_buffer_bytes == reference.simulate(order).peak_buffer_bytes
    summary = skip_summary(plan.skip_reasons)
    assert summary.startswith("skipped as vLLM does (not read): 2 tensor(s), rotary buffer")
    assert repr(inv[0]) in summary


def test_inspect_order_names_what_it_skips_and_why(tmp_path):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from safetensors.torch import save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    tensors = {name: torch.zeros(4, 4, dtype=torch.bfloat16) for name in _names(2)}
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(32, dtype=torch.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    data = inspect_order(str(tmp_path)).to_dict()
    assert data["skipped_as_vllm_does"] == [{"name": "model.layers.0.self_attn.rotary_emb.inv_freq", "bytes": 128,
                                             "reason": skip_rules.REASON_ROTARY.format(
                                                 pattern="rotary_emb.inv_freq")}]
    assert data["total_bytes"] - 128 == sum(layer["bytes"] for layer in data["layers"])
