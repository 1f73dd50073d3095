"""The public API: every name in `layerwise_cli.__all__` resolves lazily and is documented; the import is cheap."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import layerwise_cli

# The names users import (docs/python-api.md, "Python API for trainer loops"); more may be added, none removed.
PROMISED = {"reload", "start_engine", "stop_engine", "EngineOptions", "inspect_order", "EXTENSION_CLS",
            "verify_engine", "VerifyResult", "ReloadReport", "LayerwiseError"}
CONSTANTS = {"__version__", "EXTENSION_CLS"}
HEAVY = ("torch", "vllm", "transformers", "huggingface_hub", "numpy", "safetensors", "typer", "rich", "httpx")


def _fresh(code: str) -> dict:
    """Run CODE in a fresh interpreter (nothing imported yet); it prints one JSON line."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_promised_names_are_public():
    assert set(layerwise_cli.__all__) >= PROMISED
    assert len(set(layerwise_cli.__all__)) == len(layerwise_cli.__all__)


def test_import_is_cheap_and_every_name_resolves_only_when_used():
    found = _fresh(
        "import json, sys\n"
        "import layerwise_cli\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "inner = sorted(m for m in sys.modules if m.startswith('layerwise_cli.'))\n"
        "resolved = {name: type(getattr(layerwise_cli, name)).__name__ for name in layerwise_cli.__all__}\n"
        "print(json.dumps({'heavy': heavy, 'inner': inner, 'resolved': resolved}))\n")
    assert found["heavy"] == [], f"`import layerwise_cli` imports {found['heavy']}"
    assert found["inner"] == [], f"`import layerwise_cli` imports {found['inner']} before any name is used"
    assert set(found["resolved"]) == set(layerwise_cli.__all__)


@pytest.mark.parametrize("name", sorted(set(layerwise_cli.__all__) - CONSTANTS))
def test_every_public_name_is_documented(name):
    obj = getattr(layerwise_cli, name)
    doc = inspect.getdoc(obj) or ""
    assert obj.__module__.startswith("layerwise_cli.") and doc, f"{name} has no docstring"
    if inspect.isfunction(obj):
        signature = inspect.signature(obj)
        if signature.parameters:
            assert "Args:" in doc, f"{name}: no Args: section"
            named = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            missing = [p for p in named if f"{p}:" not in doc and f"{p}," not in doc]
            assert not missing, f"{name}: parameters not described: {missing}"
        if signature.return_annotation not in (None, "None", inspect.Signature.empty):
            assert "Returns:" in doc, f"{name}: no Returns: section"
    elif dataclasses.is_dataclass(obj):
        assert "Attributes:" in doc, f"{name}: no Attributes: section"
        missing = [f.name for f in dataclasses.fields(obj) if f"{f.name}:" not in doc]
        assert not missing, f"{name}: fields not described: {missing}"


def test_the_constants_are_documented_in_the_package_docstring():
    doc = layerwise_cli.__doc__ or ""
    for name in CONSTANTS:
        assert f"{name}:" in doc


def test_extension_cls_names_an_importable_class():
    module_name, _, class_name = layerwise_cli.EXTENSION_CLS.rpartition(".")
    extension = getattr(importlib.import_module(module_name), class_name)
    assert inspect.isclass(extension) and inspect.getdoc(extension)
    for method in ("layerwise_ping", "layerwise_reload", "layerwise_verify", "layerwise_fingerprints"):
        assert callable(getattr(extension, method)), method
    # vLLM imports the extension into every worker by this name: it must not need the CLI's libraries.
    found = _fresh(f"import json, sys, importlib\nimportlib.import_module({module_name!r})\n"
                   "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'typer', 'rich'})))\n")
    assert found == []


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'reloadd'"):
        _ = layerwise_cli.reloadd


@pytest.mark.parametrize("page", ["docs/python-api.md", "README.md"])
def test_the_api_docs_name_every_promised_name_and_stop_the_engine(page):
    repo = Path(__file__).resolve().parents[1]
    text = (repo / page).read_text(encoding="utf-8")
    if page == "docs/python-api.md":
        section = text.split("## Python API for trainer loops", 1)[1].split("\n## ", 1)[0]
        missing = [name for name in PROMISED if not re.search(rf"\b{name}\b", section)]
        assert not missing, f"the Python API page does not name {missing}"
    else:  # the README's one example: the same loop
        section = text.split("The [Python API]", 1)[1]
    example = ast.parse(section.split("```python", 1)[1].split("```", 1)[0])
    stops = [node for node in ast.walk(example) if isinstance(node, ast.Try)
             for call in ast.walk(ast.Module(body=node.finalbody, type_ignores=[]))
             if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("stop_engine")]
    assert stops, f"{page}'s example does not call stop_engine in a `finally` (a script would hang at exit)"
