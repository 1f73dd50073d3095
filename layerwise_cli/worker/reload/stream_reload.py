"""The layer-ordered reload as it runs inside one vLLM worker: its phases, in order.

1. plan: SOURCE opened, planned for this rank and pre-flighted; what to skip, and for a sparse delta what to
   patch in place; the measures set up (`reload_run.plan_run`, `reload_plan.plan_reload`, `delta_patch`).
2. vote: every rank of the engine says whether its pre-flight passed; none touches its weights unless all did
   (`plan_and_vote`).
3. patch a sparse delta into the layers kept in checkpoint layout (`delta_patch.DeltaPatch.apply`), then open
   the stream: the reading thread starts (`handover.open_source`).
4. hand over: vLLM's own `reload_weights` over the stream, under its watches (`handover.hand_over`).
5. load what vLLM could not, and repair what it left stale (`after_vllm.py`).
6. record: the layers handed over are recorded for the next reload's skip (`record`).
7. prove: every layer loaded, nothing derived left stale, the peak as predicted (`prove.py`; the first two
   run at the end of the phase whose work they check).
8. report: this worker's `ReloadReport` (`run_report.build_report`).

What the phases share is one `ReloadRun` (`reload_run.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from layerwise_cli.errors import LayerwiseError
from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.worker.proof.consensus import PeerFailed
from layerwise_cli.worker.reload.after_vllm import load_what_vllm_could_not, repair
from layerwise_cli.worker.reload.handover import hand_over, open_source
from layerwise_cli.worker.reload.probe import process_disk_read_bytes
from layerwise_cli.worker.reload.prove import prove_peak
from layerwise_cli.worker.reload.reload_run import ReloadRun, plan_run
from layerwise_cli.worker.reload.run_report import build_report
from layerwise_cli.worker.rpc import ReloadOptions
from layerwise_cli.worker.state.layer_records import LayerRecords
from layerwise_cli.worker.stream.shard_reader import ShardReader

ORDERS = ("layer", "file")


def stream_reload(worker, source: str, options: ReloadOptions | None = None, *,
                  agree: Callable[[bool], bool] | None = None, records: LayerRecords | None = None,
                  on_engine_touched: Callable[[], None] | None = None,
                  restore_partial: bool = False) -> ReloadReport:
    """Pre-flight SOURCE against this worker's model, then reload it as OPTIONS say, measuring.

    Args:
        worker: the vLLM worker (`self` of the worker extension).
        source: a directory or file on this machine, or a Hub repo id.
        options: how to reload (`ReloadOptions`: the order, the checks to relax, the switches); None: the defaults.
        agree: every rank of the engine votes with it once pre-flight is over
            (`consensus.all_ranks_agree`); a rank that failed votes no, and
            no rank touches its weights unless all voted yes.
        records: this worker's records (`layer_records.records_of`): a layer
            whose source digest and state match its record is skipped (not
            handed to vLLM, which keeps it), and every layer handed over is
            recorded afresh once the reload succeeded. None: no skip, no record.
        on_engine_touched: called once pre-flight passed, just before the
            engine's weights start to change.
        restore_partial: load the layers vLLM processed partly loaded with the model's own loader even with the
            repairs off (a rollback: vLLM overwrote them, unlike the layers it put back unloaded).

    Returns:
        This worker's report.

    Raises:
        LayerwiseError: pre-flight failed (nothing changed), or the reload failed or could not be shown
            complete (the caller rolls back); `PeerFailed` when another rank's pre-flight failed.
    """
    planning = time.perf_counter()
    run = plan_and_vote(worker, source, options or ReloadOptions(), records, agree)
    run.plan_s = time.perf_counter() - planning
    try:
        if on_engine_touched is not None:
            on_engine_touched()
        run.start = time.perf_counter()
        run.disk_read_before = process_disk_read_bytes()
        if run.patch is not None:
            # A delta's layers kept in checkpoint layout: their new values written where they are, proved.
            run.patch.apply(run.skip.modules, run.records, on_layer=run.layer_patched, on_host=run.device.type == "cpu")
            run.patch.prove_state(run.skip._fingerprints)
        # The reading thread starts now: the first layers are read while vLLM prepares its reload.
        opened = open_source(run)
        # SOURCE's tensors again, for the layers loaded after vLLM's reload and for the repairs.
        reader = ShardReader(run.folder, remote=run.remote, delta=run.planned.checkpoint.delta)
        failed = True
        try:
            try:
                if opened is not None:
                    hand_over(run, opened)
                    load_what_vllm_could_not(run, reader, restore_partial=restore_partial)
                else:
                    # Every layer skipped from the headers: vLLM would only move every layer to meta and back.
                    run.probe.finish()
            finally:
                run.progress.write({"event": "end"})
                run.progress.close()
            repair(run, reader)
            if run.remote is not None:
                # A shard whose last bytes arrived after the reader had them is checked against its sha256 here.
                run.remote.check()
            failed = False
        finally:
            reader.close()
            if opened is not None:
                opened.close()  # stops the reading thread, unless the stream ended (it finishes below)
            if failed and run.stats.hashing_done is not None:
                run.stats.hashing_done()
        record(run)
        prove_peak(run)
        return build_report(run)
    finally:
        if run.remote is not None:
            run.remote.close()


def plan_and_vote(worker, source: str, options: ReloadOptions, records: LayerRecords | None,
                  agree: Callable[[bool], bool] | None) -> ReloadRun:
    """The plan phase, then the vote: this rank's plan once every rank of the engine passed its pre-flight.

    Raises:
        LayerwiseError: this rank's pre-flight failed (it voted no).
        PeerFailed: another rank's did.
    """
    if options.order not in ORDERS:
        raise LayerwiseError(f"unknown order {options.order!r}: use layer or file")
    try:
        run = plan_run(worker, source, options, records)
    except Exception:
        if agree is not None:
            agree(False)  # tell the other ranks: none of them may start
        raise
    if agree is not None and not agree(True):
        if run.remote is not None:
            run.remote.close()
        raise PeerFailed("pre-flight failed on another rank of this engine; nothing was changed")
    return run


def record(run: ReloadRun) -> None:
    """Stop the clock once the engine holds SOURCE, then record the layers handed over (`LayerSkip.record`)."""
    run.notes.extend(run.repair_notes)
    if run.device.type == "cuda" and run.refreshed:
        torch.cuda.synchronize(run.device)
    run.end = time.perf_counter()
    run.disk_read_after = process_disk_read_bytes()
    if run.stats.hashing_done is not None:
        run.stats.hashing_done()  # the digests of the layers hashed after their handover, for the records
    run.hash_wait_s = time.perf_counter() - run.end
    early = run.early
    run.skip.record(run.model, checked=not run.options.allow_nonfinite,
                    fingerprints=early.valid(entry["module"] for entry in run.refreshed) if early is not None
                    else None)
    patch = run.patch
    if patch is not None and patch.patched:
        # A patched layer around one vLLM reloaded after the patch (its fingerprint covers it) is read again.
        again = [name for name in patch.patched if any(inner.startswith(name + ".") for inner in run.skip.handed)]
        patch.record(run.records, run.skip.groups, run.skip._fingerprints(again) if again else {},
                     checked=not run.options.allow_nonfinite)
    run.notes.extend(run.skip.notes())
