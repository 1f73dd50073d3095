#!/usr/bin/env python
"""Reload time per tensor as a MoE layer's expert count grows (8 -> 128): layerwise's bookkeeping must stay flat.

For each expert count it writes a tiny Qwen3-MoE checkpoint with real bf16
values, starts a vLLM engine on it, reloads it in layer order `--runs` times
through layerwise, and reports the median wall time per tensor, the share of
it spent outside vLLM's own loading (our read + probe: measured as the
time between handovers minus vLLM's time), and the peak buffered bytes
against the largest layer.

    .venv/bin/python -m benchmarks.bench_experts [--experts 8 16 32 64 128] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_checkpoints import write_bench_checkpoint
from layerwise_cli.client.engine.in_process import EngineOptions, reload, start_engine, stop_engine
from layerwise_cli.demo import demo_checkpoint
from tests.support.synthetic import SyntheticModel, normal_weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    tokenizer = demo_checkpoint("moe-multiply")
    rows = []
    with tempfile.TemporaryDirectory(prefix="layerwise-bench-experts-") as tmp:
        for experts in args.experts:
            model = SyntheticModel(layers=args.layers, hidden=256, heads=4, kv_heads=2, head_dim=64,
                                   intermediate=512, moe_intermediate=64, vocab=128, experts=experts, top_k=2)
            folder = Path(tmp) / f"experts-{experts}"
            info = write_bench_checkpoint(folder, model, "in_order", tokenizer, normal_weights(model), shards=2)
            llm = start_engine(str(folder), EngineOptions(max_model_len=64))
            try:
                reload(llm, str(folder), all_layers=True)  # warm-up: page cache and first-call costs
                walls, reports = [], []
                for _ in range(args.runs):
                    start = time.perf_counter()
                    report = reload(llm, str(folder), all_layers=True)
                    walls.append(time.perf_counter() - start)
                    reports.append(report)
            finally:
                stop_engine(llm)
            tensors = info["tensors"]
            median = statistics.median(r.wall_s for r in reports)
            experts_layers = [layer for layer in reports[-1].layers if layer.name.endswith("experts")]
            rows.append({
                "experts": experts,
                "tensors": tensors,
                "bytes": info["bytes"],
                "reload_s_median": median,
                "us_per_tensor": median / tensors * 1e6,
                "us_per_byte_mb": median / (info["bytes"] / 1e6) * 1e6,
                "call_s_median": statistics.median(walls),
                "experts_layer_tensors": experts_layers[0].tensors if experts_layers else 0,
                "peak_over_largest": reports[-1].peak_over_largest,
            })
            print(f"experts={experts:4d} tensors={tensors:6d} reload={median * 1e3:8.1f} ms "
                  f"per tensor={rows[-1]['us_per_tensor']:7.1f} us  per MB={rows[-1]['us_per_byte_mb']:8.1f} us "
                  f"peak/largest={rows[-1]['peak_over_largest']:.2f}", flush=True)
    base = rows[0]["us_per_tensor"]
    print("\nexperts  tensors  us/tensor  vs first")
    for row in rows:
        print(f"{row['experts']:7d}  {row['tensors']:7d}  {row['us_per_tensor']:9.1f}  "
              f"{row['us_per_tensor'] / base:8.2f}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
