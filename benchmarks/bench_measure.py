"""Timing a checkpoint's variants on a running engine: one call, rounds of them, their medians and peaks."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from benchmarks.bench_checkpoints import warm_page_cache
from benchmarks.bench_memory import DeviceMemory, MemoryWatch
from benchmarks.bench_report import LAYERWISE_VARIANTS, ratios_of
from layerwise_cli.client.engine.in_process import reports_from_results
from layerwise_cli.planning.chart import stream_curves
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.worker.rpc import ReloadCall, ReloadOptions

# Where a layerwise reload's time went (`ReloadReport`): the reading thread's read, sample, hash and check; the
# engine's thread in the stream (handover) and in vLLM; the spot check of header-digest skips, before both; the
# wait for the hashing backlog, after both.
TIME_SPLIT = ("read_s", "sample_s", "hash_s", "check_s", "handover_s", "vllm_s", "spot_check_s", "hash_wait_s",
              "patch_s")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def rpc(llm, method: str, **kwargs) -> dict:
    results = llm.collective_rpc(method, kwargs=kwargs)
    failed = [r for r in results if isinstance(r, dict) and not r.get("ok", True)]
    if failed:
        raise RuntimeError(f"{method} failed in a worker: {failed[0].get('error')}\n{failed[0].get('traceback', '')}")
    return results[0]


def measure(llm, variant: str, path: Path, cuda: bool, full: bool = True) -> dict:
    """One timed call of VARIANT on the checkpoint at PATH (layerwise: every layer, unless not FULL)."""
    source = str(path)
    start = time.perf_counter()
    if variant == "a":
        llm.collective_rpc("reload_weights", kwargs={"weights_path": source})
        if cuda:  # vLLM returns before its last copies are done; the others synchronize
            rpc(llm, "layerwise_bench_sync")
        return {"seconds": time.perf_counter() - start}
    if variant in LAYERWISE_VARIANTS:
        order = "file" if variant == "b" else "layer"
        call = ReloadCall(source=source, options=ReloadOptions(
            order=order, readahead=variant != "c-nora", allow_nonfinite=variant == "c-nocheck",
            in_place=variant != "c-fresh", patch_in_place=variant != "c-nopatch",
            # Every run reloads the same checkpoint: without all_layers, every run after the first skips it all.
            all_layers=full))
        results = llm.collective_rpc(call.method, kwargs=call.kwargs())
        seconds = time.perf_counter() - start
        report = reports_from_results(results)
        return {"seconds": seconds, "worker_seconds": report.wall_s, "peak_buffer_bytes": report.peak_buffer_bytes,
                "predicted_peak_buffer_bytes": report.memory.predicted_peak_buffer_bytes,
                "largest_layer_bytes": report.largest_layer_bytes,
                "readahead_peak_bytes": report.memory.readahead_peak_bytes, "finalize_s": report.timings.finalize_s,
                "unexpected": len(report.findings.unexpected), "reloaded_bytes": report.bytes,
                **skip_figures(report)}
    if variant == "p":
        result = rpc(llm, "layerwise_bench_patch_floor", source=source)
        return {"seconds": result["seconds"], "call_seconds": time.perf_counter() - start}
    method = {"d": "layerwise_bench_read", "e": "layerwise_bench_floor"}[variant]
    result = rpc(llm, method, source=source, order="layer")
    return {"seconds": result["seconds"], "call_seconds": time.perf_counter() - start}


def skip_figures(report) -> dict:
    """Layers and bytes the reload skipped, and the bytes it read, where the report says (None: it does not)."""
    data = report.to_dict()  # one flat object: each figure by its key, whichever section holds it
    return {key: data.get(key) for key in ("skipped_layers", "skipped_bytes", "read_bytes", *TIME_SPLIT,
                                           "fingerprint_s", "spot_check_bytes", "reader_cpus", "in_place_layers",
                                           "in_place_bytes", "patched_layers", "patched_bytes")}


def stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "samples": samples}


def bench_checkpoint(llm, layout: str, path: Path, args, watch: MemoryWatch, cuda: bool,
                     deadline: float | None = None, first: bool = True, device_memory: DeviceMemory | None = None
                     ) -> dict:
    predicted = inspect_order(str(path))
    largest = predicted.plan.largest_layer_bytes
    warm_page_cache(path)
    variants = list(args.variants)
    # Under a time budget only the first checkpoint gets warm-up rounds (the engine's code paths are warm after).
    warmup = args.warmup if deadline is None or first else 0
    for _ in range(warmup):
        for variant in variants:
            measure(llm, variant, path, cuda)
    # vLLM's own reload with the probe around its own iterator: its peak (deterministic; once).
    vllm_peak = rpc(llm, "layerwise_bench_vllm_peak", source=str(path))
    samples: dict[str, list[dict]] = {v: [] for v in variants}
    round_s = 0.0  # the last round's duration
    for run in range(args.runs):
        round_start = time.perf_counter()
        if run > 0 and deadline is not None and round_start + round_s > deadline:
            log(f"  {layout}: stopping after {run} runs (--time-budget)")
            break
        rotated = variants[run % len(variants):] + variants[:run % len(variants)]
        for variant in rotated:
            before = watch.reset()
            if device_memory is not None:
                device_memory.reset()
            sample = measure(llm, variant, path, cuda)
            sample["engine_peak_rss_delta_bytes"] = watch.engine_peak_delta(before)
            sample["device_peak_allocated_delta_bytes"] = device_memory.rise() if device_memory else None
            samples[variant].append(sample)
        round_s = time.perf_counter() - round_start
        log(f"  {layout} run {run + 1}/{args.runs}: " + "  ".join(
            f"{v} {samples[v][-1]['seconds']:.2f}s" for v in variants))
    timings = {v: stats([s["seconds"] for s in samples[v]]) for v in variants}
    for v in variants:
        timings[v]["engine_peak_rss_delta_bytes"] = statistics.median(
            s["engine_peak_rss_delta_bytes"] for s in samples[v])
        rises = [s["device_peak_allocated_delta_bytes"] for s in samples[v]
                 if s["device_peak_allocated_delta_bytes"] is not None]
        timings[v]["device_peak_allocated_delta_bytes"] = statistics.median(rises) if rises else None
        if "worker_seconds" in samples[v][0]:
            timings[v]["worker_seconds_median"] = statistics.median(s["worker_seconds"] for s in samples[v])
        for key in (*TIME_SPLIT, "fingerprint_s", "spot_check_bytes"):  # where the time went
            values = [s[key] for s in samples[v] if s.get(key) is not None]
            if values:
                timings[v][f"{key}_median"] = statistics.median(values)
    file_prediction = predicted.file_order_buffering.peak_buffer_bytes
    peaks = {"largest_layer_bytes": largest,
             "predicted_file_order_bytes": file_prediction,
             "predicted_layer_order_bytes": predicted.layer_order_buffering.peak_buffer_bytes,
             "a": vllm_peak["peak_buffer_bytes"]}
    for v in LAYERWISE_VARIANTS:
        if v in samples:
            peaks[v] = max(s["peak_buffer_bytes"] for s in samples[v])
            peaks[f"{v}_readahead_bytes"] = max(s["readahead_peak_bytes"] for s in samples[v])
    result = {
        "layout": layout,
        "path": str(path),
        "bytes": predicted.plan.total_bytes,
        "tensors": len(predicted.plan.file_order),
        "shards": len(predicted.plan.checkpoint.shards),
        "parent_layers": len(predicted.plan.layers),
        "runs": len(samples[variants[0]]),
        "times": timings,
        "peaks": peaks,
        "peak_over_largest": {k: peaks[k] / largest for k in ("a", "b", "c", "predicted_file_order_bytes")
                              if k in peaks},
        "c_reader_cpus": samples["c"][0].get("reader_cpus") if samples.get("c") else None,
        "c_in_place": ({k: samples["c"][-1].get(k) for k in ("in_place_layers", "in_place_bytes")}
                       if samples.get("c") else None),
        "vllm_read_order_matches_plan": vllm_peak["order_matches_plan"],
        "vllm_probe_unexpected": len(vllm_peak["unexpected"]),
        "curves": stream_curves(predicted),
    }
    result["ratios"] = ratios_of(timings, peaks)
    return result

