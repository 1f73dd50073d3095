"""The architecture table: regenerated from the installed vLLM's sources it must equal the committed one."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from layerwise_cli.planning import arch_table

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gen_arch_table.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_arch_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated() -> str:
    pytest.importorskip("vllm")  # the generator reads the installed vLLM's sources (it does not import them)
    gen = _generator()
    return gen.render(gen.generate())


def test_committed_table_equals_the_installed_vllm(generated: str) -> None:
    committed = (ROOT / "layerwise_cli" / "planning" / "architectures.json").read_text()
    assert committed == generated, "architectures.json is stale or was edited: run scripts/gen_arch_table.py"


def test_an_entry_edited_by_hand_fails_the_check(tmp_path: Path, generated: str) -> None:
    table = json.loads(generated)
    table["architectures"]["Qwen3ForCausalLM"]["packed"]["gate_proj"] = "gate_proj"
    edited = tmp_path / "architectures.json"
    edited.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    check = [sys.executable, str(SCRIPT), "--check", "--out"]
    proc = subprocess.run([*check, str(edited)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1 and "differs" in proc.stderr, proc.stderr
    # The same text unedited passes (the first test shows the generator writes exactly this text).
    assert _generator().render(json.loads(generated)) == generated


def test_the_table_covers_every_text_architecture_of_the_registry(generated: str) -> None:
    from vllm.model_executor.models import registry  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    names = {**registry._TEXT_GENERATION_MODELS, **registry._TRANSFORMERS_SUPPORTED_MODELS,
             **registry._MULTIMODAL_MODELS}
    wanted = {n for n in names if n.endswith(("ForCausalLM", "ForConditionalGeneration"))}
    entries = json.loads(generated)["architectures"]
    assert wanted <= set(entries)
    assert not [n for n, e in entries.items() if "error" in e]
    assert json.loads(generated)["vllm_version"] == arch_table.installed_vllm_version()


@pytest.mark.slow  # imports every model class vLLM can import here (in a process of its own)
def test_the_table_equals_the_classes_vllm_can_import(generated: str, tmp_path: Path) -> None:
    """The source reader's class attributes equal the imported classes' (the rest are read from source only)."""
    table = tmp_path / "architectures.json"
    table.write_text(generated)
    proc = subprocess.run([sys.executable, "-m", "tests.support.arch_classes", str(table)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    checked, differ = result["checked"], result["differ"]
    assert checked > 100
    # Inkling extends its mapper's suffixes after the class body (module-level code this reader does not run).
    assert set(differ) <= {"InklingForCausalLM", "InklingForConditionalGeneration"}, differ


def test_renames_outside_load_weights_itself_are_read(generated: str) -> None:
    """A rename in the helper whose stream `load_weights` hands on, or in an inner model's mapper, is read."""
    entries = json.loads(generated)["architectures"]
    # ERNIE-4.5-MoE: `loader.load_weights(self._preprocess(weights))`, guarded by `if "e_score..." in name`.
    assert {"old": "moe_statics", "new": "gate", "when": [{"suffix": [], "substr": ["e_score_correction_bias"]}]} \
        in entries["Ernie4_5_MoeForCausalLM"]["renames"]
    # Granite MoE: `GraniteMoeModel.hf_to_vllm_mapper`'s suffixes, the top class having no mapper of its own.
    for architecture in ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeSWAForCausalLM"):
        assert {"old": "moe.input_linear.weight", "new": "moe.experts.gate_up_proj",
                "when": [{"suffix": ["moe.input_linear.weight"], "substr": []}]} in entries[architecture]["renames"]
    # gpt-oss's quantized path renames in a method that loads (not a stream helper): not a rename of every path.
    assert all(r["old"] != ".mlp.experts." for r in entries["GptOssForCausalLM"].get("renames") or [])
    # TeleChat2 splits `key_value` into two tensors: a split, which the planner cannot follow, is no rename.
    assert all(r["old"] != "key_value" for r in entries["TeleChat2ForCausalLM"].get("renames") or [])
