"""Benchmark a training step by URL, as a delta against the step the engine holds and as the full step.

Run (an engine shares this machine's cores: take the lock):

    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_store_delta --size-gib 0.2 \\
        --throttle 12e6 --out /tmp/bench-store-delta
    ... --stores hub ...     # one store alone (default: s3,hub, both in the same run)

It writes a synthetic Qwen3-architecture checkpoint (real bf16 values) as `step_1`, then three AdamW steps
(`--lr`, default 3e-6: about 3% of bf16 values change per step, `bench_rl_steps`) saved with
`save_checkpoint(base=...)` as deltas `step_2`..`step_4`, and `step_4` again in full. Each store of `--stores`
(default both, in one run) serves them, each connection paced to `--throttle` bytes/s, as a CDN limits each
connection (`benchmarks/served_run.py`):

    s3   SeaweedFS (`tests/support/seaweed.py`) behind a pacing proxy: `s3://ckpts/run/step_N`, and the full
         step as `s3://ckpts/full/step_4`; an empty store cache of the run's own
    hub  the loopback Hub (`tests/support/hub_server.py`, LFS bytes from its CDN origin behind a 302, as in
         `bench_hub`): the run pushed to `org/run` a commit per step (`hf://org/run/step_N`), the full step as
         `hf://org/full/step_4`; `HF_ENDPOINT` pointing at it, an empty Hub cache of the run's own

One in-process engine, started on `step_1` (local), takes both stores' steps in turn. For each store it loads
that store's `step_1` (every layer: the host's cache then holds it), then the deltas `step_2` and `step_3` (on
the Hub, each at the commit that pushed it, as a host that followed the run did); then, timed, step 4 two ways
from the same state (the engine on `step_3`):

    full    `reload(llm, ".../full/step_4")`: the full step by URL
    delta   `reload(llm, ".../run/step_4")`: the delta by URL (its chain's full step from the host's cache; on
            the Hub at the commit `main` names, the one that pushed step_4)

Each row's figures: the reload's wall time, the bytes the store sent meanwhile (s3: every byte the proxy relayed,
headers, shards and delta files; hub: the body of every reply of both origins), the report's `fetched_bytes`
(None for the full step from the Hub: the report counts a Hub run's fetch for a delta step only), and whether
the engine then holds step 4's tensors (`verify_engine` against the local full step_4, untimed). results.json
holds a section per store (`s3`, `hub`); the summary prints a line per store. `--quick` writes a 4-layer model
of a few MB instead, for the test (`tests/test_bench_quick.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import layerwise_cli
from benchmarks.bench_checkpoints import model_for, tokenizer_vocab, write_bench_checkpoint
from benchmarks.served_run import STORES, ServedRun
from layerwise_cli.demo import demo_checkpoint
from layerwise_cli.writer.save import save_checkpoint
from tests.support.engine_support import copy_non_weights
from tests.support.in_process import start_here, stop_here
from tests.support.synthetic import normal_weights


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=0.2, help="checkpoint size (default 0.2)")
    parser.add_argument("--throttle", type=float, default=12e6, help="bytes per second per connection")
    parser.add_argument("--stores", default=",".join(STORES),
                        help=f"the stores to serve the run from, comma separated (default {','.join(STORES)})")
    parser.add_argument("--quick", action="store_true", help="a 4-layer model of a few MB (for the test)")
    parser.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate (default 3e-6)")
    parser.add_argument("--warmup", type=int, default=2, help="AdamW steps before step_1 (default 2)")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the steps are written (kept; steps already there from a run of the same "
                             "options are used again); default: a temporary folder")
    parser.add_argument("--write-only", action="store_true", help="write the steps into --work, start no engine")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    args = parser.parse_args(argv)
    args.stores = [name.strip() for name in args.stores.split(",") if name.strip()]
    unknown = sorted(set(args.stores) - set(STORES))
    if unknown or not args.stores:
        parser.error(f"--stores: {', '.join(unknown) or 'none'} (one or more of {', '.join(STORES)})")
    return args


def write_run(work: Path, size_gib: float, lr: float, warmup: int, quick: bool = False) -> dict:
    """step_1 in full, step_2..step_4 as deltas (one AdamW step each), step_4 in full: each step's changed share."""
    from safetensors.torch import load_file  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    tokenizer = demo_checkpoint("multiply")
    model = model_for(argparse.Namespace(preset=None, quick=quick, size_gib=size_gib), tokenizer_vocab(tokenizer))
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
    written = work / f"written-{'quick' if args.quick else args.size_gib}-{args.lr}-{args.warmup}.json"
    if written.is_file():
        made = json.loads(written.read_text())
    else:
        made = write_run(work, args.size_gib, args.lr, args.warmup, args.quick)
        written.write_text(json.dumps(made))
    if args.write_only:
        return 0
    print(f"steps written: {made['step_bytes'] / 2**30:.3f} GiB a step, changed per step "
          f"{', '.join(f'{f:.2%}' for f in made['changed_fraction'])}; step_4's delta {made['delta_bytes']} bytes",
          flush=True)
    sections = measure_stores(work, args.stores, args.throttle)
    result = {"size_gib": "quick" if args.quick else args.size_gib, "throttle_bytes_per_s": args.throttle,
              "lr": args.lr, **made, **sections}
    for name, rows in sections.items():
        print(summary_line(name, rows, args.throttle), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return 0


def measure_stores(work: Path, stores: list[str], throttle: float) -> dict[str, dict]:
    """Each of STORES serving WORK's run, all opened before the one in-process engine starts (huggingface_hub,
    which vLLM imports, reads its endpoint at import); the engine on `step_1`. Returns a section per store."""
    with ExitStack() as opened:
        served = {name: opened.enter_context(STORES[name](work, throttle)) for name in stores}
        llm = start_here(str(work / "run" / "step_1"))
        try:
            return {name: measure(llm, layerwise_cli, run, work / "full" / "step_4") for name, run in served.items()}
        finally:
            stop_here(llm)


def measure(llm, api, served: ServedRun, full_step: Path) -> dict:
    """From the engine on step_3 each time: the full step_4 by URL, then (back on step_3) its delta by URL; each
    checked against FULL_STEP, the full step_4's local folder, after it was timed."""
    def timed(source: str) -> dict:
        sent, start = served.sent(), time.perf_counter()
        report = api.reload(llm, source)
        row = {"wall_s": time.perf_counter() - start, "sent": served.sent() - sent,
               "fetched_bytes": report.volume.fetched_bytes, "patched_layers": report.volume.patched_layers,
               "rebuilt_layers": report.volume.rebuilt_layers,
               # Where the reload's own seconds went (plan: the source opened, a chain's links fetched).
               "timings": dataclasses.asdict(report.timings)}
        check = api.verify_engine(llm, str(full_step))
        return {**row, "on_step_4": check.ok, "verified_layers": check.matched}

    def to_step_3() -> None:
        for name in ("step_1", "step_2", "step_3"):
            api.reload(llm, served.step(name), revision=served.pins.get(name), all_layers=name == "step_1")

    to_step_3()
    full = timed(served.full)
    to_step_3()
    delta = timed(served.step("step_4"))
    return {"full": full, "delta": delta, "delta_over_full_wall": delta["wall_s"] / full["wall_s"],
            "delta_over_full_sent": delta["sent"] / full["sent"]}


def summary_line(store: str, rows: dict, throttle: float) -> str:
    """One store's figures in a line: each way's wall time and bytes sent, and the delta's share of each."""
    full, delta = rows["full"], rows["delta"]
    ended = "both on step_4" if full["on_step_4"] and delta["on_step_4"] else "NOT both on step_4 (see results.json)"
    return (f"{store}: throttle {throttle / 1e6:g} MB/s per connection: full step by URL {full['wall_s']:.2f} s "
            f"({full['sent']} bytes sent), delta step by URL {delta['wall_s']:.2f} s ({delta['sent']} bytes sent): "
            f"{rows['delta_over_full_wall']:.3f} x wall, {rows['delta_over_full_sent']:.3f} x bytes; {ended}")


if __name__ == "__main__":
    raise SystemExit(main())
