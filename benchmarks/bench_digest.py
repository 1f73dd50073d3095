"""Measure hashing throughput for the per-tensor digests: xxh3-128 and BLAKE3, against a plain read.

Run from the repository root (no engine, no lock needed):

    .venv/bin/python -m benchmarks.bench_digest            # 256 MiB, 5 runs, median
    .venv/bin/python -m benchmarks.bench_digest --mib 64 --runs 3 --json

The data is bf16 (random normal values rounded to bf16's 16 bits, as a trained
weight looks to a hash). Two settings:

- memory: the bytes are already in memory (a trainer hashing a CPU state dict);
  each hash runs over the whole buffer in one call.
- file: the bytes are read from a file whose pages are warm in the page cache
  (`read` reuses one 8 MiB buffer; `read+H` hashes each chunk as it arrives,
  one pass, as `inspect-order --scan` and a reload do). `read` is the limit a
  digest check that reads the file cannot beat.

BLAKE3 runs single-threaded and with its own thread pool (`max_threads=AUTO`,
all cores); xxh3-128 has no multithreaded mode. SHA-256 (hashlib) is there for
scale: it is what `reorder --verify` uses today.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import xxhash

_CHUNK = 8 << 20


def bf16_bytes(nbytes: int, seed: int = 0) -> bytes:
    """`nbytes` of bf16 values: normal(0, 0.02) rounded to bf16 (the upper 16 bits of float32)."""
    import numpy as np  # noqa: PLC0415 - numpy: heavy (`--help` stays fast)

    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(nbytes // 2, dtype=np.float32) * 0.02).view(np.uint32)
    return (values >> 16).astype("<u2").tobytes()


def _hashers() -> dict[str, Callable[[], object]]:
    import blake3  # noqa: PLC0415 - blake3: optional dependency (a dev tool)

    return {
        "xxh3-128": xxhash.xxh3_128,
        "blake3": blake3.blake3,
        "blake3-mt": lambda: blake3.blake3(max_threads=blake3.blake3.AUTO),
        "sha256": hashlib.sha256,
    }


def _median_seconds(run: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _read_file(path: str, update: Callable[[memoryview], object] | None) -> None:
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buf)
            if not got:
                break
            if update is not None:
                update(view[:got])


def measure(nbytes: int, runs: int) -> dict:
    """Median GB/s (10^9 bytes per second) of each hash in memory and over a warm file, and of a plain read."""
    data = bf16_bytes(nbytes)
    results: dict[str, dict[str, float]] = {"memory": {}, "file": {}}
    hashers = _hashers()
    for name, make in hashers.items():
        def whole(make=make) -> None:
            h = make()
            h.update(data)
            h.digest()

        results["memory"][name] = nbytes / _median_seconds(whole, runs) / 1e9
    with tempfile.NamedTemporaryFile(prefix="bench-digest-", suffix=".bin", delete=False) as f:
        f.write(data)
        path = f.name
    try:
        _read_file(path, None)  # warm the page cache
        results["file"]["read"] = nbytes / _median_seconds(lambda: _read_file(path, None), runs) / 1e9
        for name, make in hashers.items():
            def run(make=make) -> None:
                h = make()
                _read_file(path, h.update)
                h.digest()

            results["file"][f"read+{name}"] = nbytes / _median_seconds(run, runs) / 1e9
    finally:
        os.unlink(path)
    return {"bytes": nbytes, "runs": runs, "cpus": os.cpu_count(), "gb_per_s": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes of bf16 data, in MiB (default 256)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per case; the median is reported")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    result = measure(args.mib << 20, args.runs)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.mib} MiB of bf16, median of {args.runs} runs, {result['cpus']} CPU(s); GB/s = 10^9 bytes/s")
    for setting, rows in result["gb_per_s"].items():
        for name, rate in rows.items():
            print(f"  {setting:7s} {name:16s} {rate:7.2f} GB/s")


if __name__ == "__main__":
    main()
