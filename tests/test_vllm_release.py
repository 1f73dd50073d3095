"""scripts/check_vllm_release.py against copies of the installed vLLM's source: one as it is, one doctored."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_vllm_release.py"


def _installed_tree() -> Path:
    spec = importlib.util.find_spec("vllm")  # finds, does not import
    assert spec is not None and spec.submodule_search_locations, "the engine tests' vLLM must be installed"
    return Path(next(iter(spec.submodule_search_locations)))


def _wheel(path: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """A wheel-shaped zip of the installed vLLM's .py files, with each edit (file -> (old, new)) applied once."""
    tree = _installed_tree()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for file in sorted(tree.rglob("*.py")):
            name = f"vllm/{file.relative_to(tree).as_posix()}"
            text = file.read_text(encoding="utf-8")
            if name in edits:
                old, new = edits.pop(name)
                assert text.count(old) == 1, (name, old)
                text = text.replace(old, new)
            wheel.writestr(name, text)
    assert not edits, f"files not found: {sorted(edits)}"
    return path


def _check(wheel: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--wheel", str(wheel), "--installed",
                           str(_installed_tree().parent), "--skip-resolution"],
                          capture_output=True, text=True, timeout=300, check=False)


def _differences(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("DIFF")]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("wheels")
    return {
        "same": _wheel(folder / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", {}),
        "doctored": _wheel(folder / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl", {
            "vllm/model_executor/model_loader/reload/utils.py": ("def get_layer_size(", "def get_layer_numel("),
            "vllm/model_executor/layers/vocab_parallel_embedding.py": ("DEFAULT_VOCAB_PADDING_SIZE = 64",
                                                                       "DEFAULT_VOCAB_PADDING_SIZE = 128"),
            "vllm/entrypoints/serve/middleware/authenticate.py": ("def verify_token(", "def check_token("),
        }),
        # The installed version with one model's fusions changed: the committed table of 0.32.0 no longer matches.
        "refused": _wheel(folder / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64-fused.whl", {
            "vllm/model_executor/models/qwen3.py": ('"gate_up_proj": ["gate_proj", "up_proj"],\n    }\n    embedding',
                                                   '"gate_up_proj": ["gate_proj"],\n    }\n    embedding'),
        }),
    }


def test_the_installed_vllm_passes_its_own_check(wheels: dict[str, Path]) -> None:
    done = _check(wheels["same"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert not _differences(done.stdout)
    assert "get_layer_size" in done.stdout and "AuthenticationMiddleware" in done.stdout


def test_a_renamed_symbol_and_a_changed_rule_fail_naming_them(wheels: dict[str, Path]) -> None:
    done = _check(wheels["doctored"])
    assert done.returncode == 1, done.stdout + done.stderr
    differences = _differences(done.stdout)
    assert len(differences) == 6, differences
    renamed, verify_token, padding_rule, padding_value, completion_rule, table = differences
    assert "reload.utils.get_layer_size" in renamed and "get_layer_size is not defined" in renamed
    assert "AuthenticationMiddleware" in verify_token and "has no verify_token" in verify_token
    assert "vocabulary padding" in padding_rule and "changed: DEFAULT_VOCAB_PADDING_SIZE" in padding_rule
    assert "release 128, layerwise (completion.VOCAB_PADDING) 64" in padding_value
    assert "completion rule" in completion_rule and "removed: get_layer_size; added: get_layer_numel" in completion_rule
    assert "architecture" in table and "no committed table for vLLM 9.9.9" in table


def test_an_architecture_the_release_fuses_otherwise_fails_naming_it(wheels: dict[str, Path]) -> None:
    """The release's model classes regenerate the table; one changed fusion is one failing row naming its class."""
    done = _check(wheels["refused"])
    assert done.returncode == 1, done.stdout + done.stderr
    differences = _differences(done.stdout)
    assert differences and all("architecture" in line for line in differences), differences
    assert any("Qwen3ForCausalLM " in line and "entry differs: packed" in line for line in differences), differences
