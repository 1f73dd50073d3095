"""layerwise: stream new weights into running vLLM engines in layer order.

The Python API (imported lazily, so that `import layerwise_cli` stays cheap:
no torch, vLLM or Hub import until a name is first used):

    from layerwise_cli import EXTENSION_CLS, reload, ReloadOptions, start_engine, stop_engine, verify_engine
    from layerwise_cli import inspect_order, watch

A trainer writes checkpoints that every loader reads in layer order, with digests, atomically:

    from layerwise_cli import save_checkpoint
    save_checkpoint(model.state_dict().items(), "run/step_120", config=model.config, marker="STABLE")

Attributes:
    __version__: this package's version.
    EXTENSION_CLS: the dotted name of layerwise's worker extension class;
        pass `LLM(..., worker_extension_cls=EXTENSION_CLS)` to make an engine
        reloadable (`start_engine` does).
    reload, ReloadOptions: stream a checkpoint into a running engine, in layer order; how (the
        options of `layerwise reload`, as `reload(..., options=ReloadOptions(...))` or keywords).
    start_engine, stop_engine, EngineOptions: start an engine with the
        extension and CPU-friendly defaults; shut it down before exit.
    verify_engine, VerifyResult: check an engine against a checkpoint.
    inspect_order: plan a checkpoint from its headers.
    ReloadReport: what a reload did, layer by layer.
    LayerwiseError: the one error type, with a one-line message.
    save_checkpoint: write a checkpoint in layer order, with digests, atomically.
    watch, WatchOptions, WatchEvent: keep an engine on the newest complete
        step of a training run (the `layerwise watch` command's loop).
"""

from __future__ import annotations

from importlib import import_module as _import_module

__version__ = "0.5.5"
# Pass as `LLM(..., worker_extension_cls=EXTENSION_CLS)` to make an engine reloadable.
EXTENSION_CLS = "layerwise_cli.worker.extension.LayerwiseWorkerExtension"
# `layerwise serve`'s endpoint answering a worker call from every data-parallel engine (server.engines_rpc).
ENGINES_RPC_PATH = "/layerwise/engines_rpc"
# The pause under a lease that ends by itself (`server/pause_lease.py`), its renewal and its end.
PAUSE_LEASE_PATH = "/layerwise/pause"
RENEW_LEASE_PATH = "/layerwise/renew"
RESUME_LEASE_PATH = "/layerwise/resume"
# The name of layerwise's backend of vLLM's weight-transfer API (`--weight-transfer-config '{"backend": "layerwise"}'`).
WEIGHT_TRANSFER_BACKEND = "layerwise"
# Where the server answers the per-layer report of the last `/update_weights` of that backend.
UPDATE_REPORT_PATH = "/layerwise/update_report"

_LAZY = {
    "reload": ("layerwise_cli.client.engine.in_process", "reload"),
    "start_engine": ("layerwise_cli.client.engine.in_process", "start_engine"),
    "stop_engine": ("layerwise_cli.client.engine.in_process", "stop_engine"),
    "EngineOptions": ("layerwise_cli.client.engine.in_process", "EngineOptions"),
    "ReloadOptions": ("layerwise_cli.worker.rpc", "ReloadOptions"),
    "ReloadReport": ("layerwise_cli.report.reload_report", "ReloadReport"),
    "inspect_order": ("layerwise_cli.planning.inspect", "inspect_order"),
    "verify_engine": ("layerwise_cli.client.engine.in_process", "verify_engine"),
    "VerifyResult": ("layerwise_cli.report.verify_result", "VerifyResult"),
    "LayerwiseError": ("layerwise_cli.errors", "LayerwiseError"),
    "watch": ("layerwise_cli.client.watch.entry", "watch"),
    "WatchOptions": ("layerwise_cli.client.watch.entry", "WatchOptions"),
    "WatchEvent": ("layerwise_cli.client.watch.events", "WatchEvent"),
    "save_checkpoint": ("layerwise_cli.writer.save", "save_checkpoint"),
    "SavedCheckpoint": ("layerwise_cli.writer.save", "SavedCheckpoint"),
}
__all__ = ["__version__", "EXTENSION_CLS", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(_import_module(module), attr)
    raise AttributeError(f"module 'layerwise_cli' has no attribute {name!r}")
