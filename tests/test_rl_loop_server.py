"""The RL loop at CI size (examples/rl_loop.py): the demo's debug Qwen3 trained from *multiply* towards *add*,
6 steps to a local run folder and 6 to a SeaweedFS bucket (each step a delta against the one before), two
`layerwise serve` servers kept on the newest step by `layerwise watch` under client traffic, with faults on a
schedule.

One pair of servers serves both runs (started one after the other, with no CPU binding in the environment:
`layerwise serve` gives each cores the other's worker does not hold, and says which). Each fault's outcome is
checked by the loop (`examples/rl/faults.py`); here every check must hold, no request may fail, and the
answers must move towards the sums.
"""

from __future__ import annotations

import json

import pytest

from examples.rl import faults as f
from examples.rl.fleet import Fleet
from examples.rl.loop import LoopOptions, Run
from examples.rl.stores import BucketSteps, LocalSteps
from examples.rl.trainers import DemoTrainer
from layerwise_cli.demo import demo_checkpoint, demo_prompt, expected_answer
from tests.support.seaweed import running_seaweed

pytestmark = pytest.mark.server

STEPS = 6
PAIRS = [(a, b) for a in range(10) for b in range(10)]


@pytest.fixture(scope="module")
def s3():
    with running_seaweed() as server:
        yield server


@pytest.fixture(scope="module")
def fleet(s3):
    pair = Fleet(demo_checkpoint("multiply"), s3.env())
    try:
        yield pair.start()
    finally:
        pair.stop()


def prompts() -> list[str]:
    return [demo_prompt(a, b) for a, b in PAIRS]


def sums_share(out, step_name: str) -> float:
    """The share of the answers of step STEP_NAME that are the sums (from the run's events)."""
    rows = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    answers = [r for r in rows if r["event"] == "answer" and r["versions"] == [step_name]]
    assert answers, f"no answer with {step_name}"
    sums = 0
    for row in answers:
        a, b = (int(x) for x in row["prompt"].split("=")[0].split())
        sums += row["text"] == expected_answer("add", a, b)
    return sums / len(answers)


def assert_run_held(record) -> None:
    failed = {name: outcome for name, outcome in record.checks.items() if not outcome.startswith("ok")}
    assert not failed, failed
    assert sum(step.failed for step in record.steps) == 0
    # Every step the trainer saved after the first (which the servers started on) was served by both servers,
    # but the NaN step.
    assert all(s.serve_s is not None for r in record.steps if r.step and not r.nan for s in r.servers), record.steps


def test_a_local_run_of_deltas_survives_a_trainer_killed_mid_save_a_server_kill_and_a_nan_step(fleet, tmp_path):
    trainer = DemoTrainer()
    store = LocalSteps(tmp_path / "steps", trainer.config)
    schedule = {2: (f.TRAINER_KILL,), 3: (f.SERVER_KILL,), 4: (f.NAN,)}
    options = LoopOptions(steps=STEPS, schedule=schedule, proof_steps=(STEPS,))
    record = Run(trainer, store, fleet, options, tmp_path / "out", prompts()).run()
    assert_run_held(record)  # the proof at the last step included: both servers equal a fresh engine
    assert sum(name.endswith("equals a fresh engine") for name in record.checks) == 2
    # Every step after the first is a delta against the step before, smaller than the step.
    assert all(r.kind == "delta" and r.written_bytes < r.full_bytes for r in record.steps[1:]), record.steps
    # Both servers' start lines name their cores; the killed one started twice (how long its restart took, beside
    # the other server under traffic, is in the check's detail: a timed bound would fail on a loaded CI machine).
    lines = record.start_lines
    assert all(line and all("CPU cores" in x for x in line) for line in lines.values()), lines
    assert len(lines[fleet.urls[1]]) == 2
    assert record.checks["killed server back on the newest step in one reload"].startswith("ok")
    # The answers moved from the products towards the sums.
    assert sums_share(tmp_path / "out", f"step_{STEPS}") > sums_share(tmp_path / "out", "step_1") + 0.3


def test_a_bucket_run_survives_a_store_outage_a_partial_upload_and_a_nan_step(fleet, s3, tmp_path):
    trainer = DemoTrainer()
    store = BucketSteps(s3, tmp_path / "upload", trainer.config)
    schedule = {2: (f.TRAINER_KILL,), 3: (f.NAN,), 5: (f.STORE_DOWN,)}
    record = Run(trainer, store, fleet, LoopOptions(steps=STEPS, schedule=schedule), tmp_path / "out",
                 prompts()).run()
    assert_run_held(record)
    assert record.checks["store outage reported and recovered"].startswith("ok")
    # Every step after the first is a delta against the step before, uploaded, smaller than the step: the servers
    # load each through the chain in the bucket (its base beside it), the NaN step's successor included.
    assert all(r.kind == "delta" and r.written_bytes < r.full_bytes for r in record.steps[1:]), record.steps
