"""The layer-ordered reload as it runs inside one vLLM worker."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from layerwise_cli.engine_defaults import read_into_place_asked, repairs_disabled
from layerwise_cli.errors import LayerwiseError, describe_exception
from layerwise_cli.planning.plan import simulate_buffering
from layerwise_cli.report.progress import ProgressWriter
from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.report.report_parts import DerivedRefresh, LayerReport
from layerwise_cli.worker.proof.consensus import PeerFailed
from layerwise_cli.worker.proof.early_fingerprints import EarlyFingerprints
from layerwise_cli.worker.reload.completion_check import (
    Unloaded,
    peak_message,
    stale_message,
    unloaded_description,
    unloaded_layer_watch,
    unloaded_message,
)
from layerwise_cli.worker.reload.probe import BufferProbe, process_disk_read_bytes
from layerwise_cli.worker.reload.reload_plan import plan_reload
from layerwise_cli.worker.reload.unchanged_layers import UnchangedLayers, quiet_skipped_layers
from layerwise_cli.worker.repairs.after_reload import apply_repairs
from layerwise_cli.worker.repairs.amx_mla import give_back_weights
from layerwise_cli.worker.repairs.derived_state import aliases_left_stale, derived_state_of
from layerwise_cli.worker.repairs.put_back_layers import holding_parents, load_put_back_layers
from layerwise_cli.worker.state.layer_records import REASON_UNCHANGED, LayerRecords
from layerwise_cli.worker.state.worker_state import loader_facts_of
from layerwise_cli.worker.stream.in_place import in_place_materialization
from layerwise_cli.worker.stream.loader_copies import LoaderWatch
from layerwise_cli.worker.stream.open_stream import OpenStream
from layerwise_cli.worker.stream.read_ahead import open_stream
from layerwise_cli.worker.stream.read_into_place import place_reader
from layerwise_cli.worker.stream.read_order import pipelined_order
from layerwise_cli.worker.stream.shard_reader import ShardReader
from layerwise_cli.worker.stream.stats import ReadAheadStats

ORDERS = ("layer", "file")


def engine_config(worker):
    """The vLLM config context the worker's own reload runs under (quant methods and loaders may read it)."""
    import contextlib

    config = getattr(worker, "vllm_config", None)
    if config is None:
        return contextlib.nullcontext()
    from layerwise_cli import vllm_compat

    return vllm_compat.set_current_vllm_config(config)


def stream_reload(worker, source: str, *, order: str = "layer", allow_partial: bool = False,
                  readahead: bool = True, revision: str | None = None,
                  on_engine_touched=None, progress_path: str | None = None,
                  allow_nonfinite: bool = False, agree: Callable[[bool], bool] | None = None,
                  records: LayerRecords | None = None, all_layers: bool = False,
                  repairs: bool = True, in_place: bool = True, require_complete: bool = True,
                  restore_partial: bool = False, read_into_place: bool = False) -> ReloadReport:
    """Pre-flight SOURCE against this worker's model, then reload it in `order`, measuring.

    Args:
        worker: the vLLM worker (`self` of the worker extension).
        source: a directory or file on this machine, or a Hub repo id.
        order: `layer` (this tool's plan) or `file` (what vLLM's loader reads).
        allow_partial: accept checkpoints that cover only some parameters.
        readahead: read the next layer while the engine loads the current one.
        revision: Hub revision for a repo id.
        on_engine_touched: called once pre-flight passed, just before the
            engine's weights start to change.
        progress_path: a file to append one JSON line per completed layer to
            (rank 0 only), for the command's progress bar.
        allow_nonfinite: load tensors holding NaN or Inf; by default a layer
            holding any is refused before it is handed over (the caller rolls
            back the layers already loaded).
        agree: every rank of the engine votes with it once pre-flight is over
            (`consensus.all_ranks_agree`); a rank that failed votes no, and
            no rank touches its weights unless all voted yes.
        records: this worker's records (`layer_records.records_of`): a layer
            whose source digest and state match its record is skipped (not
            handed to vLLM, which keeps it), and every layer handed over is
            recorded afresh once the reload succeeded. None: no skip, no record.
        all_layers: hand every layer over (and record them), whatever the records say.
        repairs: refresh what vLLM's reload leaves stale (`repairs.after_reload`); False is the
            diagnostic switch `LAYERWISE_NO_CPU_FIXUPS`.
        require_complete: raise `LayerwiseError` (after vLLM finished; the caller rolls back) when vLLM
            could not load a layer it was handed (`completion.unloaded_layer_watch`); False only notes them.
        restore_partial: load the layers vLLM processed partly loaded with the model's own loader even with the
            repairs off (a rollback: vLLM overwrote them, unlike the layers it put back unloaded).
        in_place: let vLLM load a layer into the engine's own tensors where its
            processing keeps their layout (`in_place`); False (or
            `LAYERWISE_FRESH_BUFFERS` set in the worker) leaves every layer to
            vLLM's fresh buffers.
        read_into_place: on the CPU, read plain-copy tensors of layers loaded in place straight from the file
            into the engine's tensors (`read_into_place`; also `LAYERWISE_READ_INTO_PLACE` in the worker).

    Returns:
        This worker's report.
    """
    if order not in ORDERS:
        raise LayerwiseError(f"unknown order {order!r}: use layer or file")
    try:
        planned = plan_reload(worker, source, revision=revision, allow_partial=allow_partial)
        model = worker.model_runner.get_model()
        local, checkpoint, position, mine, notes = (planned.local, planned.checkpoint, planned.position,
                                                    planned.mine, planned.notes)
        tp_size, tp_rank = position.tp_size, position.tp_rank
        plan = mine.plan
        # The probe and the prediction both speak engine module names. Tensors vLLM's loader skips on
        # purpose (no parent layer) are not read: vLLM would drop them unread too.
        engine_stream = [item for item in mine.engine_stream(order) if item.parent is not None]
        draft = getattr(getattr(worker, "vllm_config", None), "speculative_config", None)
        if draft is not None:
            notes.append("the engine runs a draft model (speculative decoding): layerwise reloads the target "
                         "model only, so the draft keeps its weights")
        engine_name = mine.parent_engine_names()
        # vLLM holds these on this rank until the end of the stream (padded vocabulary, partial fused layers).
        held_here = {engine_name.get(name, name): plan.held[name].reason for name in plan.held_on(tp_rank)}
        if order == "layer":
            # A large first or last layer moved inward: the engine does not wait for it (`read_order`).
            engine_stream = pipelined_order(engine_stream, held_here)
        folder = local if local.is_dir() else local.parent
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
        # Found before the first reload changes anything, once per engine (vLLM's record and tensors hold).
        derived = derived_state_of(worker)
        skip = UnchangedLayers.build(model, checkpoint, engine_stream, order, records, all_layers=all_layers,
                                     checks_finite=not allow_nonfinite, on_host=device.type == "cpu")
        stats = ReadAheadStats()
        rank = getattr(worker, "rank", 0) or 0
        progress = ProgressWriter(progress_path if rank == 0 else None, len(plan.layers), plan.loaded_bytes)
        # On the CPU the reading thread fingerprints each layer vLLM finished, for the records, while the engine
        # loads the next ones (`early_fingerprints`).
        early = EarlyFingerprints(skip.modules, skip.covers) if records is not None and device.type == "cpu" else None

        def layer_done(name: str, timing) -> None:
            progress.write({"event": "layer", "name": name, "tensors": timing.tensors, "bytes": timing.bytes})
            if early is not None:
                early.layer_done(name)

        probe = BufferProbe(model, on_layer_done=layer_done)
        # A skipped layer counts as done for the progress bar, as soon as it is known to be skipped.
        for name in sorted(skip.skipped):
            progress.write({"event": "layer", "name": name, "skipped": True})
        decide_after_read = skip.skip_layer

        def skip_after_read(parent: str, digest: str) -> bool:
            skipped = decide_after_read(parent, digest)
            if skipped:
                progress.write({"event": "layer", "name": parent, "skipped": True})
            return skipped

        facts = loader_facts_of(worker)
        watch = LoaderWatch(model, facts)  # what the loaders showed, and this reload's watch over them
        into_place = place_reader(model, folder, skip.stream, facts, watch, enabled=in_place and device.type == "cpu"
                                  and (read_into_place or read_into_place_asked()))

        def open_source() -> OpenStream:
            return open_stream(skip.stream, folder, device=device, readahead=readahead, stats=stats,
                               into_place=into_place,
                               check_finite=not allow_nonfinite, hash_layers=skip.hash_layers,
                               digests=skip.read_digests, skip_layer=skip_after_read if decide_after_read else None,
                               skipped=skip.skipped, samples=skip.read_samples, may_skip=skip.samples_match,
                               idle=early.step if early is not None else None)

        def weights(opened: OpenStream) -> Iterator[tuple[str, torch.Tensor]]:
            # Handover: the engine's thread inside this generator (waiting for the reader, bookkeeping);
            # everything else of the reload's wall time is vLLM's.
            asked = time.perf_counter()
            timer["asked"] = True  # vLLM began its reload: `initialize_layerwise_reload` put the layers on meta
            if into_place is not None:
                into_place.engine_started.set()  # the reader may now write into the engine's tensors
            for item, tensor in opened:
                watch.handing(item.entry.name, item.entry.dtype, tensor)
                skip.handing_over(item.parent)
                if early is not None:
                    early.handing_over(item.parent)
                probe.before_handover(item.entry.name, item.parent, item.entry.nbytes)
                timer["handover_s"] += time.perf_counter() - asked
                yield item.entry.name, tensor
                asked = time.perf_counter()
            probe.finish()
            timer["stream_done"] = time.perf_counter()
            timer["handover_s"] += timer["stream_done"] - asked

    except Exception:
        if agree is not None:
            agree(False)  # tell the other ranks: none of them may start
        raise
    if agree is not None and not agree(True):
        raise PeerFailed("pre-flight failed on another rank of this engine; nothing was changed")
    timer: dict[str, float | bool] = {"handover_s": 0.0, "asked": False}
    if on_engine_touched is not None:
        on_engine_touched()
    start = time.perf_counter()
    disk_before = process_disk_read_bytes()
    # The reading thread starts now: the first layers are read while vLLM prepares its reload.
    opened = open_source() if any(item.parent is not None for item in skip.stream) else None
    if early is not None and opened is not None:
        early.wake = opened.wake
    failed = True
    loaded_in_place = None
    # SOURCE's tensors again, for the layers loaded after vLLM's reload and for the repairs.
    reader = ShardReader(folder)
    unloaded = Unloaded()  # modules vLLM could not load (it put their tensors back, or processed them partly loaded)
    never_buffered: list[str] = []  # the parent layers of those it put back: vLLM buffered none of their tensors
    try:
        try:
            if opened is not None:
                with quiet_skipped_layers(skip, model), in_place_materialization(model, in_place) as loaded_in_place, \
                        unloaded_layer_watch(model, lambda: probe.timings.keys(),
                                             {item.parent for item in engine_stream}) as unloaded, \
                        watch.watching(active=into_place is not None):
                    try:
                        give_back_weights(model)  # what vLLM's AMX MLA backend emptied (a no-op elsewhere)
                        worker.reload_weights(weights_iterator=weights(opened), is_checkpoint_format=True)
                    except Exception as exc:
                        if not timer["asked"] and not on_meta_device(model):
                            raise EngineUnchanged(f"vLLM refused the reload before changing any weight: "
                                                  f"{describe_exception(exc)}") from exc
                        raise
                # Every region read into place in a layer vLLM loaded in place got its copy (else: not shown).
                watch.check_confirmed(loaded_in_place.names)
                put_back_unloaded = [name for name in unloaded.modules if name not in unloaded.partial]
                never_buffered = holding_parents(put_back_unloaded, probe.timings)
                repairing = repairs and not repairs_disabled()
                load_again = unloaded.modules if repairing else unloaded.partial if restore_partial else []
                if load_again:
                    # Their model's own loader now writes them in place: those vLLM put back as they were, and
                    # those it processed partly loaded.
                    put_back = holding_parents(load_again, probe.timings)
                    with engine_config(worker):
                        handed = load_put_back_layers(model, put_back, engine_stream, reader.read)
                    notes.append(f"loaded {len(put_back)} layer(s) vLLM's reload could not ({', '.join(load_again)}: "
                                 f"their model writes them outside what the reload sees) with the model's own "
                                 f"loader after the reload ({handed} tensor(s))")
                left = [name for name in unloaded.modules if name not in load_again]
                if left and require_complete:
                    raise LayerwiseError(unloaded_message(left))
                if left:
                    notes.append(f"{unloaded_description(left)}: they keep their previous weights (accepted "
                                 "by --allow-unchecked)")
                unloaded.modules = left
            else:
                # Every layer skipped from the headers: vLLM would only move every layer to meta and back.
                probe.finish()
        finally:
            progress.write({"event": "end"})
            progress.close()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # Each repair is found by its rule and does nothing where it does not apply (on a GPU: nothing).
        with engine_config(worker):
            repair_notes, refreshed = apply_repairs(
                # A layer vLLM put back unloaded holds what it held: repacking it again would corrupt it.
                model, set(probe.timings) - set(holding_parents(unloaded.modules, probe.timings)),
                derived=derived, enabled=repairs,
                tensors_of=lambda parent: [(item.entry.name, reader.read(item)) for item in engine_stream
                                           if item.parent == parent])
        stale = aliases_left_stale(model, derived, set(probe.timings), refreshed)
        if stale and require_complete:
            raise LayerwiseError(stale_message(stale))
        if stale:
            notes.append(stale_message(stale, accepted=True))
        failed = False
    finally:
        reader.close()
        if into_place is not None:
            into_place.close()
        facts.after_reload(watch, failed=failed, in_place=loaded_in_place, handed=set(probe.timings),
                           watched=into_place is not None)
        if opened is not None:
            opened.close()  # stops the reading thread, unless the stream ended (it finishes below)
        if failed and stats.hashing_done is not None:
            stats.hashing_done()
    notes.extend(repair_notes)
    if device.type == "cuda" and refreshed:
        torch.cuda.synchronize(device)
    end = time.perf_counter()
    disk_after = process_disk_read_bytes()
    if stats.hashing_done is not None:
        stats.hashing_done()  # the digests of the layers hashed after their handover, for the records
    hash_wait_s = time.perf_counter() - end
    skip.record(model, checked=not allow_nonfinite,
                fingerprints=early.valid(entry["module"] for entry in refreshed) if early is not None else None)
    notes.extend(skip.notes())
    # vLLM holds these on this rank until the end of the stream (padded vocabulary), unless skipped.
    held_here = {name: why for name, why in held_here.items() if name not in skip.skipped}
    delivered = [item for item in engine_stream if item.parent not in skip.skipped]
    # A layer vLLM could not load (its model writes it outside the reload's loaders) was never buffered: each of
    # its tensors counts only while it is handed over, as a layer of its own.
    buffered = [replace(item, parent=f"{item.parent}:{item.entry.name}") if item.parent in never_buffered else item
                for item in delivered]
    predicted = simulate_buffering(buffered, order, held_here, rank=tp_rank if tp_size > 1 else None)
    if probe.peak != predicted.peak_buffer_bytes:
        # vLLM buffered otherwise than the plan says it must: a layer completed later, or never, than planned.
        message = peak_message(probe.peak, predicted.peak_buffer_bytes, probe.peak_tensor)
        if unloaded.partial:
            # Explained: the layers vLLM processed partly loaded were found, and loaded again after it.
            notes.append(f"{message}: explained by the partly loaded layer(s) {', '.join(unloaded.partial)}, "
                         "loaded again after vLLM's reload")
        elif require_complete:
            raise LayerwiseError(message)
        else:
            notes.append(f"{message} (accepted by --allow-unchecked)")
    sizes = skip.layer_sizes
    layers = []
    # Layers in the order the stream reached their first tensor (skipped ones too, marked).
    for name in dict.fromkeys(item.parent for item in engine_stream if item.parent is not None):
        if name in skip.skipped:
            tensors, nbytes = sizes[name]
            layers.append(LayerReport(name=name, tensors=tensors, bytes=nbytes, load_s=0.0, process_s=0.0,
                                      buffered_bytes_at_completion=0, skipped=REASON_UNCHANGED))
            continue
        timing = probe.timings.get(name)
        if timing is None:
            continue
        done = timing.done if timing.done is not None else end
        layers.append(LayerReport(
            name=name,
            tensors=timing.tensors,
            bytes=timing.bytes,
            load_s=timing.last_handover - timing.first,
            process_s=max(0.0, done - timing.last_handover),
            buffered_bytes_at_completion=timing.buffered_at_completion,
            completed_during_stream=timing.done is not None,
            held_to_end=held_here.get(name),
            in_place=loaded_in_place is not None and name in loaded_in_place.names,
            read_into_place=into_place is not None and name in into_place.layers,
        ))
    return ReloadReport(
        order=order,
        source=source,
        wall_s=end - start,
        bytes=sum(item.entry.nbytes for item in delivered if item.parent is not None),
        tensors=len(delivered),
        peak_buffer_bytes=probe.peak,
        peak_tensor=probe.peak_tensor,
        predicted_peak_buffer_bytes=predicted.peak_buffer_bytes,
        largest_layer_bytes=plan.largest_layer_bytes,
        held_to_end_bytes=sum(sizes[name][1] for name in held_here if name in sizes),
        above_largest_layer_because=plan.excess_reason(predicted),
        readahead_peak_bytes=stats.peak_bytes,
        layers=layers,
        rank=getattr(worker, "rank", None),
        position=position.to_dict(),
        elsewhere_tensors=mine.elsewhere_tensors,
        elsewhere_bytes=mine.elsewhere_bytes,
        disk_read_bytes=disk_after - disk_before if disk_before is not None and disk_after is not None else None,
        unexpected=probe.unexpected,
        mapping=plan.mapping.description,
        device=str(device),
        finalize_s=end - timer.get("stream_done", end),
        notes=notes,
        skipped_layers=len(skip.skipped),
        skipped_bytes=sum(sizes[name][1] for name in skip.skipped),
        read_bytes=stats.read_bytes,
        engine_id=records.engine_id if records is not None else None,
        all_layers=all_layers,
        digests=skip.digest_source(),
        stale_layers=len(skip.decider.stale) if skip.decider is not None else 0,
        hash_s=stats.hash_s,
        fingerprint_s=skip.fingerprint_s + (early.seconds if early is not None else 0.0),
        read_s=stats.read_s,
        sample_s=stats.sample_s,
        check_s=stats.check_s,
        handover_s=timer["handover_s"],
        vllm_s=max(0.0, end - start - timer["handover_s"]),
        hashed_after_handover=stats.hashed_after_handover,
        unhashed_layers=stats.unhashed_layers,
        hash_wait_s=hash_wait_s,
        reader_cpus=stats.reader_cpus,
        spot_checked_layers=len(skip.spot.confirmed) + len(skip.spot.stale) if skip.spot is not None else 0,
        spot_check_bytes=skip.spot.bytes_read if skip.spot is not None else 0,
        spot_check_s=skip.spot.seconds if skip.spot is not None else 0.0,
        stale_header_digests=[found.to_dict() for found in skip.stale_digests()],
        refreshed=[DerivedRefresh(**entry) for entry in refreshed],
        in_place_layers=len(loaded_in_place.names) if loaded_in_place is not None else 0,
        in_place_bytes=loaded_in_place.bytes if loaded_in_place is not None else 0,
        read_into_place_layers=len(into_place.layers) if into_place is not None else 0,
        read_into_place_bytes=into_place.bytes if into_place is not None else 0,
    )


class EngineUnchanged(LayerwiseError):
    """vLLM's `reload_weights` failed before it changed any weight of this rank (nothing to roll back here).

    vLLM 0.34 checks for free device memory first with its extensible KV cache (the CUDA default)."""


def on_meta_device(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of MODEL is on the meta device (a reload vLLM began and did not finish)."""
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))

