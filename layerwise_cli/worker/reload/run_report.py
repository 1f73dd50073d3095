"""The report phase: what one reload on one worker did, layer by layer, as a `ReloadReport`."""

from __future__ import annotations

from layerwise_cli.report.records import DerivedRefresh, LayerReport
from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.report.sections import Findings, Memory, Placement, Timings, UnchangedLayers, Volume
from layerwise_cli.worker.reload.reload_run import ReloadRun
from layerwise_cli.worker.state.layer_records import REASON_UNCHANGED


def layer_reports(run: ReloadRun) -> list[LayerReport]:
    """Each layer in the order the stream reached its first tensor (skipped ones too, marked)."""
    sizes, held, loaded_in_place = run.skip.layer_sizes, run.held_to_end(), run.loaded_in_place
    layers = []
    for name in dict.fromkeys(item.parent for item in run.engine_stream if item.parent is not None):
        if name in run.skip.not_handed:
            tensors, nbytes = sizes[name]
            skipped = name in run.skip.skipped
            layers.append(LayerReport(name=name, tensors=tensors, bytes=nbytes, load_s=0.0, process_s=0.0,
                                      buffered_bytes_at_completion=0, skipped=REASON_UNCHANGED if skipped else None,
                                      patched=not skipped))
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
    patch_s = run.patch.seconds if run.patch is not None else 0.0
    before, after = run.disk_read_before, run.disk_read_after
    spot, patch = skip.spot, run.patch
    # A delta's changed layers that were not patched in place: rebuilt from the base, handed to vLLM.
    layers = layer_reports(run)
    rebuilt = [layer.name for layer in layers if not layer.skipped and not layer.patched] \
        if run.planned.checkpoint.delta is not None else []
    return ReloadReport(
        placement=Placement(source=run.source, commit=run.planned.commit, order=run.options.order,
                            mapping=plan.mapping.description,
                            device=str(run.device), rank=getattr(run.worker, "rank", None),
                            position=run.planned.position.to_dict(),
                            engine_id=run.records.engine_id if run.records is not None else None,
                            reader_cpus=stats.reader_cpus),
        volume=Volume(
            bytes=sum(item.entry.nbytes for item in delivered if item.parent is not None), tensors=len(delivered),
            read_bytes=stats.read_bytes + (patch.read_bytes if patch is not None else 0),
            disk_read_bytes=after - before if before is not None and after is not None else None,
            elsewhere_tensors=mine.elsewhere_tensors, elsewhere_bytes=mine.elsewhere_bytes,
            fetched_bytes=fetched_bytes(run),
            patched_layers=len(patch.patched) if patch is not None else 0,
            patched_bytes=patch.read_bytes if patch is not None else 0,
            rebuilt_layers=len(rebuilt), rebuilt_reason=next(
                (patch.not_patched[name] for name in rebuilt if name in patch.not_patched), None)
            if patch is not None else None),
        memory=Memory(
            peak_buffer_bytes=probe.peak,
            peak_tensor=probe.peak_tensor,
            predicted_peak_buffer_bytes=predicted.peak_buffer_bytes,
            largest_layer_bytes=plan.largest_layer_bytes,
            held_to_end_bytes=sum(sizes[name][1] for name in run.held_to_end() if name in sizes),
            above_largest_layer_because=plan.excess_reason(predicted),
            readahead_peak_bytes=stats.peak_bytes,
            in_place_layers=len(loaded_in_place.names) if loaded_in_place is not None else 0,
            in_place_bytes=loaded_in_place.bytes if loaded_in_place is not None else 0),
        timings=Timings(
            wall_s=end - start,
            finalize_s=end - (run.handover.stream_done if run.handover.stream_done is not None else end),
            handover_s=handover_s,
            vllm_s=max(0.0, end - start - handover_s - patch_s),
            read_s=stats.read_s,
            check_s=stats.check_s,
            hash_s=stats.hash_s,
            sample_s=stats.sample_s,
            fingerprint_s=skip.fingerprint_s + (early.seconds if early is not None else 0.0),
            spot_check_s=spot.seconds if spot is not None else 0.0,
            hash_wait_s=run.hash_wait_s,
            patch_s=patch_s,
            plan_s=run.plan_s),
        unchanged=UnchangedLayers(
            all_layers=run.options.all_layers,
            digests=skip.digest_source(),
            skipped_layers=len(skip.skipped),
            skipped_bytes=sum(sizes[name][1] for name in skip.skipped),
            stale_layers=len(skip.decider.stale) if skip.decider is not None else 0,
            spot_checked_layers=len(spot.confirmed) + len(spot.stale) if spot is not None else 0,
            spot_check_bytes=spot.bytes_read if spot is not None else 0,
            stale_header_digests=[found.to_dict() for found in skip.stale_digests()],
            hashed_after_handover=stats.hashed_after_handover,
            unhashed_layers=stats.unhashed_layers),
        findings=Findings(notes=run.notes, unexpected=probe.unexpected,
                          refreshed=[DerivedRefresh(**entry) for entry in run.refreshed]),
        layers=layers,
    )


def fetched_bytes(run) -> int | None:
    """The bytes RUN fetched from a remote source: its stream's, or a delta by URL or in a Hub run's (its links,
    and a base this host's cache did not hold); None for a local source."""
    if run.remote is not None:
        return run.remote.bytes_fetched
    delta = run.planned.checkpoint.delta
    if delta is not None and run.planned.checkpoint.kind in ("store", "hub"):
        return delta.fetched_bytes
    return None
