"""The device check's cold passes: the main variants once each after the checkpoint's pages are dropped."""

from __future__ import annotations

import gc
import time

from benchmarks.bench_checkpoints import warm_page_cache
from benchmarks.device_run import Run, log
from benchmarks.device_variants import Setup, run_variant
from benchmarks.page_cache import drop, flush, resident_bytes
from layerwise_cli.worker.reload.probe import process_disk_read_bytes

COLD_VARIANTS = ("page_cache_read", "layerwise", "load_file", "safe_open_vllm_order")
# A cold pass counts as cold when at most this share of the files was cached when it started.
COLD_RESIDENT_SHARE = 0.05


def cold_estimate(result: dict) -> float:
    """Seconds the cold passes may take: the warm medians, or the write time where that is larger (a disk)."""
    warm = result.get("warm") or {}
    per = max([warm[v]["median_s"] for v in COLD_VARIANTS if v in warm] + [result["write_s"] / 2, 1.0])
    return per * len(COLD_VARIANTS)


def cold_passes(run: Run, result: dict, setup: Setup) -> None:
    """One pass of each of COLD_VARIANTS after the checkpoint's pages are dropped, where they can be."""
    total = result["bytes"]
    start = time.perf_counter()
    flush(setup.shards)
    cold: dict = {"status": "ran", "flush_s": time.perf_counter() - start, "variants": {}}
    result["cold"] = cold
    rate = None  # bytes per second read cold, once measured
    for variant in COLD_VARIANTS:
        warm_s = result["warm"].get(variant, {}).get("median_s", 1.0)
        estimate = max(warm_s, total / rate if rate else result["write_s"] / 2)
        if not run.budget.fits(estimate + 5):
            run.skip(f"{result['layout']}: cold {variant} (time budget: about {estimate:.0f} s needed)")
            cold["status"] = "partial (time budget)"
            continue
        gc.collect()  # no mapping of the files left: the kernel drops mapped pages only once they are unmapped
        method = drop(setup.shards)
        resident = resident_bytes(setup.shards)
        if resident is not None and resident > COLD_RESIDENT_SHARE * total:
            cold.update(status=f"not possible: {resident / total:.0%} of the files stay cached after {method} "
                               f"(filesystem {result['filesystem']}; tmpfs keeps its pages)",
                        variants={})
            log(f"cold: {cold['status']}")
            return
        disk_before = process_disk_read_bytes()
        sample = run_variant(variant, setup)
        disk_after = process_disk_read_bytes()
        disk = disk_after - disk_before if disk_before is not None and disk_after is not None else None
        rate = total / sample.seconds
        cold["variants"][variant] = {"seconds": sample.seconds, "gb_per_s": total / sample.seconds / 1e9,
                                     "dropped_by": method, "resident_before_bytes": resident,
                                     "disk_read_bytes": disk, "peak_device_bytes": sample.peak_device_bytes}
        log(f"cold {variant}: {sample.seconds:.2f} s ({total / sample.seconds / 1e9:.2f} GB/s; "
            f"{'?' if disk is None else f'{disk / 1e9:.2f} GB'} from storage)")
        run.save()
    warm_page_cache(setup.folder)

