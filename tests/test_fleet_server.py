"""All-or-nothing fleet updates (`reload --url ... --url ...`, `--atomic` by default), against three real servers.

Three `layerwise serve` servers on loopback, each started in a directory of its own (its node's disk: a relative
SOURCE resolves there): two on the demo's dense *multiply*, one on its MoE *multiply* (another architecture).
Each fault leaves every server that still answers serving the weights it had, by its answers, by every module's
fingerprint and by its weight-version tag, and the report names what each holds:

- refused at pre-flight: another architecture; a shard truncated on one node (its header says so);
- failing after the fleet's pre-flight: a shard truncated between pre-flight and reload; NaN in a node's last
  layer, refused mid-stream after the earlier layers were loaded;
- a server SIGKILLed as its reload starts.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from layerwise_cli.client.servers.events import Paused, ServerEvent
from layerwise_cli.client.servers.reload_servers import RemoteOptions, holdings, reload_servers, server_fingerprints
from layerwise_cli.demo import expected_answer
from tests.support.engine_support import nan_in_final_norm, reshard
from tests.support.server_support import RunningServer, own_core, run_cli, running_together
from tests.support.watch_support import weight_version

pytestmark = pytest.mark.server

PAIRS = [(3, 4), (2, 5)]
STEP = "step_next"  # the relative SOURCE every node resolves on its own disk


def expected(name: str) -> list[str]:
    return [expected_answer(name, a, b) for a, b in PAIRS]


@pytest.fixture(scope="module")
def fleet(demo_models, tmp_path_factory):
    """(dense 1, dense 2, moe): three servers, each with its own working directory."""
    nodes = [tmp_path_factory.mktemp(f"node{i}") for i in range(3)]
    with running_together([RunningServer(demo_models[model], cwd=node, env=own_core(i), start_timeout=600)
                           for i, (model, node) in enumerate(zip(("multiply", "multiply", "moe-multiply"), nodes))]
                          ) as servers:
        yield servers


def write_step(demo_models, fleet, *, broken: dict | None = None) -> None:
    """STEP on every node: *add* of its architecture, in two shards; BROKEN maps a server's index to an edit."""
    for index, server in enumerate(fleet):
        target = server.cwd / STEP
        shutil.rmtree(target, ignore_errors=True)
        model = "add" if index < 2 else "moe-add"
        transform = (broken or {}).get(index)
        reshard(demo_models[model], target, lambda name: "a" if ".layers.0." in name else "b",
                transform=transform if callable(transform) else None)
        if transform == "truncate":
            truncate_last_shard(target)


def truncate_last_shard(step) -> None:
    shard = sorted(step.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1024])


def snapshot(fleet) -> list[tuple]:
    """What each server holds: its answers, every module's fingerprint, its tag; and that it is not paused."""
    return [(server.answers(PAIRS), server_fingerprints(server.url), weight_version(server.url), server.is_paused())
            for server in fleet]


def assert_unchanged(before: list[tuple], fleet) -> None:
    after = snapshot(fleet)
    for server, was, now in zip(fleet, before, after):
        assert now[0] == was[0] == expected("multiply"), server.url
        assert now[1] == was[1], f"{server.url}: fingerprints differ from before the failed update"
        assert now[2] == was[2], server.url
        assert now[3] is False, f"{server.url} still paused"


def reload_json(fleet, source: str, *extra: str) -> tuple[int, dict]:
    urls = [arg for server in fleet for arg in ("--url", server.url)]
    done = run_cli("reload", "--weights-path", source, *urls, "--weight-version", "v-next", "--json", *extra)
    return done.returncode, json.loads(done.stdout)


def test_a_server_of_another_architecture_is_refused_at_pre_flight_and_none_changes(fleet, demo_models):
    before = snapshot(fleet)
    code, report = reload_json(fleet, str(demo_models["add"]))
    assert code == 1 and report["atomic"] is True
    dense1, dense2, moe = report["servers"]
    assert moe["stage"] == "preflight" and "pre-flight failed" in moe["error"]
    for server in (dense1, dense2):
        assert server["left_alone"] and server["stage"] == "preflight" and server["holds"] == "previous"
        assert moe["url"] in server["error"] and server["paused_s"] == 0.0
    assert all(line.endswith("(weight version 'default')") for line in report["holdings"])
    assert_unchanged(before, fleet)


def test_a_shard_truncated_on_one_node_is_refused_at_pre_flight(fleet, demo_models):
    write_step(demo_models, fleet, broken={1: "truncate"})
    before = snapshot(fleet)
    code, report = reload_json(fleet, STEP)
    assert code == 1
    _, dense2, _ = report["servers"]
    assert dense2["stage"] == "preflight" and "truncated file?" in dense2["error"], dense2["error"]
    assert "model-00002-of-00002.safetensors" in dense2["error"]
    assert [s["left_alone"] for s in report["servers"]] == [True, False, True]
    assert_unchanged(before, fleet)


def test_nan_in_a_last_layer_fails_mid_stream_and_the_servers_that_changed_are_reloaded_back(fleet, demo_models):
    write_step(demo_models, fleet, broken={2: nan_in_final_norm})
    before = snapshot(fleet)
    code, report = reload_json(fleet, STEP)
    assert code == 1
    dense1, dense2, moe = report["servers"]
    assert moe["stage"] == "reload" and "NaN" in moe["error"] and moe["rolled_back"]
    for server in (dense1, dense2):
        # Each took the step whole, then went back to what it held, under its previous tag.
        assert server["report"] is not None and server["reloaded_back"] and server["stage"] == "back"
        assert server["holds"] == "previous" and server["version_after"] == "default"
        assert moe["url"] in server["error"]
    assert [line.split(": ", 1)[1] for line in report["holdings"][:2]] == \
        ["reloaded back: holds its previous weights (weight version 'default')"] * 2
    assert_unchanged(before, fleet)


def test_a_shard_truncated_after_pre_flight_fails_its_server_and_the_others_go_back(fleet, demo_models):
    write_step(demo_models, fleet)
    before = snapshot(fleet)
    truncated = threading.Event()

    def on_event(event: ServerEvent) -> None:
        # The trainer's copy on the first node is cut short between the fleet's pre-flight and its reload.
        if event.url == fleet[0].url and isinstance(event, Paused) and not truncated.is_set():
            truncate_last_shard(fleet[0].cwd / STEP)
            truncated.set()

    results = reload_servers([s.url for s in fleet], STEP, RemoteOptions(weight_version="v-next"), on_event)
    assert truncated.is_set()
    first, *others = results
    assert not first.ok and first.stage == "reload" and first.holds == "previous"
    for result in others:
        assert result.reloaded_back and result.holds == "previous" and result.version_after == "default"
    assert_unchanged(before, fleet)


def test_a_server_whose_previous_step_was_deleted_is_updated_and_named_when_it_cannot_go_back(fleet, demo_models):
    """A trainer deletes old steps, the one a server holds included: the update goes on, with a warning; if it
    must be undone, that server keeps the new weights and the report says so (refusing would stall the fleet)."""
    write_step(demo_models, fleet)  # add on every node
    held = "step_held"
    for server in fleet:
        shutil.rmtree(server.cwd / held, ignore_errors=True)
        (server.cwd / STEP).rename(server.cwd / held)
    assert all(r.ok for r in reload_servers([s.url for s in fleet], held, RemoteOptions(weight_version=held)))
    shutil.rmtree(fleet[0].cwd / held)  # the first node's trainer deleted it
    for index, server in enumerate(fleet):  # the next step: multiply, with NaN in the MoE node's last layer
        model = "multiply" if index < 2 else "moe-multiply"
        reshard(demo_models[model], server.cwd / STEP, lambda name: "a" if ".layers.0." in name else "b",
                transform=nan_in_final_norm if index == 2 else None)
    try:
        results = reload_servers([s.url for s in fleet], STEP, RemoteOptions(weight_version="v-next"))
        first, second, moe = results
        assert any("could not be reloaded back" in w and held in w for w in first.warnings), first.warnings
        assert not moe.ok and moe.stage == "reload"
        assert second.reloaded_back and weight_version(fleet[1].url) == held
        assert fleet[1].answers(PAIRS) == expected("add")
        # The first could not go back: it holds the step, says so, and its tag names it.
        assert not first.reloaded_back and first.holds == "new" and "reloading it back failed" in first.error
        assert fleet[0].answers(PAIRS) == expected("multiply") and weight_version(fleet[0].url) == "v-next"
        assert holdings(results, STEP)[0] == f"{fleet[0].url}: holds {STEP} (weight version 'v-next')"
    finally:
        # Every server back on the model it started on, for the next test.
        sources = [str(demo_models[m]) for m in ("multiply", "multiply", "moe-multiply")]
        for server, source in zip(fleet, sources):
            assert reload_servers([server.url], source, RemoteOptions(weight_version="default"))[0].ok


def test_a_server_killed_mid_reload_leaves_the_others_on_their_previous_weights(fleet, demo_models):
    write_step(demo_models, fleet)
    before = snapshot(fleet)[:2]
    victim = fleet[2]
    killed = threading.Event()

    def on_event(event: ServerEvent) -> None:
        if event.url == victim.url and isinstance(event, Paused) and not killed.is_set():
            killed.set()
            # Killed (its process group reaped) in its own fleet thread, between its pause and its reload
            # request, while the two others reload: its reload fails whatever the machine's load. A timer 20 ms
            # later, as before, fired once after a loaded machine had finished that reload.
            victim.kill()

    results = reload_servers([s.url for s in fleet], STEP, RemoteOptions(weight_version="v-next"), on_event)
    assert killed.is_set() and not victim.alive()
    *survivors, dead = results
    assert not dead.ok and not dead.answering
    for result in survivors:
        assert result.reloaded_back and result.holds == "previous", result.error
    assert all("reloaded back" in line for line in holdings(results, STEP)[:2])
    assert_unchanged(before, fleet[:2])
