"""One commit per fleet update from the Hub (`reload --url A --url B --weights-path org/step`), for real.

Two `layerwise serve` servers on the demo's dense *multiply*, each with its own Hub cache (`HF_HOME`, as on two
nodes), read a loopback Hub (`tests/support/hub_server.py`) whose `main` is moved in the middle of each
operation, once the client has pinned it. Each server must end on the commit `main` named when the command
started, the JSON must name it, and a later failed reload must put each server back on exactly that commit,
not on what `main` names by then: by its own rollback (NaN on both nodes), and by the fleet reloading back a
server that had loaded the new commit while the other node refused it (a corrupted copy in that node's cache).
A commit that vanished after the client pinned it fails pre-flight in one line naming repo and commit, and
leaves both servers as they were.

`watch org/step` on the same two servers (one module: one pair of server starts): `--once --no-atomic` brings
each to the commit `main` names; a running watch brings both to each commit pushed to `main`, and skips, with
an event, a commit force-pushed away while the servers fetch it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from layerwise_cli.demo import expected_answer
from tests.support.engine_support import nan_in_final_norm, reshard
from tests.support.hub_server import HubServer, once_named
from tests.support.server_support import RunningServer, own_core, run_cli, running_together
from tests.support.watch_support import WatchProcess, weight_version

pytestmark = pytest.mark.server

PAIRS = [(3, 4), (2, 5)]
REPO = "org/step"


def expected(name: str) -> list[str]:
    return [expected_answer(name, a, b) for a, b in PAIRS]


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        yield server


@pytest.fixture(scope="module")
def fleet(demo_models, hub, tmp_path_factory):
    """Two servers on *multiply*, each with a Hub cache of its own, both reading the loopback Hub."""
    nodes = [tmp_path_factory.mktemp(f"hub-node{i}") for i in range(2)]
    with running_together([RunningServer(demo_models["multiply"], cwd=node, start_timeout=600,
                                         env={**own_core(i), "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(node / "hf")})
                           for i, node in enumerate(nodes)]) as servers:
        yield servers


@pytest.fixture(scope="module")
def folders(demo_models, tmp_path_factory) -> dict:
    """The commits' contents: *add* (the step), *multiply* (what the servers start on), both in two shards, and
    each of those with NaN in its last layer."""
    root = tmp_path_factory.mktemp("hub-commits")

    def two_shards(model: str, name: str, transform=None):
        return reshard(demo_models[model], root / name, lambda t: "a" if ".layers.0." in t else "b",
                       transform=transform)

    return {"add": demo_models["add"], "multiply": demo_models["multiply"],
            "nan": two_shards("add", "nan", nan_in_final_norm), "multiply2": two_shards("multiply", "multiply2"),
            "multiply2-nan": two_shards("multiply", "multiply2-nan", nan_in_final_norm)}


def reload_json(fleet, hub: HubServer, *extra: str) -> tuple[int, dict, str]:
    urls = [arg for server in fleet for arg in ("--url", server.url)]
    done = run_cli("reload", "--weights-path", REPO, *urls, "--json", *extra, env={"HF_ENDPOINT": hub.endpoint})
    return done.returncode, json.loads(done.stdout), done.stderr


def test_main_moved_while_the_servers_pre_flight_changes_nothing_and_a_rollback_goes_to_that_commit(
        fleet, hub, folders):
    start = hub.add_repo(REPO, folders["add"])
    # As the first server reads the pinned commit, `main` moves to the weights the servers already hold.
    once_named(hub, start, lambda: hub.move_ref(REPO, "main", folders["multiply"]))
    code, report, stderr = reload_json(fleet, hub, "--weight-version", "v-add")
    assert code == 0, stderr[-3000:]
    assert hub.resolve(REPO, "main").commit != start  # it did move, mid-operation
    assert report["commit"] == start and report["source"] == REPO
    for server, result in zip(fleet, report["servers"]):
        assert result["ok"] and result["report"]["commit"] == start, result
        assert server.answers(PAIRS) == expected("add"), server.url
    # Pre-flight and reload on both nodes named the commit, never the branch, after the client's one pin.
    named_main = [r.path for r in hub.requests if "/main" in r.path]
    assert len(named_main) == 1 and named_main[0].endswith("/resolve/main/config.json"), named_main

    # A commit whose last layer holds NaN: both servers refuse it mid-stream and roll back. `main` moves again
    # (to *multiply*) as they read it; the rollback must load what each holds, `start`, not what `main` names.
    bad = hub.move_ref(REPO, "main", folders["nan"])
    once_named(hub, bad, lambda: hub.move_ref(REPO, "main", folders["multiply"]))
    code, report, stderr = reload_json(fleet, hub, "--weight-version", "v-nan")
    assert code == 1 and report["commit"] == bad, stderr[-3000:]
    for server, result in zip(fleet, report["servers"]):
        assert not result["ok"] and "NaN" in result["error"], result
        assert f"rolled back to the weights of {REPO}@{start}" in result["error"] and result["rolled_back"], result
        assert server.answers(PAIRS) == expected("add"), server.url
        assert weight_version(server.url) == "v-add" and not server.is_paused()


def test_a_commit_that_vanished_after_the_pin_fails_pre_flight_in_one_line(fleet, hub, folders):
    before = [(server.answers(PAIRS), weight_version(server.url)) for server in fleet]
    gone = hub.move_ref(REPO, "main", folders["multiply"])
    once_named(hub, gone, lambda: hub.forget_commit(REPO, gone))
    code, report, stderr = reload_json(fleet, hub, "--weight-version", "v-gone")
    assert code == 1 and report["commit"] == gone, stderr[-3000:]
    for result in report["servers"]:
        assert result["stage"] == "preflight" and not result["ok"], result
    errors = [r["error"] for r in report["servers"] if "pre-flight failed" in r["error"]]
    assert errors and all(f"{REPO}@{gone}" in e and "no longer on the Hub" in e for e in errors), errors
    assert all("\n" not in r["error"] for r in report["servers"])
    assert [(server.answers(PAIRS), weight_version(server.url)) for server in fleet] == before


def test_a_node_that_fails_the_update_and_one_that_goes_back_both_end_on_the_commit_they_held(fleet, hub, folders):
    """The second node's Hub cache holds the new commit with NaN in its last layer (a corrupted copy on that node
    alone): that server refuses it mid-stream and rolls back, the first, which loaded it, is reloaded back by
    the fleet (`PreflightAnswer.loaded_revision`). `main` moved in the middle: both go back to the commit they
    held, by their answers and their tag, not to what `main` names.
    """
    held = hub.move_ref(REPO, "main", folders["add"])
    code, report, stderr = reload_json(fleet, hub, "--weight-version", "v-held")
    assert code == 0 and report["commit"] == held, stderr[-3000:]
    new = hub.move_ref(REPO, "main", folders["multiply2"])
    snapshot = fleet[1].cwd / "hf" / "hub" / "models--org--step" / "snapshots" / new
    shutil.copytree(folders["multiply2-nan"], snapshot)
    once_named(hub, new, lambda: hub.move_ref(REPO, "main", folders["multiply"]))
    code, report, stderr = reload_json(fleet, hub, "--weight-version", "v-new")
    assert code == 1 and report["commit"] == new, stderr[-3000:]
    first, second = report["servers"]
    assert "NaN" in second["error"] and second["rolled_back"], second
    assert f"rolled back to the weights of {REPO}@{held}" in second["error"], second["error"]
    assert first["report"]["commit"] == new and first["reloaded_back"] and first["holds"] == "previous", first
    for server in fleet:
        assert server.answers(PAIRS) == expected("add"), server.url
        assert weight_version(server.url) == "v-held" and not server.is_paused()


def test_watch_brings_both_servers_to_each_commit_of_main_and_skips_one_that_vanished(fleet, hub, folders):
    urls = [arg for server in fleet for arg in ("--url", server.url)]
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": os.environ["HF_HOME"]}
    hub.on_request = None
    first = hub.move_ref(REPO, "main", folders["multiply"])
    # Each server on its own (--no-atomic): each is pre-flighted (the commit fetched) before its own pause.
    done = run_cli("watch", REPO, *urls, "--once", "--no-atomic", "--json", "--interval", "0.2", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert {e["server"] for e in events if e["event"] == "reload_done" and e["step"] == first} == \
        {server.url for server in fleet}, events
    for server in fleet:
        assert weight_version(server.url) == first and server.answers(PAIRS) == expected("multiply"), server.url

    watch = WatchProcess(REPO, *urls, "--interval", "0.2", env=env)
    try:
        watch.wait_for("step_complete", step=first)
        pushed = hub.move_ref(REPO, "main", folders["add"])
        for server in fleet:
            event = watch.wait_for("reload_done", timeout=300, server=server.url, step=pushed)
            assert event["version"] == pushed
        for server in fleet:
            assert weight_version(server.url) == pushed and server.answers(PAIRS) == expected("add"), server.url

        # Force-pushed away as the first server's pre-flight reads it: skipped with an event, and the commit
        # pushed in its place is loaded.
        gone = hub.move_ref(REPO, "main", folders["multiply2"])
        after: list[str] = []
        once_named(hub, gone, lambda: (hub.forget_commit(REPO, gone),
                                       after.append(hub.move_ref(REPO, "main", folders["multiply"]))))
        skipped = watch.wait_for("step_skipped", timeout=300, step=gone)
        assert skipped["message"].startswith(f"vanished: {REPO}@{gone}: this commit is no longer on the Hub")
        for server in fleet:
            watch.wait_for("reload_done", timeout=300, server=server.url, step=after[0])
        assert not watch.of("reload_done", step=gone) and watch.of("reload_failed", step=gone)
        assert not watch.of("reload_started", step=first)  # both held what main named when it started
        for server in fleet:
            assert weight_version(server.url) == after[0] and server.answers(PAIRS) == expected("multiply")
            assert not server.is_paused()
    finally:
        code = watch.finish(signal.SIGTERM)
        hub.on_request = None
    assert code == 0, watch.stderr[-3000:]
