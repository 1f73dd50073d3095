"""The class vLLM mixes into every worker (`worker_extension_cls`): layerwise's remote API."""

from __future__ import annotations

import traceback

from ..errors import LayerwiseError, describe_exception

from .. import EXTENSION_CLS  # noqa: F401 - re-exported for the engine side


class LayerwiseWorkerExtension:
    """Methods callable with `collective_rpc("layerwise_...")` on every worker.

    Every method returns plain JSON-ready data, so the same calls work in
    process (`LLM.collective_rpc`) and over HTTP (`POST /collective_rpc`).
    Failures come back as `{"ok": False, "error": "..."}` rather than
    exceptions: an exception escaping a worker method makes vLLM's engine core
    shut the engine down, and one line must reach the user whichever way they
    called.
    """

    def layerwise_ping(self) -> dict:
        """Prove the extension is loaded; report its version and this worker's rank."""
        from .. import __version__

        return {"ok": True, "version": __version__, "rank": getattr(self, "rank", None)}

    def layerwise_reload(self, source: str, order: str = "layer", allow_partial: bool = False,
                         readahead: bool = True, revision: str | None = None,
                         progress_path: str | None = None) -> dict:
        """Reload SOURCE in place, in `order`, and return this worker's report."""
        from .worker_reload import stream_reload

        touched = {"engine": False}
        try:
            report = _with_rollback(self, touched, lambda: stream_reload(
                self, source, order=order, allow_partial=allow_partial, readahead=readahead,
                revision=revision, progress_path=progress_path,
                on_engine_touched=lambda: touched.update(engine=True)))
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line for the caller
            error = describe_exception(exc)
            return {"ok": False, "error": str(error), "engine_touched": touched["engine"],
                    "rolled_back": touched.get("rolled_back", False),
                    "traceback": traceback.format_exc()}
        self._layerwise_loaded_from = (source, revision)
        return {"ok": True, "report": report.to_dict()}

    def layerwise_checksums(self) -> dict:
        """SHA-256 of every engine tensor that keeps storage, and their storage pointers."""
        from .checksums import model_checksums, storage_pointers

        try:
            model = self.model_runner.get_model()
            return {"ok": True, "rank": getattr(self, "rank", None), "checksums": model_checksums(model),
                    "pointers": storage_pointers(model)}
        except Exception as exc:  # noqa: BLE001 - an exception here would take the engine down
            return {"ok": False, "error": str(describe_exception(exc))}


def _with_rollback(worker, touched: dict, run):
    """Run a reload; if it fails after touching the engine, reload what it had before."""
    try:
        return run()
    except Exception as exc:
        if not touched["engine"]:
            raise
        error = describe_exception(exc)
        previous = getattr(worker, "_layerwise_loaded_from", None)
        source, revision = previous or (str(worker.model_runner.model_config.model), None)
        from .worker_reload import discard_partial_reload, stream_reload

        discard_partial_reload(worker.model_runner.get_model())
        stream_reload(worker, source, revision=revision, allow_partial=True)
        touched["rolled_back"] = True
        raise LayerwiseError(f"{error}; the engine was rolled back to the weights of {source}") from None
