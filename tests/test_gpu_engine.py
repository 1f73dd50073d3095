"""vLLM's own online FP8 quantization reloads (the QeRL flow) on an NVIDIA GPU; skipped on machines without one.

Run by `scripts/gpu_check.sh` on a GPU machine. FP8 kernels do not exist on
CPU, so these cannot run here or in CI; `tests/test_online_quant_engine.py`
runs the same lifecycle on any CPU with layerwise's emulated methods.
Both of vLLM's online linear methods are covered: `fp8_per_block` (dense)
and `fp8_per_tensor` (MoE: experts and linear layers).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from layerwise_cli.client.engine.in_process import EngineOptions, reload, start_engine, stop_engine
from tests.support.engine_support import engine_state, greedy_with_logprobs
from tests.support.synthetic import SyntheticModel, normal_weights, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

PROMPTS = [f"{a} {b} = " for a in range(10) for b in range(0, 10, 3)]
# Each case starts two engines; two cases keep the GPU check within its time budget.
CASES = [("dense", 0, "fp8_per_block"), ("moe", 8, "fp8_per_tensor")]


@pytest.fixture(scope="module")
def gpu() -> None:
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (torch.cuda.is_available() is False)")


def write_model(folder: Path, seed: int, experts: int, tokenizer: Path) -> Path:
    """A small Qwen3 (or Qwen3-MoE) with real weights; every dimension a multiple of 128 for block FP8."""
    model = SyntheticModel(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=256,
                           experts=experts, moe_intermediate=256)
    write_checkpoint(folder, model, "trainer_export", shards=3, data=normal_weights(model, seed=seed, std=0.05))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, folder / name)
    return folder


@pytest.mark.parametrize(("family", "experts", "method"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_online_fp8_reload_a_b_a(gpu, demo_models, tmp_path, family, experts, method):
    models = {name: write_model(tmp_path / name, seed, experts, demo_models["multiply"])
              for name, seed in (("a", 1), ("b", 2))}
    # The engine under test captures CUDA graphs (the reload must keep their
    # addresses); the reference engine needs none.
    options = EngineOptions(max_model_len=64, quantization=method, memory_fraction=0.3, enforce_eager=False)
    fresh_b_engine = start_engine(str(models["b"]), replace(options, enforce_eager=True))
    try:
        fresh_b = greedy_with_logprobs(fresh_b_engine, PROMPTS)
    finally:
        stop_engine(fresh_b_engine)
    llm = start_engine(str(models["a"]), options)
    try:
        fresh_a = greedy_with_logprobs(llm, PROMPTS)
        before = engine_state(llm)
        # --verify re-quantizes B with vLLM's own FP8 method, layer by layer, and compares bit for bit.
        report = reload(llm, str(models["b"]), verify=True)
        assert report.placement.device.startswith("cuda")
        # Measured against predicted: the buffer holds B's bf16 tensors, one layer at a time.
        assert report.peak_buffer_bytes == report.memory.predicted_peak_buffer_bytes == report.largest_layer_bytes
        assert not report.findings.unexpected
        verify = report.verify
        assert verify.ok, (verify.mismatched, verify.details, verify.errors)
        assert any(name.endswith("qkv_proj") for name in verify.quantized), verify.quantized
        quantized = [layer for layer in report.layers if layer.name.endswith(("qkv_proj", "gate_up_proj", "experts"))
                     or ".experts." in layer.name]
        assert quantized and all(layer.process_s > 0 for layer in quantized)
        got = greedy_with_logprobs(llm, PROMPTS)
        # Greedy tokens and top-5 token ids equal a fresh FP8 engine on B (logprob values: CUDA graphs
        # against the eager reference may differ in the last bits).
        assert [[s[0] for s in steps] for steps in got] == [[s[0] for s in steps] for steps in fresh_b]
        assert [[[t for t, _ in s[1]] for s in steps] for steps in got] == [
            [[t for t, _ in s[1]] for s in steps] for steps in fresh_b]
        assert got != fresh_a  # A and B answer differently: the reload had something to prove
        assert engine_state(llm)["pointers"] == before["pointers"]  # in place: graphs keep their addresses
        reload(llm, str(models["a"]))
        assert greedy_with_logprobs(llm, PROMPTS) == fresh_a
    finally:
        stop_engine(llm)
