"""layerwise_cli.vllm_compat: importing it loads no vLLM; each private symbol it declares is in the installed vLLM."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from layerwise_cli import vllm_compat


def test_importing_vllm_compat_imports_neither_vllm_nor_torch() -> None:
    code = ("import sys, layerwise_cli.vllm_compat as c; assert c.PRIVATE; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_every_private_symbol_is_declared_once() -> None:
    labels = [(symbol.label, symbol.kind) for symbol in vllm_compat.PRIVATE]
    assert len(labels) == len(set(labels))
    assert {"LAYERWISE_INFO", "CopyCounter", "layer_ref_sentinel", "get_layer_size", "is_deferred_attention_layer",
            "AuthenticationMiddleware", "attach_router"} <= {symbol.name for symbol in vllm_compat.PRIVATE}


@pytest.mark.slow
@pytest.mark.parametrize("symbol", vllm_compat.PRIVATE, ids=lambda symbol: symbol.label)
def test_each_private_symbol_exists_in_the_installed_vllm(symbol: vllm_compat.PrivateSymbol) -> None:
    module = importlib.import_module(symbol.module)
    if symbol.nested:
        assert symbol.name in vars(module) or symbol.name in importlib.util.find_spec(symbol.module).loader \
            .get_source(symbol.module)
        return
    value = module if symbol.name is None else getattr(module, symbol.name)
    if symbol.kind == "class":
        assert isinstance(value, type)
    if symbol.kind == "function":
        assert callable(value)
