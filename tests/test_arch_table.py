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
    from vllm.model_executor.models import registry

    names = {**registry._TEXT_GENERATION_MODELS, **registry._TRANSFORMERS_SUPPORTED_MODELS,
             **registry._MULTIMODAL_MODELS}
    wanted = {n for n in names if n.endswith(("ForCausalLM", "ForConditionalGeneration"))}
    entries = json.loads(generated)["architectures"]
    assert wanted <= set(entries)
    assert not [n for n, e in entries.items() if "error" in e]
    assert json.loads(generated)["vllm_version"] == arch_table.installed_vllm_version()


@pytest.mark.slow  # imports every model class vLLM can import here
def test_the_table_equals_the_classes_vllm_can_import(generated: str) -> None:
    """The source reader's class attributes equal the imported classes' (the rest are read from source only)."""
    checked = 0
    differ = []
    for arch, entry in json.loads(generated)["architectures"].items():
        if entry["backend"] == "transformers" or entry["notes"]:
            continue  # fused at engine start; or read partly, which the entry says
        module, _, name = entry["class"].rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception:  # noqa: BLE001 - torchvision and other packages this machine lacks
            continue
        packed = {k: list(v) for k, v in (getattr(cls, "packed_modules_mapping", None) or {}).items()}
        mapper = getattr(cls, "hf_to_vllm_mapper", None)
        live = {}
        for field, key in (("orig_to_new_prefix", "prefix"), ("orig_to_new_substr", "substr"),
                           ("orig_to_new_suffix", "suffix"), ("orig_to_new_regex", "regex"),
                           ("orig_to_new_stacked", "stacked")):
            value = getattr(mapper, field, None)
            if value:
                live[key] = [[k.pattern if key == "regex" else k, list(v) if key == "stacked" else v]
                             for k, v in value.items()]
        # The table also holds the entries a class adds in __init__ (DeepSeek's conditional qkv_proj).
        if any(entry["packed_modules_mapping"].get(k) != v for k, v in packed.items()) or live != entry["mapper"]:
            differ.append(arch)
        checked += 1
    assert checked > 100
    # Inkling extends its mapper's suffixes after the class body (module-level code this reader does not run).
    assert set(differ) <= {"InklingForCausalLM", "InklingForConditionalGeneration"}, differ
