"""One reload on every rank of an engine, kept by all or rolled back by all: what every caller of a reload runs.

The worker extension's `layerwise_reload` (`collective_rpc`) and the `layerwise` backend of vLLM's weight-transfer
API (`server/weight_transfer/engine.py`) both call `reload_agreed`; each turns its outcome into its own answer.
"""

from __future__ import annotations

from collections.abc import Callable

from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.worker.proof.consensus import PeerFailed, all_ranks_agree
from layerwise_cli.worker.reload.handover import EngineUnchanged
from layerwise_cli.worker.reload.hold_point import hold_if_armed
from layerwise_cli.worker.reload.reload_plan import mark_loaded_from
from layerwise_cli.worker.reload.rollback import roll_back
from layerwise_cli.worker.reload.stream_reload import stream_reload
from layerwise_cli.worker.rpc import ReloadOptions
from layerwise_cli.worker.state.layer_records import records_of


def reload_agreed(worker, source: str, asked: ReloadOptions, touched: dict, *,
                  check: Callable[[ReloadReport], ReloadReport] | None = None) -> ReloadReport:
    """Reload SOURCE on this rank; every rank keeps the new weights, or every rank rolls back to the weights it had.

    Args:
        worker: the vLLM worker.
        source: what to load (a folder, a delta step, a Hub repo id, a URL).
        asked: the reload's options.
        touched: filled in as it goes: `engine` (this rank's weights began to change), `rolled_back`.
        check: run on this rank after its reload, before the ranks agree (the weight-transfer backend's
            `verify`); it returns the report to keep, or raises, and then every rank rolls back.

    Returns:
        This rank's report; the worker's `loaded_from` now names SOURCE (a Hub source at its commit).

    Raises:
        Exception: the reload's failure on this rank, or `PeerFailed` when another rank failed, once every rank
            that changed its weights rolled back (the message says to what).
    """
    touched.setdefault("engine", False)

    def engine_touched() -> None:
        touched.update(engine=True)
        hold_if_armed()  # a fault test's moment to kill a node (a no-op unless it armed one)

    report = None
    try:
        report = stream_reload(worker, source, asked, agree=all_ranks_agree, records=records_of(worker),
                               on_engine_touched=engine_touched)
        if check is not None:
            report = check(report)
        failure = None
    except Exception as exc:  # noqa: BLE001 - raised below, after the ranks agreed what to do
        failure = exc
    # Every rank touched its weights (they agreed to); all keep the new ones, or all roll back.
    if touched["engine"] and not all_ranks_agree(failure is None):
        if isinstance(failure, EngineUnchanged):
            touched["engine"] = False  # vLLM refused before it changed a weight here: nothing to roll back
        else:
            roll_back(worker, touched, failure or PeerFailed("another rank of this engine failed during the reload"))
    if failure is not None:
        raise failure
    # A Hub source is recorded at the commit it was read at (`plan_reload`), never at a branch.
    mark_loaded_from(worker, source, report.placement.commit or asked.revision)
    return report
