"""inspect-order's predictions equal what the engine measures, for architectures beyond the equivalence matrix.

One engine per architecture (started on A, a `save_pretrained` checkpoint):
it reloads B in layer order and in file order, and the reload report's
measured peak and layers must equal `inspect_order(B)`'s prediction made
before (parent layers, largest layer, each order's peak). The architectures of
the equivalence matrix (Qwen3, Llama, Mistral, Qwen3-MoE) are measured there;
`tests/test_planner_venv.py` shows a venv without vLLM predicts the same.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from layerwise_cli.client.engine.in_process import EngineOptions, reload
from layerwise_cli.planning.inspect import inspect_order
from tests.support.in_process import start_here, stop_here
from tests.support.producers import Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

ARCHS = ["phi3", "gemma3", "gpt2", "granite", "olmo2", "nemotron_h"]
ORDERS = ("layer", "file")


def predicted(source: Path) -> dict:
    data = inspect_order(str(source)).to_dict(top=0)
    return {"mapping": data["mapping"]["kind"], "parent_layers": data["parent_layers"],
            "largest_layer_bytes": data["largest_layer_bytes"],
            "file": data["file_order"]["peak_buffer_bytes"], "layer": data["layer_order"]["peak_buffer_bytes"]}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, dict]:
    """Per architecture: the prediction, and per order what the engine measured."""
    root = tmp_path_factory.mktemp("planner")
    runs: dict[str, dict] = {}
    for arch in ARCHS:
        a = save_pretrained_checkpoint(root / f"{arch}-a", Producer(arch), seed=1)
        b = save_pretrained_checkpoint(root / f"{arch}-b", Producer(arch), seed=2)
        run: dict = {"predicted": predicted(b)}
        llm = start_here(str(a), EngineOptions(max_model_len=64))
        try:
            for order in ORDERS:
                report = reload(llm, str(b), order=order)
                run[order] = {
                    "peak": report.peak_buffer_bytes,
                    "layers": len(report.layers),
                    "largest": max(layer.bytes for layer in report.layers),
                    "unexpected": list(report.findings.unexpected),
                    "open_at_end": [layer.name for layer in report.layers
                                    if not layer.completed_during_stream and not layer.held_to_end],
                    "mapping": report.placement.mapping,
                }
        finally:
            stop_here(llm)
        runs[arch] = run
    if os.environ.get("LAYERWISE_PLANNER_FIGURES"):  # the figures docs/planner.md quotes
        Path(os.environ["LAYERWISE_PLANNER_FIGURES"]).write_text(json.dumps(runs, indent=1))
    return runs


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_prediction_equals_the_engine(measured, arch: str, order: str) -> None:
    run = measured[arch]
    plan, engine = run["predicted"], run[order]
    assert plan["mapping"] == "table", plan
    # Every tensor went to a module vLLM buffers, and each layer completed where the plan says it does.
    assert engine["unexpected"] == [] and engine["open_at_end"] == [], engine
    assert (engine["layers"], engine["largest"], engine["peak"]) == (
        plan["parent_layers"], plan["largest_layer_bytes"], plan[order]), (plan, engine)
