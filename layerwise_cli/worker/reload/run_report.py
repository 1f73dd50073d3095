"""The report phase: what one reload on one worker did, layer by layer, as a `ReloadReport`."""

from __future__ import annotations

from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.report.report_parts import DerivedRefresh, LayerReport
from layerwise_cli.worker.reload.reload_run import ReloadRun
from layerwise_cli.worker.state.layer_records import REASON_UNCHANGED


def layer_reports(run: ReloadRun) -> list[LayerReport]:
    """Each layer in the order the stream reached its first tensor (skipped ones too, marked)."""
    sizes, held, loaded_in_place = run.skip.layer_sizes, run.held_to_end(), run.loaded_in_place
    layers = []
    for name in dict.fromkeys(item.parent for item in run.engine_stream if item.parent is not None):
        if name in run.skip.skipped:
            tensors, nbytes = sizes[name]
            layers.append(LayerReport(name=name, tensors=tensors, bytes=nbytes, load_s=0.0, process_s=0.0,
                                      buffered_bytes_at_completion=0, skipped=REASON_UNCHANGED))
            continue
        timing = run.probe.timings.get(name)
        if timing is None:
            continue
        done = timing.done if timing.done is not None else run.end
        layers.append(LayerReport(
            name=name,
            tensors=timing.tensors,
            bytes=timing.bytes,
            load_s=timing.last_handover - timing.first,
            process_s=max(0.0, done - timing.last_handover),
            buffered_bytes_at_completion=timing.buffered_at_completion,
            completed_during_stream=timing.done is not None,
            held_to_end=held.get(name),
            in_place=loaded_in_place is not None and name in loaded_in_place.names,
        ))
    return layers


def build_report(run: ReloadRun) -> ReloadReport:
    """This worker's report, once every phase ran (the prediction included, `prove.prove_peak`)."""
    skip, stats, probe, plan, predicted, early = run.skip, run.stats, run.probe, run.plan, run.predicted, run.early
    mine, sizes, delivered, loaded_in_place = run.planned.mine, skip.layer_sizes, run.delivered(), run.loaded_in_place
    end, start, handover_s = run.end, run.start, run.handover.seconds
    before, after = run.disk_read_before, run.disk_read_after
    return ReloadReport(
        order=run.options.order,
        source=run.source,
        wall_s=end - start,
        bytes=sum(item.entry.nbytes for item in delivered if item.parent is not None),
        tensors=len(delivered),
        peak_buffer_bytes=probe.peak,
        peak_tensor=probe.peak_tensor,
        predicted_peak_buffer_bytes=predicted.peak_buffer_bytes,
        largest_layer_bytes=plan.largest_layer_bytes,
        held_to_end_bytes=sum(sizes[name][1] for name in run.held_to_end() if name in sizes),
        above_largest_layer_because=plan.excess_reason(predicted),
        readahead_peak_bytes=stats.peak_bytes,
        layers=layer_reports(run),
        rank=getattr(run.worker, "rank", None),
        position=run.planned.position.to_dict(),
        elsewhere_tensors=mine.elsewhere_tensors,
        elsewhere_bytes=mine.elsewhere_bytes,
        disk_read_bytes=after - before if before is not None and after is not None else None,
        unexpected=probe.unexpected,
        mapping=plan.mapping.description,
        device=str(run.device),
        finalize_s=end - (run.handover.stream_done if run.handover.stream_done is not None else end),
        notes=run.notes,
        skipped_layers=len(skip.skipped),
        skipped_bytes=sum(sizes[name][1] for name in skip.skipped),
        read_bytes=stats.read_bytes,
        engine_id=run.records.engine_id if run.records is not None else None,
        all_layers=run.options.all_layers,
        digests=skip.digest_source(),
        stale_layers=len(skip.decider.stale) if skip.decider is not None else 0,
        hash_s=stats.hash_s,
        fingerprint_s=skip.fingerprint_s + (early.seconds if early is not None else 0.0),
        read_s=stats.read_s,
        sample_s=stats.sample_s,
        check_s=stats.check_s,
        handover_s=handover_s,
        vllm_s=max(0.0, end - start - handover_s),
        hashed_after_handover=stats.hashed_after_handover,
        unhashed_layers=stats.unhashed_layers,
        hash_wait_s=run.hash_wait_s,
        reader_cpus=stats.reader_cpus,
        spot_checked_layers=len(skip.spot.confirmed) + len(skip.spot.stale) if skip.spot is not None else 0,
        spot_check_bytes=skip.spot.bytes_read if skip.spot is not None else 0,
        spot_check_s=skip.spot.seconds if skip.spot is not None else 0.0,
        stale_header_digests=[found.to_dict() for found in skip.stale_digests()],
        refreshed=[DerivedRefresh(**entry) for entry in run.refreshed],
        in_place_layers=len(loaded_in_place.names) if loaded_in_place is not None else 0,
        in_place_bytes=loaded_in_place.bytes if loaded_in_place is not None else 0,
    )
