"""Time layerwise's reader into device memory against safetensors and the copy limits; check bytes, memory, writer.

Run on a machine with one NVIDIA GPU (`scripts/device_check.sh` wraps it), or
with the device mapped to CPU (CI: `tests/test_device_check.py`):

    python3 -m benchmarks.device_check --device cuda --out "$OUT"
    python3 -m benchmarks.device_check --device cpu --preset quick --runs 1 --out /tmp/dc

It needs torch, safetensors, xxhash and numpy, and never imports vLLM (the
lent GPU machine has none): the code timed is the worker's own reader,
`layerwise_cli.worker.stream.read_ahead.read_in_order`, fed the plan `inspect-order`
makes, without an engine. It

1. writes a synthetic checkpoint (Qwen3-8B's shapes by default, 16.4 GB bf16,
   every tensor's bytes distinct, xxh3-128 digests in the shard headers) in
   each of `--layouts` (the shard layouts `bench_reload` uses), on local disk;
2. per layout, runs every variant once untimed (the layerwise variants check
   every tensor that arrives against the header digests), then `--runs`
   rotated timed rounds with the page cache warm, then (first layout only,
   where the page cache can be dropped) one cold pass of the main variants;
   layouts after the first run only the variants whose time the order of
   the tensors across shards can change (`LATER_LAYOUT_VARIANTS`);
3. runs `save_checkpoint` on the first layout's first `--writer-gib` read
   into the device, and from CPU copies of the same tensors, and compares the
   files byte for byte;
4. writes `device_check.json` and `device_check.txt` (the table, also on
   stdout) into `--out` after every phase, so that a run stopped by its limit
   keeps what it measured.

Exit status: 0 when everything asked for ran and every byte check passed
(speed and memory targets are reported, met or not); 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.bench_checkpoints import LAYOUTS, model_for, numel, warm_page_cache, write_bench_checkpoint
from benchmarks.device_cold import cold_estimate, cold_passes
from benchmarks.device_report import (
    explain,
    layout_targets,
    memory_bounds,
    memory_checks,
    render_table,
    sample_dict,
    summarize,
    where_time_went,
)
from benchmarks.device_run import Run, log
from benchmarks.device_variants import LAYERWISE, VARIANTS, Sample, Setup, run_variant
from benchmarks.device_writer import writer_check
from benchmarks.page_cache import filesystem_of
from layerwise_cli.checkpoint.format.digests import checkpoint_digests
from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.planning.plan import build_plan, vllm_read_order
from tests.support.synthetic import normal_weights

# After the first layout, what the layout can change: the reading order across shards. The parts that
# isolate the check, hashing, chunked copies and the file read depend on the bytes, not on their order.
LATER_LAYOUT_VARIANTS = ("layerwise", "layerwise_no_readahead", "load_file", "safe_open_vllm_order",
                         "staging_only", "pinned_copy_limit")
# Written into the checkpoint's stamp: a reused folder holds these same bytes.
DATA_VARIANT = "device-check-stamped-v1"


def stamped_weights(model) -> Callable[[str, int], bytes]:
    """normal_weights (one draw per shape, cheap for 16 GB), each tensor's first 32 values made its own.

    Without the stamp every decoder layer's q_proj would hold the same bytes,
    and a tensor handed over under another layer's name would pass the digest check.
    """
    base = normal_weights(model)

    def data(name: str, nbytes: int) -> bytes:
        raw = base(name, nbytes)
        rng = random.Random(name)
        head = min(64, nbytes) // 2
        # bf16: the top half of a float32's little-endian bytes; gauss(0, 0.02) is always finite.
        stamp = b"".join(struct.pack("<f", rng.gauss(0.0, 0.02))[2:] for _ in range(head))
        return stamp + memoryview(raw)[2 * head:]

    return data


def plan_setup(folder: Path, device: torch.device) -> Setup:
    """The worker's plan for FOLDER (layer order, as `inspect-order` makes it) and the header digests."""
    checkpoint = open_checkpoint(str(folder))
    plan = build_plan(checkpoint, mapping_for_config(checkpoint.config, "auto"))
    digests = checkpoint_digests(checkpoint.shards)
    if digests is None:
        raise SystemExit(f"device_check: {folder}: the shard headers carry no digests")
    return Setup(folder=folder, layer_order=plan.layer_order, read_order=vllm_read_order(checkpoint),
                 shards=[folder / shard.name for shard in checkpoint.shards], device=device, digests=digests)


def check_pass(sample: Sample, setup: Setup) -> dict:
    """A verifying pass's result: every tensor checked, none differing; the stream's own digests too."""
    expected = len(setup.layer_order)
    mismatches = list(sample.mismatches)
    if sample.verified != expected:
        mismatches.append(f"{sample.verified} of {expected} tensors arrived")
    if sample.read_digests is not None:
        wrong = [n for n, d in setup.digests.items() if sample.read_digests.get(n) != d]
        mismatches += [f"{n}: the stream's hash differs from the header digest" for n in wrong]
    return {"verified": sample.verified, "tensors": expected, "mismatches": mismatches[:20],
            "mismatch_count": len(mismatches), "ok": not mismatches}


def measure_layout(run: Run, layout: str, model, data, first: bool) -> None:
    args, budget = run.args, run.budget
    folder = run.workdir / layout
    start = time.perf_counter()
    write_bench_checkpoint(folder, model, layout, Path("/nonexistent-tokenizer"), data,
                           shards=args.shards, digests=True, variant=DATA_VARIANT)
    write_s = time.perf_counter() - start
    setup = plan_setup(folder, run.device)
    total = sum(item.entry.nbytes for item in setup.layer_order)
    log(f"{layout}: {total / 1e9:.2f} GB in {len(setup.shards)} shards, written in {write_s:.1f} s")
    result = {"layout": layout, "path": str(folder), "shards": len(setup.shards), "bytes": total,
              "tensors": len(setup.layer_order), "write_s": write_s, "filesystem": filesystem_of(folder),
              "memory_bounds": memory_bounds(setup.layer_order), "warm": {}, "cold": {"status": "not run"},
              "bit_exact": {}, "memory": {}, "samples": {}}
    run.report["layouts"].append(result)
    warm_page_cache(folder)

    # Round 0, untimed: every variant once; the layerwise ones check every tensor that arrives.
    variants = VARIANTS if first else LATER_LAYOUT_VARIANTS
    result["variants"] = list(variants)
    start = time.perf_counter()
    for variant in variants:
        sample = run_variant(variant, setup, verify=variant in LAYERWISE)
        if variant in LAYERWISE:
            result["bit_exact"][variant] = check_pass(sample, setup)
    check_round_s = time.perf_counter() - start
    result["check_round_s"] = check_round_s
    bad = [v for v, r in result["bit_exact"].items() if not r["ok"]]
    log(f"{layout}: checking round {check_round_s:.1f} s; bit-exact: {'FAILED in ' + ', '.join(bad) if bad else 'ok'}")
    run.save()

    if first:
        writer_check(run, setup)
        run.save()

    samples: dict[str, list[Sample]] = {v: [] for v in variants}
    cuda = run.device.type == "cuda"
    round_s = check_round_s
    for index in range(args.runs):
        if index > 0 and not budget.fits(round_s + (cold_estimate(result) if first else 0)):
            run.skip(f"{layout}: warm runs {index + 1}-{args.runs} (time budget)")
            break
        started = time.perf_counter()
        rotated = variants[index % len(variants):] + variants[:index % len(variants)]
        for variant in rotated:
            samples[variant].append(run_variant(variant, setup))
        round_s = time.perf_counter() - started
        log(f"{layout}: warm run {index + 1}/{args.runs} in {round_s:.1f} s "
            f"({sum(s[-1].seconds for s in samples.values()):.1f} s timed): " +
            ", ".join(f"{v} {samples[v][-1].seconds:.2f}" for v in variants[:3]) + " ...")
        # Kept after every round: a run stopped by its limit keeps the rounds it finished.
        result["runs"] = len(samples["layerwise"])
        result["warm"] = {v: summarize(s, total) for v, s in samples.items() if s}
        result["samples"] = {v: [sample_dict(x) for x in s] for v, s in samples.items()}
        result["memory"] = memory_checks(result["warm"], result["memory_bounds"], cuda)
        run.save()

    if first and args.cold != "off":
        cold_passes(run, result, setup)
    elif not first:
        result["cold"] = {"status": "first layout only"}
    else:
        result["cold"] = {"status": "off (--cold off)"}
    result["time"] = where_time_went(result["warm"], total)
    targets = layout_targets(result, cuda)
    missed = [t["target"] for t in targets[:2] if not t["met"]]
    result["explanation"] = explain(result["time"], missed)
    run.report["targets"].extend(targets)
    run.save()


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="cuda, cuda:N, cpu, or auto (cuda when torch sees one)")
    parser.add_argument("--preset", default="qwen3-8b", choices=("qwen3-8b", "quick"),
                        help="the checkpoint's shapes: Qwen3-8B (16.4 GB bf16) or bench_reload's quick (14 MB)")
    parser.add_argument("--size-gib", type=float, default=None,
                        help="instead of --preset: Qwen3-0.6B's proportions sized to this (bench_reload's rule)")
    parser.add_argument("--layouts", default="in_order,trainer_export",
                        help=f"comma-separated shard layouts, from {', '.join(LAYOUTS)}")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, help="timed warm rounds per layout (medians)")
    parser.add_argument("--time-budget", type=float, default=400.0,
                        help="seconds for the whole run; rounds and phases that would not fit are skipped and listed")
    parser.add_argument("--cold", default="auto", choices=("auto", "off"),
                        help="auto: cold passes where the page cache can be dropped")
    parser.add_argument("--writer-gib", type=float, default=2.0,
                        help="how much of the checkpoint (whole layers, in layer order) the writer check writes")
    parser.add_argument("--workdir", default=None,
                        help="where checkpoints go (default: a new folder in the temp dir, on disk, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch's CPU threads (1: as vLLM sets them in its GPU workers)")
    parser.add_argument("--out", default=None, help="results folder (default: $OUT, else bench-out/device)")
    args = parser.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or not layouts:
        parser.error(f"unknown layouts {unknown}: choose from {', '.join(LAYOUTS)}")
    args.layouts = layouts
    return args


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device_check: --device cuda, but torch sees no GPU (torch.cuda.is_available() is False)")
    if device.type not in ("cuda", "cpu"):
        raise SystemExit(f"device_check: --device {name}: only cuda and cpu are measured")
    return device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    # vLLM's GPU workers run torch with one CPU thread; the stream's staging threads are its own.
    torch.set_num_threads(args.torch_threads)
    out = Path(args.out or os.environ.get("OUT") or "bench-out/device")
    made_workdir = args.workdir is None
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="layerwise-device-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = Run(args, device, out, workdir)
    sizing = argparse.Namespace(preset=None if args.size_gib else args.preset, quick=args.preset == "quick",
                                size_gib=args.size_gib)
    model = model_for(sizing, 0)
    shapes = dict(model.tensors())
    total = sum(2 * numel(s) for s in shapes.values())
    run.report["checkpoint_model"] = {"config": model.config(), "bytes": total, "tensors": len(shapes),
                                      "layers": model.layers}
    free = shutil.disk_usage(run.workdir).free
    log(f"{device} ({run.report['machine']['device_name']}); {total / 1e9:.2f} GB per layout in {run.workdir} "
        f"({free / 1e9:.0f} GB free); budget {args.time_budget:.0f} s")
    data = stamped_weights(model)
    try:
        for index, layout in enumerate(args.layouts):
            if index > 0:
                previous = run.report["layouts"][-1]
                need = previous["write_s"] + previous["check_round_s"] * 2
                if not run.budget.fits(need):
                    run.skip(f"{layout}: the whole layout (time budget: about {need:.0f} s needed)")
                    continue
                if shutil.disk_usage(run.workdir).free < 1.1 * total:
                    run.skip(f"{layout}: the whole layout (disk: {total / 1e9:.1f} GB needed)")
                    continue
            measure_layout(run, layout, model, data, first=index == 0)
    finally:
        if made_workdir and not args.keep:
            shutil.rmtree(run.workdir, ignore_errors=True)
    report = run.report
    exact = all(r["ok"] for layout in report["layouts"] for r in layout["bit_exact"].values())
    writer = report["writer"] or {}
    report["ok"] = bool(report["layouts"]) and exact and bool(writer.get("ran")) and bool(writer.get("identical")) \
        and not report["skipped"]
    run.save()
    print(render_table(report))
    log(f"results in {out} ({'ok' if report['ok'] else 'FAILED or incomplete'}; "
        f"{time.perf_counter() - run.budget.start:.0f} s)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
