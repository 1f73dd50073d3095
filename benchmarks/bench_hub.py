"""Benchmark a reload from the Hub against fetching the repo alone plus the same reload from a local copy.

Run (engines share this machine's cores: take the lock):

    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_hub --out bench-out
    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_hub --size-gib 0.1 --throttles 4e6 \
        --out /tmp/q

It writes two synthetic Qwen3-architecture checkpoints (real bf16 values, 5 shards), A and B, and serves B as
`org/step` from a loopback Hub (`tests/support/hub_server.py`: LFS bytes from a second origin behind a 302,
each connection paced to the throttle, as a CDN limits each connection). For each throttle, with a fresh Hub
cache for each command:

    fetch   huggingface_hub's `snapshot_download` of the repo alone (what a user runs before a local reload)
    local   `layerwise reload --model A --weights-path B` from the local copy (engine start and reload)
    hub     `layerwise reload --model A --weights-path org/step`: the commit's shards fetched by range while
            the engine starts (`client/engine/prefetch.py`), then reloaded from the cache

Each command runs as a user runs it (a new process, wall time from outside), and the server counts the weight
bytes it sent. The figure of merit is hub / (fetch + local): 1.0 is no overlap at all; the time of the larger
of fetch and start, plus the reload, is the floor.
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

from benchmarks.bench_checkpoints import model_for, tokenizer_vocab, write_bench_checkpoint
from layerwise_cli.demo import demo_checkpoint
from tests.support.hub_server import HubServer
from tests.support.synthetic import normal_weights

REPO = "org/step"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=0.4, help="checkpoint size (default 0.4)")
    parser.add_argument("--throttles", default="3e6,12e6",
                        help="bytes per second per connection, comma separated (default 3e6,12e6)")
    parser.add_argument("--runs", type=int, default=1, help="runs of each command per throttle")
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    args = parser.parse_args(argv)
    args.quick = False
    args.preset = None
    return args


def write_checkpoints(work: Path, size_gib: float) -> tuple[Path, Path]:
    tokenizer = demo_checkpoint("multiply")
    model = model_for(argparse.Namespace(preset=None, quick=False, size_gib=size_gib), tokenizer_vocab(tokenizer))
    a = Path(write_bench_checkpoint(work / "A", model, "in_order", tokenizer, normal_weights(model, seed=1),
                                    shards=5, variant="hub-A")["path"])
    b = Path(write_bench_checkpoint(work / "B", model, "in_order", tokenizer, normal_weights(model, seed=2),
                                    shards=5, variant="hub-B")["path"])
    return a, b


def timed(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    return seconds


def run_throttle(hub, throttle: int, a: Path, b: Path, runs: int) -> dict:
    python = sys.executable
    results: dict[str, list] = {"fetch": [], "local": [], "hub": [], "fetch_bytes": [], "hub_bytes": []}
    hub.throttle_bps = throttle
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="bench-hub-") as home:
            env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": home, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
            hub.reset_counts()
            fetch = [python, "-c", f"from huggingface_hub import snapshot_download; snapshot_download({REPO!r})"]
            results["fetch"].append(timed(fetch, env))
            results["fetch_bytes"].append(hub.sent_for(".safetensors"))
        with tempfile.TemporaryDirectory(prefix="bench-hub-") as home:
            env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": home}
            results["local"].append(timed([python, "-m", "layerwise_cli", "reload", "--model", str(a),
                                           "--weights-path", str(b), "--json"], env))
            hub.reset_counts()
            results["hub"].append(timed([python, "-m", "layerwise_cli", "reload", "--model", str(a),
                                         "--weights-path", REPO, "--json"], env))
            results["hub_bytes"].append(hub.sent_for(".safetensors"))
    median = {key: sorted(values)[len(values) // 2] for key, values in results.items()}
    checkpoint = sum(path.stat().st_size for path in b.glob("*.safetensors"))
    return {"throttle_bytes_per_s": throttle, "runs": results, "median": median, "checkpoint_bytes": checkpoint,
            "hub_over_fetch_plus_local": median["hub"] / (median["fetch"] + median["local"]),
            "hub_bytes_over_checkpoint": median["hub_bytes"] / checkpoint}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-hub-work-"))
    a, b = write_checkpoints(work, args.size_gib)
    rows = []
    with HubServer(cdn=True) as hub:
        hub.add_repo(REPO, b)
        for throttle in (int(float(t)) for t in args.throttles.split(",")):
            row = run_throttle(hub, throttle, a, b, args.runs)
            rows.append(row)
            m = row["median"]
            print(f"throttle {throttle / 1e6:g} MB/s per connection: fetch {m['fetch']:.1f} s, local reload "
                  f"{m['local']:.1f} s, hub reload {m['hub']:.1f} s = {row['hub_over_fetch_plus_local']:.2f} x "
                  f"(fetch + local); weight bytes sent {row['hub_bytes_over_checkpoint']:.3f} x the checkpoint",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"size_gib": args.size_gib, "rows": rows}, indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
