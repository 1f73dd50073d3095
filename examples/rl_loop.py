"""An RL weight loop, end to end: a trainer writes steps, `layerwise watch` keeps two `layerwise serve` servers on
the newest one while a client sends completions, and faults strike on a schedule.

Two sizes:

- `--size learning` (default): the demo's debug Qwen3, trained from *multiply* towards *add* with torch AdamW on
  the demo's task; the answers move from products to sums over the steps, each labelled with its step.
- `--size figures`: a Qwen3 of the benchmark's shape (at least 0.4 GB), AdamW on synthetic gradients, as
  `benchmarks.bench_rl_steps` does: the figures RL teams compare.

`--store` picks where the steps go: `local` (a run folder; each step a delta against the one before,
`save_checkpoint(..., base=previous)`), `seaweedfs` (a SeaweedFS bucket started here; the same deltas, uploaded)
or `hub` (the loopback Hub started here; the same deltas, a step folder per push: `hf://rl/run/step_N`).

Faults (`--faults`, default each once): `trainer_kill` (the trainer SIGKILLed halfway through a save, then saving
again: the incomplete step is never loaded), `server_kill` (a server SIGKILLed and restarted while the other
serves: it comes up and catches up in one reload), `nan` (a step holding a NaN: refused and skipped, the fleet
stays on the step before), `store_down` (the bucket or Hub stopped for `--outage` seconds: `watch` reports it down
and back, and catches up).

Out (`--out`): `events.jsonl` (every event: the loop's, `watch`'s, each answer), `summary.json` (one record per
step, the figures, the checks), `timeline.png`; a table on stdout. Run from the repository root:

    python -m examples.rl_loop --steps 12 --out /tmp/rl
    python -m examples.rl_loop --store seaweedfs --steps 6 --out /tmp/rl-s3
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.rl import faults
from examples.rl.figures_model import figures_checkpoint
from examples.rl.fleet import Fleet
from examples.rl.loop import LoopOptions, Run
from examples.rl.stores import BucketSteps, HubSteps, LocalSteps
from examples.rl.summary import render, timeline, write_summary
from examples.rl.trainers import DemoTrainer, SyntheticTrainer
from layerwise_cli.demo import demo_prompt
from tests.support.hub_server import HubServer
from tests.support.seaweed import SeaweedS3, weed_binary


@contextlib.contextmanager
def open_store(kind: str, scratch: Path, trainer) -> Iterator[object]:
    """The step store KIND, with its server started here for `seaweedfs` and `hub` (stopped on exit)."""
    if kind == "local":
        yield LocalSteps(scratch, trainer.config)
    elif kind == "seaweedfs":
        with SeaweedS3(weed_binary()) as s3:
            yield BucketSteps(s3, scratch / "upload", trainer.config)
    else:
        with HubServer() as hub:
            yield HubSteps(hub, scratch / "hub", trainer.config)


def make_trainer(size: str, scratch: Path):
    if size == "learning":
        return DemoTrainer()
    return SyntheticTrainer(figures_checkpoint(scratch / "figures-model"))


def prompts_for(size: str) -> list[str]:
    if size == "learning":
        return [demo_prompt(a, b) for a in range(10) for b in range(10)]
    return ["1 2 3 4", "the quick brown fox", "5 6 7"]


def run(args: argparse.Namespace):
    """Set up the trainer, the store and the servers, run the loop, write and show its record."""
    out = Path(args.out)
    scratch = Path(tempfile.mkdtemp(prefix="rl-loop-", dir=args.scratch))
    trainer = make_trainer(args.size, scratch)
    schedule = faults.default_schedule(args.steps) if args.faults == "default" else faults.parse_schedule(args.faults)
    proof = (args.steps,) if args.proof == "last" else tuple(int(x) for x in args.proof.split(",") if x.strip())
    options = LoopOptions(steps=args.steps, schedule=schedule, outage_s=args.outage, gap_s=args.gap,
                          threads=args.threads, proof_steps=proof, pause_mode=args.pause_mode)
    with open_store(args.store, scratch, trainer) as store:
        fleet = Fleet(trainer.start, store.env)
        began = time.monotonic()
        try:
            fleet.start()
            record = Run(trainer, store, fleet, options, out, prompts_for(args.size)).run()
        finally:
            fleet.stop()
    write_summary(record, out)
    timeline(out / "events.jsonl", out / "timeline.png", store.step_of)
    render(record)
    print(f"run: {time.monotonic() - began:.0f} s; written to {out}")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--size", choices=("learning", "figures"), default="learning")
    parser.add_argument("--steps", type=int, default=12, help="steps after step 0 (default 12)")
    parser.add_argument("--store", choices=("local", "seaweedfs", "hub"), default="local",
                        help="where the deltas go: a local run folder, a SeaweedFS bucket or the loopback Hub")
    parser.add_argument("--faults", default="default", help="FAULT@STEP,... (trainer_kill, server_kill, nan, "
                        "store_down), `default` (each once) or `none`")
    parser.add_argument("--proof", default="last", help="steps at which each server is verified and compared with "
                        "an engine started fresh on the full step, after the run (N,M,...; default: the last)")
    parser.add_argument("--outage", type=float, default=15.0, help="seconds the store is down (store_down)")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds of traffic on each step before the next")
    parser.add_argument("--threads", type=int, default=2, help="client threads")
    parser.add_argument("--pause-mode", choices=("wait", "keep", "none"), default="wait",
                        help="how watch pauses the servers: wait (in-flight requests finish first), keep (they "
                        "are frozen and go on with the new weights: no drain inside the pause) or none (no pause: "
                        "each engine takes the reload between two of its steps, running requests go on with the "
                        "new weights)")
    parser.add_argument("--out", default="rl-run", help="folder for events.jsonl, summary.json, timeline.png")
    parser.add_argument("--scratch", default=None, help="where the run's steps are written (default: a temp dir)")
    args = parser.parse_args(argv)
    record = run(args)
    return 0 if all(v.startswith("ok") for v in record.checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
