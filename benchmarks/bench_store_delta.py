"""Benchmark a training step by URL, as a delta against the step the engine holds and as the full step.

Run (an engine shares this machine's cores: take the lock):

    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_store_delta --size-gib 0.2 \\
        --throttle 12e6 --out /tmp/bench-store-delta

It writes a synthetic Qwen3-architecture checkpoint (real bf16 values) as `step_1`, then three AdamW steps
(`--lr`, default 3e-6: about 3% of bf16 values change per step, `bench_rl_steps`) saved with
`save_checkpoint(base=...)` as deltas `step_2`..`step_4`, and `step_4` again in full. Both go to SeaweedFS
(`tests/support/seaweed.py`) behind a proxy that paces each connection's replies to `--throttle` bytes/s, as a
CDN limits each connection. One in-process engine, started on `step_1`, loads `s3://.../run/step_1` (every
layer: the host's store cache then holds it), then the deltas `step_2` and `step_3`; then, timed, the same
step two ways from the same state (the engine on `step_3`):

    full    `reload(llm, "s3://.../full/step_4")`: the full step by URL
    delta   `reload(llm, "s3://.../run/step_4")`: the delta by URL (its chain's full step from the cache)

The figures are each reload's wall time and the bytes the proxy sent (the store's replies: headers, shards,
delta files) and the report's `fetched_bytes`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import layerwise_cli
from benchmarks.bench_checkpoints import model_for, tokenizer_vocab, write_bench_checkpoint
from layerwise_cli.demo import demo_checkpoint
from layerwise_cli.writer.save import save_checkpoint
from tests.support.engine_support import copy_non_weights
from tests.support.in_process import start_here, stop_here
from tests.support.seaweed import BUCKET, SeaweedS3, weed_binary
from tests.support.synthetic import normal_weights
from tests.support.throttle_proxy import ThrottleProxy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=0.2, help="checkpoint size (default 0.2)")
    parser.add_argument("--throttle", type=float, default=12e6, help="bytes per second per connection")
    parser.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate (default 3e-6)")
    parser.add_argument("--warmup", type=int, default=2, help="AdamW steps before step_1 (default 2)")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the steps are written (kept; steps already there from a run of the same "
                             "options are used again); default: a temporary folder")
    parser.add_argument("--write-only", action="store_true", help="write the steps into --work, start no engine")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    return parser.parse_args(argv)


def write_run(work: Path, size_gib: float, lr: float, warmup: int) -> dict:
    """step_1 in full, step_2..step_4 as deltas (one AdamW step each), step_4 in full: each step's changed share."""
    from safetensors.torch import load_file  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    tokenizer = demo_checkpoint("multiply")
    model = model_for(argparse.Namespace(preset=None, quick=False, size_gib=size_gib), tokenizer_vocab(tokenizer))
    first = Path(write_bench_checkpoint(work / "A", model, "in_order", tokenizer, normal_weights(model, seed=1),
                                        shards=5, variant="delta-A")["path"])
    config = json.loads((first / "config.json").read_text())
    tensors = {}
    for shard in sorted(first.glob("*.safetensors")):
        tensors.update(load_file(shard))
    steps, changed, total = adamw_steps(tensors, lr, warmup)
    del tensors
    out = {}
    for i, (name, values) in enumerate(steps.items(), 1):
        base = work / "run" / f"step_{i - 1}" if i > 1 else None
        saved = save_checkpoint(values.items(), work / "run" / name, config=config, marker=None, base=base)
        assert (saved.delta is not None) == (i > 1), saved.fallback
        copy_non_weights(first, work / "run" / name)
    save_checkpoint(steps["step_4"].items(), work / "full" / "step_4", config=config, marker=None)
    copy_non_weights(first, work / "full" / "step_4")
    out["changed_fraction"] = [n / total for n in changed]
    out["step_bytes"] = sum(p.stat().st_size for p in (work / "full" / "step_4").glob("*.safetensors"))
    out["delta_bytes"] = (work / "run" / "step_4" / "delta.safetensors").stat().st_size
    return out


def adamw_steps(tensors: dict, lr: float, warmup: int) -> tuple[dict, list[int], int]:
    """Four bf16 steps of TENSORS, one AdamW step apart (fresh random gradients, `bench_rl_steps`' recipe), after
    WARMUP steps; tensor by tensor, so that only one tensor's fp32 master and moments are held at a time.

    The fp32 master starts off the bf16 grid (each value uniform within its bf16 value's rounding interval), as
    in a run under way: what `bench_rl_steps` reaches with 20 warm-up steps, without their cost on a 1 GB model.

    Returns:
        {step_1..step_4: {name: bf16 tensor}}, the values changed by each of the three steps, the values in all.
    """
    import torch  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    steps: dict[str, dict] = {f"step_{i}": {} for i in (1, 2, 3, 4)}
    changed, total = [0, 0, 0], 0
    for n, name in enumerate(sorted(tensors)):
        gen = torch.Generator().manual_seed(n)
        master = torch.nn.Parameter(off_grid(tensors[name], gen))
        optimizer = torch.optim.AdamW([master], lr=lr, weight_decay=0.0)
        for i in range(warmup + 4):
            optimizer.zero_grad()
            master.grad = torch.randn(master.shape, generator=gen)
            optimizer.step()
            if i >= warmup:
                steps[f"step_{i - warmup + 1}"][name] = master.detach().to(torch.bfloat16)
        for i in range(3):
            before, after = steps[f"step_{i + 1}"][name], steps[f"step_{i + 2}"][name]
            changed[i] += int((before.view(torch.int16) != after.view(torch.int16)).sum())
        total += master.numel()
    return steps, changed, total


def off_grid(tensor, gen):
    """An fp32 master of the bf16 TENSOR: each value moved uniformly within its rounding interval (half a unit in
    the last place either side), so that it rounds back to TENSOR."""
    import torch  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    base = tensor.float()
    ulp = ((tensor.view(torch.int16) + 1).view(torch.bfloat16).float() - base).abs()
    return base + (torch.rand(tensor.shape, generator=gen) - 0.5) * ulp * 0.999


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-store-delta-"))
    written = work / f"written-{args.size_gib}-{args.lr}-{args.warmup}.json"
    if written.is_file():
        made = json.loads(written.read_text())
    else:
        made = write_run(work, args.size_gib, args.lr, args.warmup)
        written.write_text(json.dumps(made))
    if args.write_only:
        return 0
    print(f"steps written: {made['step_bytes'] / 2**30:.3f} GiB a step, changed per step "
          f"{', '.join(f'{f:.2%}' for f in made['changed_fraction'])}; step_4's delta {made['delta_bytes']} bytes",
          flush=True)
    with SeaweedS3(weed_binary()) as s3:
        for folder in sorted((work / "run").iterdir()):
            s3.put_folder(f"run/{folder.name}", folder)
        s3.put_folder("full/step_4", work / "full" / "step_4")
        with ThrottleProxy(("127.0.0.1", s3.port), args.throttle) as proxy:
            # A store cache of this run's own: nothing kept by an earlier run of the same --work.
            cache = tempfile.mkdtemp(prefix="bench-store-delta-cache-")
            os.environ.update(s3.env(AWS_ENDPOINT_URL=proxy.endpoint, LAYERWISE_CACHE=cache))
            llm = start_here(str(work / "run" / "step_1"))
            try:
                rows = measure(llm, layerwise_cli, proxy, f"s3://{BUCKET}")
            finally:
                stop_here(llm)
    result = {"size_gib": args.size_gib, "throttle_bytes_per_s": args.throttle, "lr": args.lr, **made, **rows,
              "delta_over_full_wall": rows["delta"]["wall_s"] / rows["full"]["wall_s"]}
    print(f"throttle {args.throttle / 1e6:g} MB/s per connection: full step by URL {rows['full']['wall_s']:.2f} s "
          f"({rows['full']['sent']} bytes sent), delta step by URL {rows['delta']['wall_s']:.2f} s "
          f"({rows['delta']['sent']} bytes sent): {result['delta_over_full_wall']:.3f} x", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return 0


def measure(llm, api, proxy, bucket: str) -> dict:
    """From the engine on step_3 each time: the full step_4 by URL, then (back on step_3) its delta by URL."""
    def timed(url: str) -> dict:
        sent, start = proxy.sent, time.perf_counter()
        report = api.reload(llm, url)
        return {"wall_s": time.perf_counter() - start, "sent": proxy.sent - sent,
                "fetched_bytes": report.volume.fetched_bytes, "patched_layers": report.volume.patched_layers}

    def to_step_3() -> None:
        api.reload(llm, f"{bucket}/run/step_1", all_layers=True)
        api.reload(llm, f"{bucket}/run/step_2")
        api.reload(llm, f"{bucket}/run/step_3")

    to_step_3()
    full = timed(f"{bucket}/full/step_4")
    to_step_3()
    delta = timed(f"{bucket}/run/step_4")
    return {"full": full, "delta": delta}


if __name__ == "__main__":
    raise SystemExit(main())
