"""What `device_check` concludes from its samples: medians, memory bounds, targets, where the time went, the table."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict

from benchmarks.device_variants import DESCRIPTIONS, LAYERWISE, Sample
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.units import human_bytes

# Targets from issue 25 (benchmark figures, not tests).
TARGET_OVER_PINNED = 0.9  # layerwise's staging against the pinned host-to-device copy of the same bytes
TARGET_OVER_LOAD_FILE = 1.2  # against safetensors.torch.load_file(..., device=DEV), warm
# CUDA's caching allocator rounds each block up to 512 bytes; the NaN/Inf check's flags are tiny blocks.
ALLOCATOR_SLACK_BYTES = 4 << 20
ALLOCATOR_ROUND_BYTES = 512


def summarize(samples: list[Sample], total_bytes: int) -> dict:
    """Medians (and the spread) of one variant's timed samples, with its memory peaks and stream timers."""
    seconds = [s.seconds for s in samples]
    median = statistics.median(seconds)
    out = {"median_s": median, "min_s": min(seconds), "max_s": max(seconds), "samples_s": seconds,
           "gb_per_s": total_bytes / median / 1e9 if median > 0 else None,
           "delivered_bytes": samples[0].delivered_bytes, "tensors": samples[0].tensors,
           "held_peak_bytes": max(s.held_peak_bytes for s in samples)}
    peaks = [s.peak_device_bytes for s in samples if s.peak_device_bytes is not None]
    out["peak_device_bytes"] = max(peaks) if peaks else None
    if samples[0].stream is not None:
        out["stream"] = {key: statistics.median(s.stream[key] for s in samples) for key in samples[0].stream}
        out["stream"]["readahead_peak_bytes"] = max(s.stream["readahead_peak_bytes"] for s in samples)
    return out


def memory_bounds(layer_order: list[PlannedTensor]) -> dict:
    """The largest parent layer, and the largest two consecutive layers (the layer in hand and the one read ahead)."""
    layers: list[tuple[str | None, int, int]] = []  # (parent, bytes, tensors) in stream order
    for item in layer_order:
        if layers and layers[-1][0] == item.parent and item.parent is not None:
            parent, nbytes, tensors = layers[-1]
            layers[-1] = (parent, nbytes + item.entry.nbytes, tensors + 1)
        else:
            layers.append((item.parent, item.entry.nbytes, 1))
    largest = max(nbytes for _, nbytes, _ in layers)
    pairs = [a[1] + b[1] for a, b in itertools.pairwise(layers)] or [largest]
    slack = ALLOCATOR_SLACK_BYTES + ALLOCATOR_ROUND_BYTES * len(layer_order)
    return {"largest_layer_bytes": largest, "largest_two_consecutive_layers_bytes": max(pairs),
            "allocator_slack_bytes": slack, "layers": len(layers)}


def memory_checks(warm: dict, bounds: dict, cuda: bool) -> dict:
    """Each layerwise variant's peak against its bound: one layer without read-ahead, two consecutive with it.

    On the CPU (the CI stand-in) read-ahead may hold the layer in hand and two of the largest layers more.
    """
    out = {}
    for variant in LAYERWISE:
        if variant not in warm:
            continue
        readahead = variant != "layerwise_no_readahead"
        bound = bounds["largest_two_consecutive_layers_bytes"] if readahead else bounds["largest_layer_bytes"]
        if cuda:
            measured, how = warm[variant]["peak_device_bytes"], "torch.cuda.max_memory_allocated rise over the pass"
            limit = bound + bounds["allocator_slack_bytes"]
        else:
            # No device allocator on CPU: the stream's own count of bytes read but not handed over. There the
            # reader may run two of the largest layers ahead (views of the file mapping, no memory of their own).
            if readahead:
                bound = 3 * bounds["largest_layer_bytes"]
            measured, how = warm[variant]["stream"]["readahead_peak_bytes"], "the stream's read-ahead count (CPU)"
            limit = bound
        out[variant] = {"peak_bytes": measured, "bound_bytes": bound, "limit_bytes": limit, "measured_by": how,
                        "ok": measured is not None and measured <= limit}
    return out


def _ratio(warm: dict, over: str, variant: str = "layerwise") -> float | None:
    if over not in warm or variant not in warm or not warm[variant]["median_s"]:
        return None
    return warm[over]["median_s"] / warm[variant]["median_s"]


def layout_targets(result: dict, cuda: bool) -> list[dict]:
    """The issue's targets for one checkpoint layout, as ratios from this run."""
    warm, layout = result["warm"], result["layout"]
    where = "" if cuda else " (device mapped to CPU: not the GPU figure)"
    targets = []
    for over, threshold, label in (("pinned_copy_limit", TARGET_OVER_PINNED, "pinned copy limit"),
                                   ("load_file", TARGET_OVER_LOAD_FILE, "load_file(device)")):
        ratio = _ratio(warm, over)
        targets.append({"layout": layout, "target": f"layerwise >= {threshold}x {label}, warm{where}",
                        "ratio": ratio, "threshold": threshold, "met": ratio is not None and ratio >= threshold})
    exact = result["bit_exact"]
    targets.append({"layout": layout, "target": "every tensor bit-exact (digests), every layerwise variant",
                    "ratio": None, "threshold": None, "met": bool(exact) and all(v["ok"] for v in exact.values())})
    memory = result["memory"]
    targets.append({"layout": layout,
                    "target": "peak device memory <= largest layer + read-ahead (one more layer)" + where,
                    "ratio": (memory["layerwise"]["peak_bytes"] / memory["layerwise"]["bound_bytes"]
                              if memory.get("layerwise", {}).get("peak_bytes") is not None else None),
                    "threshold": 1.0, "met": bool(memory) and all(v["ok"] for v in memory.values())})
    return targets


def where_time_went(warm: dict, total_bytes: int) -> dict:
    """Seconds per part of layerwise's pass, from the variants that isolate it (warm medians)."""
    def median(variant: str) -> float | None:
        return warm[variant]["median_s"] if variant in warm else None

    def diff(a: str, b: str) -> float | None:
        x, y = median(a), median(b)
        return x - y if x is not None and y is not None else None

    layerwise = median("layerwise")
    stream = warm.get("layerwise", {}).get("stream", {})
    hashed = warm.get("layerwise_hash", {}).get("stream", {})
    parts = {
        "layerwise_s": layerwise,
        "read_s": median("page_cache_read"),  # the page-cache read alone
        "staging_copy_s": median("staging_only"),  # read + copy into pinned staging, no transfer
        "transfer_s": median("pinned_copy_limit"),  # the host-to-device copies alone
        "check_s": diff("layerwise", "layerwise_no_check"),  # what the NaN/Inf check adds
        "hash_s": diff("layerwise_hash", "layerwise"),  # what hashing every layer adds
        "readahead_saves_s": diff("layerwise_no_readahead", "layerwise"),
        "chunked_copies_save_s": diff("layerwise_one_copy_thread", "layerwise"),
        "stream_stage_s": stream.get("stage_s"),  # the reading thread's own timers, default pass
        "stream_check_s": stream.get("check_s"),
        "stream_hash_s": hashed.get("hash_s"),
    }
    staging, transfer = parts["staging_copy_s"], parts["transfer_s"]
    if staging is not None and transfer is not None:
        parts["serial_staging_plus_transfer_s"] = staging + transfer
        parts["overlapped_max_s"] = max(staging, transfer)
    return parts


def explain(parts: dict, missed: list[str]) -> str | None:
    """One paragraph naming where layerwise's time went, when a speed target was missed (None: none missed)."""
    if not missed or parts.get("layerwise_s") is None:
        return None
    total = parts["layerwise_s"]
    shares = {name: parts.get(key) for name, key in (("read", "read_s"), ("staging copy", "staging_copy_s"),
                                                      ("transfer", "transfer_s"), ("NaN/Inf check", "check_s"))}
    known = {k: v for k, v in shares.items() if v is not None}
    text = [f"missed: {', '.join(missed)}. layerwise took {total:.3f} s;"]
    text += [f"{name} alone {value:.3f} s ({value / total:.0%} of it);" for name, value in known.items()]
    if parts.get("serial_staging_plus_transfer_s") is not None:
        text.append(f"staging + transfer in series {parts['serial_staging_plus_transfer_s']:.3f} s, "
                    f"fully overlapped {parts['overlapped_max_s']:.3f} s;")
    if parts.get("stream_stage_s") is not None:
        text.append(f"the reading thread spent {parts['stream_stage_s']:.3f} s staging and "
                    f"{parts['stream_check_s']:.3f} s in the check (on CUDA: waiting for the copies too).")
    if known:
        name = max(known, key=known.get)
        text.append(f"The largest part: {name}.")
    return " ".join(text)


def sample_dict(sample: Sample) -> dict:
    """A sample for the JSON, without the digests it may carry."""
    data = asdict(sample)
    data.pop("read_digests", None)
    return data


def render_table(report: dict) -> str:
    """The short table: per layout, every variant's warm and cold seconds and speed; then the checks and targets."""
    lines = []
    machine, model = report["machine"], report["checkpoint_model"]
    lines.append(f"device_check {report['date']}: {machine['device_name']} ({machine['device']}), "
                 f"{machine['cpus']} CPUs, torch {machine['torch']}; {model['bytes'] / 1e9:.2f} GB, "
                 f"{model['layers']} decoder layers; medians of {report['args']['runs']} warm runs")
    for result in report["layouts"]:
        lines.append("")
        lines.append(f"{result['layout']}: {result['shards']} shards on {result['filesystem']}; "
                     f"cold: {result['cold']['status']}")
        lines.append(f"  {'variant':<27}{'warm s':>9}{'GB/s':>8}{'x layerwise':>12}{'peak dev':>11}"
                     f"{'cold s':>9}{'GB/s':>8}")
        base = result["warm"].get("layerwise", {}).get("median_s")
        for variant, figures in result["warm"].items():
            cold = result["cold"].get("variants", {}).get(variant)
            peak = figures["peak_device_bytes"]
            row = (f"  {variant:<27}{figures['median_s']:>9.3f}{figures['gb_per_s'] or 0:>8.2f}"
                   f"{(figures['median_s'] / base) if base else float('nan'):>12.2f}"
                   f"{human_bytes(peak) if peak is not None else '-':>11}")
            if cold is not None:
                row += f"{cold['seconds']:>9.3f}{cold['gb_per_s']:>8.2f}"
            lines.append(row)
        exact = result["bit_exact"]
        lines.append(f"  bit-exact: {sum(v['verified'] for v in exact.values())} tensors checked in "
                     f"{len(exact)} variants, {sum(len(v['mismatches']) for v in exact.values())} differ")
        if result.get("explanation"):
            lines.append(f"  where the time went: {result['explanation']}")
    writer = report.get("writer") or {}
    lines.append("")
    if writer.get("ran"):
        lines.append(f"writer: save_checkpoint from {writer['device']} tensors vs from CPU tensors, "
                     f"{writer['tensors']} tensors, {human_bytes(writer['bytes'])}, {len(writer['files'])} files: "
                     f"{'byte-identical' if writer['identical'] else 'DIFFERENT: ' + ', '.join(writer['differences'])}"
                     f"; digests match the source: {writer['digests_match_source']}")
    else:
        lines.append(f"writer: NOT RUN ({writer.get('reason', 'unknown')})")
    lines.append("")
    lines.append("targets:")
    for target in report["targets"]:
        ratio = f" {target['ratio']:.2f}" if target["ratio"] is not None else ""
        lines.append(f"  [{'met' if target['met'] else 'MISSED'}] {target['layout']}: {target['target']}{ratio}")
    for skipped in report["skipped"]:
        lines.append(f"  [NOT RUN] {skipped}")
    lines.append("")
    lines.append("variants: " + "; ".join(f"{k}: {v}" for k, v in DESCRIPTIONS.items()))
    return "\n".join(lines)
