"""`LayerwiseWeightTransferEngine`: vLLM's weight-transfer engine for the `layerwise` backend, in each worker.

vLLM builds it in every worker when the server runs with `--weight-transfer-config '{"backend": "layerwise"}'`
(`Worker.load_model`), and calls it from the RL routes: `/init_weight_transfer_engine` (`init_transfer_engine`),
`/start_weight_update`, `/update_weights` (`update_weights`, once per source) and `/finish_weight_update`.
Each `update_weights` is a whole reload of its `source`, kept by every rank or rolled back by every rank, so the
engine never serves a half-loaded model between calls; `start` and `finish` have nothing to prepare or finalize
(vLLM's checkpoint-format backends initialize and finalize vLLM's layerwise reload there: here one reload does
both). A failure raises one line (`LayerwiseError`) naming the source and what is wrong; the API server answers
the route with it (`routes.py`).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, fields, replace

from layerwise_cli import vllm_compat, vllm_weight_transfer
from layerwise_cli.errors import LayerwiseError, describe_exception
from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.report.verify_result import merge_verify, verify_failure
from layerwise_cli.worker.proof.verify import verify_against_source
from layerwise_cli.worker.reload.engine_context import engine_config
from layerwise_cli.worker.repairs.derived_state import derived_state_of
from layerwise_cli.worker.rpc import UPDATE_REPORT, ReloadAnswer, TransferUpdate

_VllmEngine = vllm_compat.load(vllm_weight_transfer.WEIGHT_TRANSFER_ENGINE)


@dataclass(frozen=True)
class LayerwiseInitInfo:
    """What `/init_weight_transfer_engine` may carry for this backend (every key optional).

    Attributes:
        pause_lease_s: how long the pause that `/start_weight_update` takes outlives the last call of the update
            (read by the API server, `routes.py`): a client that dies before `/finish_weight_update` leaves the
            server serving again after it.
    """

    pause_lease_s: float = 60.0

    @classmethod
    def from_json(cls, data) -> LayerwiseInitInfo:
        """Read an `init_info` object; refuse an unknown key or a lease that is not a positive number of seconds."""
        if not isinstance(data, dict):
            raise ValueError(f"init_info must be a JSON object, not {type(data).__name__}")
        known = [item.name for item in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"init_info: unknown key(s) {', '.join(map(repr, unknown))} for the layerwise backend; "
                             f"the keys are {', '.join(map(repr, known))}")
        lease = data.get("pause_lease_s", cls.pause_lease_s)
        if isinstance(lease, bool) or not isinstance(lease, int | float) or not 0 < lease <= 3600:
            raise ValueError(f"init_info: 'pause_lease_s' must be a number of seconds in (0, 3600], not {lease!r}")
        return cls(pause_lease_s=float(lease))


class LayerwiseWeightTransferEngine(_VllmEngine):
    """The `layerwise` backend's engine in one worker: each `update_weights` reloads its source in layer order."""

    init_info_cls = LayerwiseInitInfo
    update_info_cls = TransferUpdate
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.worker = vllm_compat.worker_building_engine(model)
        if self.worker is None:
            raise LayerwiseError("found no vLLM worker building this engine (a vLLM whose workers build "
                                 "weight-transfer engines elsewhere than in load_model)", where="layerwise backend")
        self.last_update: dict = {"ok": None}
        self._checked: dict | None = None  # the last update's `verify_against_source` on this worker
        # The report of the last update, readable by name on this worker (`rpc.UPDATE_REPORT`) with or without
        # layerwise's worker extension: vLLM resolves a collective_rpc method name on the worker.
        setattr(self.worker, UPDATE_REPORT, self.update_report)

    def parse_init_info(self, init_dict) -> LayerwiseInitInfo:
        return LayerwiseInitInfo.from_json(init_dict)

    def parse_update_info(self, update_dict) -> TransferUpdate:
        return TransferUpdate.from_json(update_dict)

    def init_transfer_engine(self, init_info: LayerwiseInitInfo) -> None:
        self.init_info = init_info

    def start_weight_update(self) -> None:
        """Nothing to prepare: each update is a whole reload (the API server takes the pause lease)."""

    def finish_weight_update(self) -> None:
        """Nothing to finalize: each update finished its reload (the API server sets the version and resumes)."""

    def update_weights(self, update_info) -> None:
        """Reload `update_info`'s source (vLLM's own `update_weights` also synchronizes an accelerator, which a
        CPU has not: the reload has copied every tensor when it returns)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: TransferUpdate) -> None:
        """Reload the source on this rank, all ranks or none; keep the report; raise one line on failure."""
        from layerwise_cli.worker.reload.agreed import reload_agreed  # noqa: PLC0415 - torch: heavy, only where a tensor is touched
        from layerwise_cli.worker.stream.rank_plan import rank_position  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

        touched = {"engine": False}
        self._checked = None
        check = self._verify(update_info) if update_info.verify else None
        try:
            options = update_info.options.with_switches()
            report = reload_agreed(self.worker, update_info.source, options, touched, check=check)
        except Exception as exc:  # noqa: BLE001 - one line for vLLM's route; the report keeps the details
            error = describe_exception(exc, where=update_info.source)
            self.last_update = ReloadAnswer(ok=False, error=str(error), engine_touched=touched["engine"],
                                            rolled_back=touched.get("rolled_back", False),
                                            position=rank_position(self.worker).to_dict(),
                                            traceback=traceback.format_exc()).to_json()
            raise error from None
        # With `verify`, this worker's own check too: the API server merges the workers' (`merge_verify`).
        self.last_update = {**ReloadAnswer(ok=True, report=report.to_dict()).to_json(), "verify": self._checked}

    def _verify(self, update_info: TransferUpdate):
        """The check `reload_agreed` runs after this rank's reload: every layer against the source (`--verify`)."""
        def verify(report: ReloadReport) -> ReloadReport:
            revision = report.placement.commit or update_info.options.revision
            started = time.perf_counter()
            with engine_config(self.worker):
                found = verify_against_source(self.worker.model_runner.get_model(), update_info.source, revision,
                                              self.worker.model_runner.model_config, derived_state_of(self.worker))
            self._checked = found
            result = merge_verify([found], wall_s=time.perf_counter() - started,
                                  allow_unchecked=update_info.options.allow_unchecked)
            if not result.ok:
                raise LayerwiseError(f"{verify_failure(result)}", where=update_info.source)
            return replace(report, findings=replace(report.findings, verify=result))
        return verify

    def update_report(self) -> dict:
        """The last update on this worker, as a `ReloadAnswer` with its `verify` check (`{"ok": None}` before the
        first)."""
        return self.last_update

    def shutdown(self) -> None:
        """Nothing to release: no connection to a trainer is held."""
