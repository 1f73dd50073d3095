"""The class vLLM mixes into every worker (`worker_extension_cls`): layerwise's remote API."""

from __future__ import annotations

import time
import traceback

from layerwise_cli import (
    EXTENSION_CLS,  # noqa: F401 - re-exported for the engine side
    __version__,
)
from layerwise_cli.checkpoint.delta.source import is_remote_step, open_step
from layerwise_cli.checkpoint.sources import open_checkpoint, resolve_local
from layerwise_cli.errors import describe_exception
from layerwise_cli.vllm_logs import silence_rotary_reload_warning
from layerwise_cli.worker.proof.checksums import model_checksums, storage_pointers
from layerwise_cli.worker.proof.consensus import PeerFailed
from layerwise_cli.worker.proof.fingerprints import model_fingerprints
from layerwise_cli.worker.proof.verify import verify_against_source
from layerwise_cli.worker.quantization import online_quant  # noqa: F401 - registers layerwise's online quantizations here
from layerwise_cli.worker.reload.agreed import reload_agreed
from layerwise_cli.worker.reload.engine_context import engine_config
from layerwise_cli.worker.reload.reload_plan import loaded_from, prepare_for_reload
from layerwise_cli.worker.reload.reload_run import plan_run
from layerwise_cli.worker.repairs.derived_state import derived_state_of
from layerwise_cli.worker.rpc import (
    ChecksumsAnswer,
    FingerprintsAnswer,
    PingAnswer,
    PreflightAnswer,
    ReloadAnswer,
    ReloadOptions,
    VerifyAnswer,
)
from layerwise_cli.worker.state.layer_records import records_of
from layerwise_cli.worker.stream.rank_plan import rank_position

# vLLM imports this module in every worker: the filter lands where the warning is logged.
silence_rotary_reload_warning()


class LayerwiseWorkerExtension:
    """Methods callable with `collective_rpc("layerwise_...")` on every worker.

    Each method's name, arguments and answer are declared in `worker/rpc.py`
    (`rpc.RELOAD`, `ReloadCall`, `ReloadAnswer`, ...), which the client imports
    too. Every method returns plain JSON-ready data (the answer's `to_json()`), so the same calls work in
    process (`LLM.collective_rpc`) and over HTTP (`POST /collective_rpc`).
    Failures come back as `{"ok": False, "error": "..."}` rather than
    exceptions: an exception escaping a worker method makes vLLM's engine core
    shut the engine down, and one line must reach the user whichever way they
    called.
    """

    def layerwise_ping(self) -> dict:
        """Prove the extension is loaded; report its version and this worker's rank and place (tp/pp/dp)."""
        records = records_of(self)
        return PingAnswer(ok=True, version=__version__, rank=getattr(self, "rank", None),
                          position=rank_position(self).to_dict(), engine_id=records.engine_id,
                          recorded_layers=len(records)).to_json()

    def layerwise_reload(self, source: str, **options) -> dict:
        """Reload SOURCE in place and return this worker's report; OPTIONS are a `ReloadOptions`' `to_json()`.

        A parent layer holding NaN or Inf is refused before it is handed over
        (and the layers already loaded are rolled back) unless `allow_nonfinite`.
        A layer the engine already holds (same source digest as this worker's
        record, state untouched since) is skipped unless `all_layers`.
        `repairs=False` leaves what vLLM's reload leaves stale (the diagnostic
        switch `LAYERWISE_NO_REPAIRS`, set in the caller's environment).
        `in_place=False` has vLLM materialize every layer in fresh buffers (`worker/stream/in_place.py`; the
        worker's `LAYERWISE_FRESH_BUFFERS=1` does the same).
        A layer vLLM could not load (it counted no element loaded and put the old tensors back) fails the
        reload, rolled back, unless `allow_unchecked` (then the report notes it). An option this version does
        not know (a newer client's) is left out (`ReloadOptions.from_json`).
        """
        touched = {"engine": False}
        try:
            report = reload_agreed(self, source, ReloadOptions.from_json(options), touched)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line for the caller
            error = describe_exception(exc)
            return ReloadAnswer(ok=False, error=str(error), engine_touched=touched["engine"],
                                rolled_back=touched.get("rolled_back", False),
                                followed_another_rank=isinstance(exc, PeerFailed),
                                position=rank_position(self).to_dict(), traceback=traceback.format_exc()).to_json()
        return ReloadAnswer(ok=True, report=report.to_dict()).to_json()

    def layerwise_preflight(self, source: str, revision: str | None = None, allow_partial: bool = False,
                            delta_base_check: bool = True, allow_nonfinite: bool = False) -> dict:
        """Pre-flight SOURCE as a reload would (its headers, this rank's plan, the checks); change nothing.

        Also says where the weights this worker holds came from (`loaded_from`) and whether their headers can
        still be read here: what a fleet reloads to go back when another server fails.

        A Hub commit not yet on this machine is fetched here, before any server pauses: the tensors the reload
        will hand over (the layers its header digests skip are not), kept in the Hub cache, where the reload
        finds them (`remote_stream`). A sparse delta is read and checked here as the reload checks it: its
        positions, its new values, and (unless DELTA_BASE_CHECK is off, as for `watch`'s reloads, which rebuild
        it whatever the engine holds) that the engine holds its base (`reload_run.plan_run`).
        """
        began = time.time()  # the local files a delta step is rebuilt from are pinned unchanged since
        try:
            run = plan_run(self, source, ReloadOptions(revision=revision, allow_partial=allow_partial,
                                                       delta_base_check=delta_base_check,
                                                       allow_nonfinite=allow_nonfinite), records_of(self))
            try:
                if run.remote is not None:
                    run.remote.check()
            finally:
                if run.remote is not None:
                    run.remote.close()
            planned = run.planned
            # Opened, fetched, checked (and a delta the reload would rebuild, rebuilt) now, while the server
            # serves: the reload at this pin takes it.
            prepare_for_reload(self, source, revision, planned,
                               rebuilds=run.patch is None or bool(run.patch.not_patched),
                               check_finite=not allow_nonfinite, began=began)
            back, back_revision = loaded_from(self)
            try:
                if is_remote_step(back):
                    open_step(back, back_revision)  # by range, at its pin (a delta's chain): never downloaded
                else:
                    open_checkpoint(str(resolve_local(back, back_revision)))
                back_error = None
            except Exception as exc:  # noqa: BLE001 - reported: the fleet decides
                back_error = str(describe_exception(exc, where=back))
            return PreflightAnswer(ok=True, rank=getattr(self, "rank", None), notes=list(planned.notes),
                                   loaded_from=back, loaded_revision=back_revision, back_error=back_error).to_json()
        except Exception as exc:  # noqa: BLE001 - an exception here would take the engine down
            return PreflightAnswer(ok=False, error=str(describe_exception(exc)),
                                   position=rank_position(self).to_dict()).to_json()

    def layerwise_checksums(self) -> dict:
        """SHA-256 of every engine tensor that keeps storage, and their storage pointers."""
        try:
            model = self.model_runner.get_model()
            return ChecksumsAnswer(ok=True, rank=getattr(self, "rank", None), checksums=model_checksums(model),
                                   pointers=storage_pointers(model)).to_json()
        except Exception as exc:  # noqa: BLE001 - an exception here would take the engine down
            return ChecksumsAnswer(ok=False, error=str(describe_exception(exc))).to_json()

    def layerwise_fingerprints(self) -> dict:
        """A digest of what every module computes with, including weights hidden in kernel handles.

        Stored tensors are digested as they are; a linear layer whose weight
        lives only inside an opaque kernel handle (CPU oneDNN repacking) is
        read back through its own kernel (see `module_fingerprints`). Two
        engines on the same machine and configuration that hold the same
        weights give identical fingerprints.
        """
        try:
            model = self.model_runner.get_model()
            with engine_config(self):
                return FingerprintsAnswer(ok=True, rank=getattr(self, "rank", None),
                                          fingerprints=model_fingerprints(model)).to_json()
        except Exception as exc:  # noqa: BLE001 - an exception here would take the engine down
            return FingerprintsAnswer(ok=False, error=str(describe_exception(exc))).to_json()

    def layerwise_verify(self, source: str, revision: str | None = None) -> dict:
        """Check, parent layer by parent layer, that the engine holds what SOURCE must produce.

        Each layer SOURCE covers is loaded afresh into a private copy of the
        engine's layer (vLLM's own loaders and processing), and the copy's
        fingerprints are compared with the live layer's. The engine's weights
        are not changed.
        """
        try:
            with engine_config(self):
                result = verify_against_source(self.model_runner.get_model(), source, revision,
                                               self.model_runner.model_config, derived_state_of(self))
            return VerifyAnswer(ok=True, rank=getattr(self, "rank", None), verify=result).to_json()
        except Exception as exc:  # noqa: BLE001 - an exception here would take the engine down
            return VerifyAnswer(ok=False, error=str(describe_exception(exc)),
                                traceback=traceback.format_exc()).to_json()
