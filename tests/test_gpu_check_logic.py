"""`engine_defaults.cuda_available`: a torch built for no GPU is known to see none without being imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from layerwise_cli import engine_defaults


def _fake_torch(root: Path, version_py: str) -> Path:
    """A `torch` package under ROOT whose `__init__` fails if imported, and whose `version.py` is VERSION_PY."""
    package = root / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the fake torch was imported')\n")
    (package / "version.py").write_text(version_py)
    return root


@pytest.mark.parametrize(("version_py", "built_for_a_gpu"), [
    ("from typing import Optional\ncuda: Optional[str] = None\nhip: Optional[str] = None\n", False),
    ("from typing import Optional\ncuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n", True),
    ("from typing import Optional\ncuda: Optional[str] = None\nhip: Optional[str] = '6.4'\n", True),
    ("raise RuntimeError('an unexpected layout')\n", True),  # unreadable: torch itself must be asked
], ids=["cpu", "cuda", "rocm", "unreadable"])
def test_the_build_is_read_from_version_py_alone(tmp_path, monkeypatch, version_py, built_for_a_gpu):
    monkeypatch.syspath_prepend(str(_fake_torch(tmp_path, version_py)))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert engine_defaults._torch_built_for_a_gpu() is built_for_a_gpu
    assert "torch" not in sys.modules


def test_without_torch_there_is_no_gpu(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert engine_defaults._torch_built_for_a_gpu() is False


def test_a_cpu_build_answers_without_importing_torch_and_a_gpu_build_asks_it(tmp_path):
    # In a fresh interpreter (this one has imported torch already), with an import hook recording whether
    # `cuda_available` asked for torch. The fake GPU build is asked, fails to import, and answers False as before.
    hook = ("import builtins\nasked = []\nimport_ = builtins.__import__\n"
            "builtins.__import__ = lambda name, *a, **k: (asked.append(name) if name == 'torch' else None) "
            "or import_(name, *a, **k)\n")
    check = "from layerwise_cli.engine_defaults import cuda_available\nprint(cuda_available(), bool(asked))\n"
    for cuda, expected in (("None", "False False"), ("'12.8'", "False True")):
        root = _fake_torch(tmp_path / cuda.strip("'"), f"cuda = {cuda}\nhip = None\n")
        result = subprocess.run([sys.executable, "-c", hook + check], capture_output=True, text=True,
                                env={"PYTHONPATH": f"{root}:{Path(__file__).resolve().parents[1]}"}, check=True)
        assert result.stdout.split() == expected.split(), result.stderr
