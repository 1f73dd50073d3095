"""Time `save_checkpoint` against safetensors' own `save_file` on the same state dict.

Run from the repository root (no engine, no lock needed):

    .venv/bin/python -m benchmarks.bench_writer            # 1 GiB of bf16, 3 runs, median
    .venv/bin/python -m benchmarks.bench_writer --mib 256 --runs 3

`save_checkpoint` checks each tensor for NaN/Inf, hashes it (xxh3-128), spills
it, then copies the spill into shards in layer order and fsyncs everything;
`save_file` writes one file from a dict it holds whole, then the file is
fsync'd here so that both end on disk. The output is written to a temporary
directory on the same filesystem as --dir.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

from layerwise_cli import save_checkpoint


def state_dict(total_mib: int) -> dict:
    """Qwen-like names, 8 MiB bf16 matrices (4 per decoder layer), enough layers for TOTAL_MIB."""
    import torch  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    layers = max(1, total_mib // 32)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(layers):
        for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
            sd[f"model.layers.{i}.{proj}.weight"] = (torch.randn(2048, 2048, generator=g) * 0.02).to(torch.bfloat16)
    return sd


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    from safetensors.torch import save_file  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    sd = state_dict(args.mib)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    items = list(sd.items())
    random.Random(0).shuffle(items)
    times: dict[str, list[float]] = {"save_checkpoint, shuffled": [], "safetensors save_file + fsync": []}
    root = tempfile.mkdtemp(prefix="bench-writer-", dir=args.dir)
    try:
        for run in range(args.runs):
            start = time.perf_counter()
            save_checkpoint(iter(items), os.path.join(root, f"ours-{run}"), max_shard_size=256 * 2**20)
            times["save_checkpoint, shuffled"].append(time.perf_counter() - start)
            path = os.path.join(root, f"theirs-{run}.safetensors")
            start = time.perf_counter()
            save_file(sd, path)
            _fsync(path)
            times["safetensors save_file + fsync"].append(time.perf_counter() - start)
            shutil.rmtree(os.path.join(root, f"ours-{run}"))
            os.unlink(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{nbytes / 2**20:.0f} MiB of bf16 in {len(sd)} tensors, median of {args.runs} runs")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:32s} {median:6.2f} s  {nbytes / median / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
