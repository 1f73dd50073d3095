"""Benchmark `inspect-order` on a large synthetic MoE checkpoint: wall time and bytes read."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.units import human_bytes, human_seconds
from tests.support import hub_server
from tests.support.synthetic import SyntheticModel, write_checkpoint

_EPILOG = """\
Writes a Qwen3-MoE-shaped checkpoint (default: 64 shards, 5,043 tensors, about
1.2 GiB), runs inspect-order's core on it, and reports the wall time and the
bytes read as a fraction of the checkpoint (headers only: must stay under
0.1%). Unless --no-hub, it also serves the checkpoint from the tests' loopback
Hub (tests/hub_server.py) and reports what that server sent. Exit 1 if more
than 0.1% was read. From the repository root:

    .venv/bin/python -m benchmarks.bench_headers             # temp dir, removed after
    .venv/bin/python -m benchmarks.bench_headers --keep DIR  # keep (and reuse) the checkpoint
"""
_BLOCK = random.Random(0).randbytes(1 << 20)


def _fill(_name: str, n: int) -> bytes:
    # Pseudo-random bytes without generating a gigabyte of randomness: the
    # benchmark reads headers, so the data only has to exist on disk.
    whole, rest = divmod(n, len(_BLOCK))
    return _BLOCK * whole + _BLOCK[:rest]


def _rchar() -> int | None:
    """Bytes this process has passed through read() so far (Linux /proc), or None."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _timed(repeat: int, call):
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement; the median is reported")
    parser.add_argument("--keep", type=Path, help="write the checkpoint here and keep it (reused if present)")
    parser.add_argument("--no-hub", action="store_true", help="skip the loopback Hub measurement")
    args = parser.parse_args()

    model = SyntheticModel(layers=args.layers, hidden=args.hidden, heads=8, kv_heads=2, head_dim=64,
                           experts=args.experts, moe_intermediate=args.moe_intermediate, vocab=8192)
    tmp = None
    folder = args.keep
    if folder is None:
        tmp = tempfile.mkdtemp(prefix="layerwise-bench-")
        folder = Path(tmp) / "ckpt"
    try:
        if not (folder / "config.json").is_file():
            start = time.perf_counter()
            write_checkpoint(folder, model, "in_order", args.shards, data=_fill)
            print(f"wrote {folder} in {human_seconds(time.perf_counter() - start)}", file=sys.stderr)
        return _bench(folder, args)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _bench(folder: Path, args: argparse.Namespace) -> int:
    shard_files = sorted(folder.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shard_files)
    inspect_order(str(folder))  # warm the page cache and imports: time the steady state
    before = _rchar()
    report = inspect_order(str(folder))
    after = _rchar()
    median, best, report = _timed(args.repeat, lambda: inspect_order(str(folder)))
    plan = report.plan
    header = plan.checkpoint.header_bytes_read
    tensors = len(plan.file_order)
    print(f"checkpoint      {len(shard_files)} shards, {tensors} tensors, {human_bytes(size)} ({size:,} bytes)")
    if len(shard_files) < 50 or tensors < 5000:
        print("  (smaller than the 50 shards and 5,000 tensors the issue asks the benchmark to use)")
    print(f"parent layers   {len(plan.layers)}, largest {human_bytes(plan.largest_layer_bytes)}; "
          f"file-order peak {human_bytes(report.file_order_buffering.peak_buffer_bytes)}, "
          f"layer-order peak {human_bytes(report.layer_order_buffering.peak_buffer_bytes)}")
    print(f"local           {human_seconds(median)} median, {human_seconds(best)} best of {args.repeat}")
    print(f"  header bytes  {header:,} = {100 * header / size:.4f}% of the shard files")
    if before is not None and after is not None:
        total = after - before
        print(f"  read() bytes  {total:,} = {100 * total / size:.4f}% (whole process during one run: "
              "headers, index, config)")
    ok = header < 0.001 * size
    if not args.no_hub:
        ok &= _bench_hub(folder, args, size, report)
    print("PASS: under 0.1% of the checkpoint read" if ok else "FAIL: 0.1% of the checkpoint exceeded")
    return 0 if ok else 1


# The client runs in its own interpreter: huggingface_hub reads HF_ENDPOINT at
# import, and a client sharing the server's GIL would time the server too.
_HUB_CLIENT = """
import json, statistics, sys, time
from layerwise_cli.planning.inspect import inspect_order
inspect_order("bench/moe")  # warm: config and index cached, as on a second run
print("WARM", flush=True)
sys.stdin.readline()
times = []
for _ in range({repeat}):
    start = time.perf_counter()
    report = inspect_order("bench/moe")
    times.append(time.perf_counter() - start)
print(json.dumps({{"median": statistics.median(times), "best": min(times), "report": report.to_dict()}}))
"""


def _bench_hub(folder: Path, args: argparse.Namespace, size: int, local) -> bool:
    for path in folder.iterdir():
        hub_server._etag(path)  # hash the files before timing, as the real Hub has
    hf_home = tempfile.mkdtemp(prefix="layerwise-bench-hf-")
    server = hub_server.HubServer()
    server.add_repo("bench/moe", folder)
    try:
        with server:
            env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
            env.update(HF_ENDPOINT=server.endpoint, HF_HOME=hf_home, HF_HUB_DISABLE_TELEMETRY="1",
                       HF_HUB_DISABLE_PROGRESS_BARS="1")
            client = subprocess.Popen([sys.executable, "-c", _HUB_CLIENT.format(repeat=args.repeat)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert client.stdin and client.stdout
            assert client.stdout.readline().strip() == "WARM"
            server.reset_counts()
            client.stdin.write("go\n")
            client.stdin.flush()
            out, _ = client.communicate(timeout=600)
            if client.returncode:
                raise RuntimeError(f"Hub client failed with exit code {client.returncode}")
            result = json.loads(out)
            sent = server.sent_for(".safetensors") // args.repeat
            sent_all = sum(server.bytes_sent.values()) // args.repeat
            requests = len(server.requests) // args.repeat
    finally:
        shutil.rmtree(hf_home, ignore_errors=True)
    ignore = {"source": None, "kind": None}
    same = result["report"] | ignore == local.to_dict() | ignore
    print(f"loopback Hub    {human_seconds(result['median'])} median, {human_seconds(result['best'])} best of "
          f"{args.repeat}; {requests} requests per run (HEAD of config.json twice, 2 range GETs per shard)")
    print(f"  server sent   {sent:,} bytes of .safetensors = {100 * sent / size:.4f}% of the shard files; "
          f"{sent_all:,} bytes in all")
    print(f"  same report as local: {same}")
    return same and sent < 0.001 * size


if __name__ == "__main__":
    sys.exit(main())
