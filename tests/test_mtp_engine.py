"""Multi-token-prediction (MTP) layers vLLM loads only into a draft model: not unknown, not missing, not read.

Qwen3-Next checkpoints from transformers' `save_pretrained` (tests/support/producers.py: 3 gated delta-net
layers and 1 full-attention layer, MoE), with `mtp.*` tensors added the way the Hub's Qwen3-Next checkpoints
carry them and `mtp_num_hidden_layers` (the key vLLM's speculative config reads for Qwen3-Next) set. vLLM's
Qwen3NextForCausalLM drops every `mtp.` name when it loads (its `hf_to_vllm_mapper`; upstream vLLM passes
`skip_prefixes=["mtp."]`), whatever the config says, when no draft model runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.cli.app import app
from layerwise_cli.client.engine import in_process
from layerwise_cli.client.engine.in_process import EngineOptions, reload
from layerwise_cli.client.engine.session import prepare_sources
from layerwise_cli.demo import demo_prompt
from layerwise_cli.planning.inspect import inspect_order
from tests.support.engine_support import (
    assert_matches_fresh,
    fresh_answers,
    greedy_with_logprobs,
    load_tensors,
    remember_fresh,
)
from tests.support.in_process import start_here, stop_here
from tests.support.producers import Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

QWEN3_NEXT = Producer("qwen3_next", layers=4, max_shard_size="256KB")
PAIRS = [(a, b) for a in range(1, 10, 2) for b in range(0, 10, 4)]  # 15 prompts
MTP_SHARD = "model-mtp.safetensors"


def prompts() -> list[str]:
    return [demo_prompt(a, b) for a, b in PAIRS]


def mtp_tensors(checkpoint: Path, seed: int) -> dict:
    """An MTP block as Qwen3-Next checkpoints carry it: fc, its norms, and one decoder layer shaped as the
    checkpoint's full-attention layer (the last one)."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    tensors = load_tensors(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    hidden, last = config["hidden_size"], config["num_hidden_layers"] - 1
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (0.2 * torch.randn(*shape, generator=generator)).to(torch.bfloat16)

    out = {"mtp.fc.weight": rand(hidden, 2 * hidden), "mtp.norm.weight": rand(hidden),
           "mtp.pre_fc_norm_embedding.weight": rand(hidden), "mtp.pre_fc_norm_hidden.weight": rand(hidden)}
    prefix = f"model.layers.{last}."
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            out["mtp.layers.0." + name[len(prefix):]] = rand(*tensor.shape)
    return out


def add_mtp(checkpoint: Path, tensors: dict) -> None:
    """Write TENSORS into CHECKPOINT as one more shard, listed in its index, and set `mtp_num_hidden_layers`."""
    from safetensors.torch import save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    save_file(tensors, str(checkpoint / MTP_SHARD), metadata={"format": "pt"})
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(tensors, MTP_SHARD))
    index_path.write_text(json.dumps(index))
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    config["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config))


def remove_mtp(checkpoint: Path, original: Path) -> None:
    """Undo `add_mtp`: back to ORIGINAL's index and config."""
    (checkpoint / MTP_SHARD).unlink(missing_ok=True)
    for name in ("model.safetensors.index.json", "config.json"):
        shutil.copy2(original / name, checkpoint / name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A with MTP layers, B without (and a copy of B to start the engine from), each from save_pretrained."""
    root = tmp_path_factory.mktemp("mtp")
    a = save_pretrained_checkpoint(root / "A-mtp", QWEN3_NEXT, seed=1)
    b = save_pretrained_checkpoint(root / "B", QWEN3_NEXT, seed=2)
    assert (b / "model.safetensors.index.json").exists()  # several shards: the MTP shard is one more
    add_mtp(a, mtp_tensors(a, seed=3))
    base = root / "base"
    shutil.copytree(b, base)
    return {"A-mtp": a, "B": b, "base": base}


@pytest.fixture(scope="module")
def engine(checkpoints):
    """One Qwen3-Next engine for the module, started on BASE (= B, no MTP), after the fresh engine on A-mtp.

    Its answers at start are B's fresh answers (`remember_fresh`): no second engine is started for them.
    """
    fresh_answers(checkpoints["A-mtp"], prompts())
    llm = start_here(str(checkpoints["base"]), EngineOptions(max_model_len=64))
    remember_fresh(llm, checkpoints["base"], prompts())
    yield llm
    stop_here(llm)


def _mtp_note(report) -> str:
    (note,) = [note for note in report.findings.notes if note.startswith("skipped as vLLM does")]
    assert "Qwen3NextForCausalLM loads no 'mtp.' tensors" in note and "'mtp." in note, note
    return note


def test_source_with_mtp_layers_over_base_without(engine, checkpoints):
    """SOURCE carries mtp.* (BASE has none): not unknown; never read; answers are a fresh engine's on SOURCE."""
    a = checkpoints["A-mtp"]
    # The command's pre-flight, before any engine starts, against BASE's headers.
    prepare_sources(str(a), str(checkpoints["base"]), None, quiet=True)
    report = reload(engine, str(a))
    assert_matches_fresh(engine, a, prompts())
    assert fresh_answers(a, prompts()) != fresh_answers(checkpoints["base"], prompts())
    note = _mtp_note(report)
    plan = inspect_order(str(a)).plan
    assert {t.name for t in plan.skipped} == {name for name in plan.skip_reasons if name.startswith("mtp.")}
    assert f"{len(plan.skipped)} tensor(s)" in note
    assert report.bytes == plan.loaded_bytes and report.volume.read_bytes <= plan.loaded_bytes
    assert not any(layer.name.startswith("mtp.") for layer in report.layers)
    assert not report.findings.unexpected


def test_base_with_mtp_layers_source_without(engine, checkpoints, tmp_path):
    """BASE carries mtp.* and SOURCE does not: those tensors are not missing (vLLM would not load them)."""
    base, b = checkpoints["base"], checkpoints["B"]
    reload(engine, str(checkpoints["A-mtp"]))  # the engine holds A's weights: reloading B has something to prove
    on_a = greedy_with_logprobs(engine, prompts())
    add_mtp(base, mtp_tensors(base, seed=4))
    try:
        prepare_sources(str(b), str(base), None, quiet=True)
        report = reload(engine, str(b))
    finally:
        remove_mtp(base, b)
    assert_matches_fresh(engine, b, prompts())
    assert on_a != greedy_with_logprobs(engine, prompts())
    assert not [note for note in report.findings.notes if note.startswith("skipped as vLLM does")]


def test_typo_in_an_mtp_name_is_refused_before_the_engine_starts(checkpoints, tmp_path, monkeypatch):
    """`mpt.fc.weight` is neither a tensor of BASE nor one vLLM skips: one line naming the file and tensor, exit 1."""
    started: list[str] = []
    monkeypatch.setattr(in_process, "start_engine", lambda model, options=None: started.append(model))
    bad = tmp_path / "typo"
    shutil.copytree(checkpoints["A-mtp"], bad)
    from safetensors.torch import load_file, save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    tensors = load_file(bad / MTP_SHARD)
    tensors["mpt.fc.weight"] = tensors.pop("mtp.fc.weight")
    save_file(tensors, str(bad / MTP_SHARD), metadata={"format": "pt"})
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["mpt.fc.weight"] = index["weight_map"].pop("mtp.fc.weight")
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    result = CliRunner().invoke(app, ["reload", "--weights-path", str(bad), "--model", str(checkpoints["base"])])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {bad}"), result.stderr
    assert "unknown tensor 'mpt.fc.weight'" in lines[0]
    assert started == []
