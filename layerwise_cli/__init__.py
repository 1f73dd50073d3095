"""layerwise: stream new weights into running vLLM engines in layer order.

The Python API (imported lazily, so that `import layerwise_cli` stays cheap):

    from layerwise_cli import EXTENSION_CLS, reload, start_engine, stop_engine, inspect_order, verify_engine
"""

from __future__ import annotations

__version__ = "0.1.0"
# Pass as `LLM(..., worker_extension_cls=EXTENSION_CLS)` to make an engine reloadable.
EXTENSION_CLS = "layerwise_cli.worker.extension.LayerwiseWorkerExtension"
# `layerwise serve`'s endpoint answering a worker call from every data-parallel engine (server.engines_rpc).
ENGINES_RPC_PATH = "/layerwise/engines_rpc"

_LAZY = {
    "reload": ("layerwise_cli.client.local", "reload"),
    "start_engine": ("layerwise_cli.client.local", "start_engine"),
    "stop_engine": ("layerwise_cli.client.local", "stop_engine"),
    "EngineOptions": ("layerwise_cli.client.local", "EngineOptions"),
    "ReloadReport": ("layerwise_cli.report.reload_report", "ReloadReport"),
    "inspect_order": ("layerwise_cli.planning.inspect", "inspect_order"),
    "verify_engine": ("layerwise_cli.client.local", "verify_engine"),
    "VerifyResult": ("layerwise_cli.report.verify_result", "VerifyResult"),
    "LayerwiseError": ("layerwise_cli.errors", "LayerwiseError"),
}
__all__ = ["__version__", "EXTENSION_CLS", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'layerwise_cli' has no attribute {name!r}")
