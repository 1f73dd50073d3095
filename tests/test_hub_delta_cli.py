"""A run pushed to a Hub repo, a folder per step, for real: `hf://org/run/step_3` against the loopback Hub.

The repo holds the trainer's run folder as `hf upload org/run run/` pushes it (`step_1` full, `step_2` and
`step_3` deltas naming their bases by the trainer's paths). The step resolves at one commit through the folders
beside it, every tensor rebuilt equals the full step, and a host whose Hub cache holds the earlier steps fetches
only the new delta file; a base folder missing from the commit, and a link pushed again with other weights,
are one line each. Each case runs in a fresh interpreter: huggingface_hub reads `HF_ENDPOINT` at import.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from layerwise_cli.checkpoint.delta.format import DELTA_FILE
from layerwise_cli.checkpoint.delta.read import first_header_read
from layerwise_cli.writer.save import save_checkpoint
from tests.support.deltas import rl_step
from tests.support.hub_server import HubServer
from tests.test_store_delta_cli import _chain

OPEN = """
import json, sys, torch
from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.stream.shard_reader import ShardReader
from safetensors.torch import load_file

source, revision, full = sys.argv[1], sys.argv[2] or None, sys.argv[3]
try:
    step = open_step(source, revision)
except LayerwiseError as exc:
    print(json.dumps({"error": str(exc)}))
    raise SystemExit(0)
want = {}
for name in __import__("os").listdir(full):
    if name.endswith(".safetensors"):
        want.update(load_file(f"{full}/{name}"))
reader = ShardReader(step.local_dir, delta=step.delta)
equal = all(torch.equal(reader.read(PlannedTensor(e, "x")), want[e.name]) for e in step.tensors)
print(json.dumps({"kind": step.kind, "commit": step.commit, "source": step.source, "equal": equal,
                  "links": len(step.delta.links) if step.delta else 0,
                  "fetched": step.delta.fetched_bytes if step.delta else None}))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hub-delta")
    steps = _chain(root / "run")
    for name, tensors in steps.items():
        save_checkpoint(tensors.items(), root / "full" / name, config={"model_type": "llama"}, marker=None)
    # A repo whose commit lacks step_2 (never pushed), and one where step_2 was pushed again with other weights.
    shutil.copytree(root / "run", root / "orphan")
    shutil.rmtree(root / "orphan" / "step_2")
    shutil.copytree(root / "run", root / "rewritten")
    shutil.rmtree(root / "rewritten" / "step_2")
    other = {n: rl_step(t, 0.03, 77) for n, t in steps["step_1"].items()}  # another step 2, against step_1
    save_checkpoint(other.items(), root / "rewritten" / "step_2", config={"model_type": "llama"}, marker=None,
                    base=root / "run" / "step_1")
    return {"root": root, "steps": steps}


@pytest.fixture(scope="module")
def hub(run: dict):
    server = HubServer()
    root = run["root"]
    server.add_repo("org/run", root / "run")
    server.add_repo("org/orphan", root / "orphan")
    server.add_repo("org/rewritten", root / "rewritten")
    with server:
        yield server


def open_in_fresh_python(hub: HubServer, home: Path, source: str, full: Path, revision: str = "") -> dict:
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.pop("HF_TOKEN", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(OPEN), source, revision, str(full)],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _size(folder: Path, suffix: str = ".safetensors") -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.endswith(suffix))


def _header_read(folder: Path) -> int:
    """The bytes of FOLDER's delta a host without it reads by range to learn its base: the first request's, and
    the rest of the header when it is longer."""
    file = folder / DELTA_FILE
    length = struct.unpack("<Q", file.read_bytes()[:8])[0]
    return max(first_header_read(file.stat().st_size), 8 + length)


def test_a_delta_step_in_a_hub_run_rebuilds_its_full_step_at_one_commit(hub, run, tmp_path) -> None:
    root = run["root"]
    hub.reset_counts()
    second = open_in_fresh_python(hub, tmp_path, "hf://org/run/step_2", root / "full" / "step_2")
    assert second["equal"] and second["links"] == 1 and second["kind"] == "hub" and len(second["commit"]) == 40
    # The full step and step_2's delta file, and step_2's header read by range first to learn its base.
    assert hub.sent_for(".safetensors") == _size(root / "run" / "step_1") + _size(root / "run" / "step_2") + \
        _header_read(root / "run" / "step_2")
    hub.reset_counts()
    # The same host (its Hub cache) a step later: only step_3's delta file (and its header) crosses the network;
    # step_2's header is read from this host's copy.
    third = open_in_fresh_python(hub, tmp_path, "hf://org/run/step_3", root / "full" / "step_3", second["commit"])
    assert third["equal"] and third["links"] == 2 and third["source"] == "hf://org/run/step_3"
    assert hub.sent_for(".safetensors") == _size(root / "run" / "step_3") + _header_read(root / "run" / "step_3")
    hub.reset_counts()
    # Again at the same commit (another rank, a check, a rollback): nothing crosses the network.
    again = open_in_fresh_python(hub, tmp_path, "hf://org/run/step_3", root / "full" / "step_3", second["commit"])
    assert again["equal"] and again["fetched"] == 0 and hub.sent_for(".safetensors") == 0
    full = open_in_fresh_python(hub, tmp_path, "hf://org/run/step_1", root / "full" / "step_1")
    assert full["equal"] and full["links"] == 0


def test_a_host_that_missed_two_steps_fetches_both_delta_files_at_the_same_time(hub, run, tmp_path) -> None:
    root = run["root"]
    assert open_in_fresh_python(hub, tmp_path, "hf://org/run/step_1", root / "full" / "step_1")["equal"]
    # Each delta file's download waits until the other file's has begun: fetched one after the other (a retry of
    # the same file included), they never meet.
    begun, met, cond = set(), [], threading.Condition()

    def hold(filename: str, range_header: str | None) -> None:
        if filename.endswith(f"/{DELTA_FILE}") and range_header is None:
            with cond:
                begun.add(filename)
                cond.notify_all()
                if cond.wait_for(lambda: len(begun) >= 2, timeout=20):
                    met.append(filename)

    hub.reset_counts()
    hub.before_body = hold
    try:
        third = open_in_fresh_python(hub, tmp_path, "hf://org/run/step_3", root / "full" / "step_3")
    finally:
        hub.before_body = None
    assert sorted(met) == [f"step_{n}/{DELTA_FILE}" for n in (2, 3)], met
    assert third["equal"] and third["links"] == 2
    # The two delta files, each after its header read by range; the full step kept.
    assert third["fetched"] == _size(root / "run" / "step_2") + _size(root / "run" / "step_3")
    assert hub.sent_for(".safetensors") == third["fetched"] + sum(_header_read(root / "run" / f"step_{n}")
                                                                  for n in (2, 3))


def test_a_base_missing_from_the_commit_is_one_line(hub, run, tmp_path) -> None:
    found = open_in_fresh_python(hub, tmp_path, "hf://org/orphan/step_3", run["root"] / "full" / "step_3")
    assert found["error"].startswith("hf://org/orphan/step_3: its base hf://org/orphan/step_2 is not there at "
                                     "commit "), found


def test_a_link_pushed_again_with_other_weights_is_refused(hub, run, tmp_path) -> None:
    found = open_in_fresh_python(hub, tmp_path, "hf://org/rewritten/step_3", run["root"] / "full" / "step_3")
    assert "is not the delta's base" in found["error"] and "\n" not in found["error"], found


LIST = """
import json, sys
from layerwise_cli.checkpoint.steps.hub_run import list_hub_run_steps

steps = list_hub_run_steps(sys.argv[1], None)
print(json.dumps([[s.name, s.url, s.revision, s.examine()[0]] for s in steps]))
"""


def test_watch_lists_a_hub_run_at_one_commit_and_checks_each_step_through_its_chain(hub, tmp_path) -> None:
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    found = {}
    for repo in ("run", "orphan"):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(LIST), f"hf://org/{repo}"], capture_output=True,
                              text=True, timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        found[repo] = json.loads(done.stdout.strip().splitlines()[-1])
    commit = found["run"][0][2]
    assert found["run"] == [[f"step_{n}", f"hf://org/run/step_{n}", commit, None] for n in (1, 2, 3)]
    assert [name for name, *_ in found["orphan"]] == ["step_1", "step_3"]
    assert found["orphan"][1][3].startswith("its base hf://org/orphan/step_2 is not there at commit ")
