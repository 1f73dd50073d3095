"""`layerwise watch` against two real vLLM servers on loopback while a test trainer writes steps and clients generate.

One pair of servers (plus one restart, after a crash) carries the whole proof, in one timeline: the trainer
alternates the demo's *add* and *multiply* weights, writes some steps slowly (shards appear over seconds; the index
first, or the marker last), writes one broken step, deletes old steps itself, deletes a step the moment it is
loaded; one server is killed and restarted; the watcher is stopped and started again; client threads send greedy
requests to both servers the whole time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
from typer.testing import CliRunner

import layerwise_cli as layerwise
from layerwise_cli.cli.app import app
from layerwise_cli.client.engine.in_process import EngineOptions
from layerwise_cli.client.watch.entry import WatchOptions, server_targets
from layerwise_cli.client.watch.targets import EngineTarget
from layerwise_cli.demo import demo_prompt
from tests.support.engine_support import parameter_kind, reshard
from tests.support.in_process import start_here, stop_here
from tests.support.server_support import (
    LAYERWISE,
    ROOT,
    RunningServer,
    error_lines,
    free_port,
    own_core,
    running_together,
    start,
)
from tests.support.watch_support import (
    ENV,
    MARKER,
    PAIRS,
    Clients,
    Trainer,
    WatchProcess,
    answer,
    held_at,
    log,
    wait_until,
    weight_version,
)

# Short polls: the whole timeline takes seconds, apart from the servers' start.
FAST = ["--interval", "0.2"]


@pytest.fixture(scope="module")
def sources(demo_models, tmp_path_factory):
    """add, multiply and a broken multiply (one tensor of the wrong shape), each in several shards."""
    base = tmp_path_factory.mktemp("watch-sources")

    def broken(tensors: dict) -> dict:
        name = next(n for n in sorted(tensors) if n.endswith("norm.weight"))
        tensors[name] = tensors[name][:-1].clone()
        return tensors

    return {"add": reshard(demo_models["add"], base / "add", parameter_kind),
            "multiply": reshard(demo_models["multiply"], base / "multiply", parameter_kind),
            "broken": reshard(demo_models["multiply"], base / "broken", parameter_kind, transform=broken)}


# A server restarted beside another under steady traffic is healthy within this (issue 60).
RESTART_DEADLINE_S = 120

@pytest.fixture(scope="module")
def servers(demo_models):
    """Two `layerwise serve` servers on *multiply*, started at once (INFO logs: a failure says where it stopped).

    Each worker in a process of its own (the CPU backend's layout), on a core of its own (see own_core): a server
    restarted beside a busy one is started on the cores the other's worker does not hold."""
    with running_together([RunningServer(demo_models["multiply"], env={"VLLM_LOGGING_LEVEL": "INFO", **own_core(i)},
                                         start_timeout=600, worker_process=True) for i in range(2)]) as pair:
        yield pair



def arrive_together(trainer: Trainer, staging, names_models: list[tuple[str, str]]) -> None:
    """Write steps elsewhere, then rename them into ROOT back to back (atomic renames, as save_checkpoint does)."""
    staged = Trainer(staging, trainer.sources)
    for name, model in names_models:
        staged.write(name, model)
    for name, _ in names_models:
        os.rename(staging / name, trainer.root / name)
        trainer.completed_at[name] = time.time()
        trainer.model_of[name] = staged.model_of[name]


@pytest.mark.server
def test_watch_keeps_two_servers_on_the_newest_complete_step(servers, sources, tmp_path):
    a, b = servers
    root, staging = tmp_path / "run", tmp_path / "staging"
    root.mkdir()
    staging.mkdir()
    log_path = tmp_path / "watch.jsonl"
    trainer = Trainer(root, sources)
    urls = ["--url", a.url, "--url", b.url]
    try:
        with Clients([a, b]) as clients:
            # --- watcher 1: --marker auto ------------------------------------------------------------------
            watch = WatchProcess(str(root), *urls, *FAST, "--settle", "0.5", "--keep", "2", "--log", str(log_path))
            try:
                for server in (a, b):  # seen, or back after a first probe that timed out on a loaded machine
                    watch.wait_for(("server_seen", "server_back"), server=server.url)
                # A fast step; then a slow one whose index comes first (its shards are half-written for a while),
                # and a broken one.
                trainer.write("step_1", "add")
                for server in (a, b):
                    watch.wait_for("reload_done", step="step_1", server=server.url)
                trainer.write("step_2", "multiply", delay=0.2, index_first=True)
                trainer.write("step_3", "broken")
                watch.wait_for("step_skipped", step="step_3")
                # Two steps at once: step_4 is passed over for step_5. The trainer deletes its old steps itself.
                arrive_together(trainer, staging, [("step_4", "add"), ("step_5", "multiply")])
                trainer.delete_older_than(2)
                for server in (a, b):
                    watch.wait_for("reload_done", step="step_5", server=server.url)

                # b crashes (its whole process group SIGKILLed); a moves on alone; b, restarted on its base
                # weights, is brought to the newest step.
                clients.pause(b)
                log(f"killing b; removed {len(b.kill())} shared-memory segments it left")
                trainer.write("step_6", "add")
                watch.wait_for("reload_done", step="step_6", server=a.url)
                watch.wait_for("server_down", server=b.url)
                # Beside a under its steady traffic (a request every THINK_S): before the test servers shared the
                # run's session, this restart took 2 to 5 minutes and a's traffic was slowed for it; now about
                # 28 s here alone and 48 s beside two other test files (2026-12-07).
                began = time.monotonic()
                start(b)
                restarted_s = time.monotonic() - began
                log(f"b restarted in {restarted_s:.0f} s")
                # Issue 60's bound for a server restarted beside a busy one on this host: healthy within 2 minutes
                # (a deadline, not a speed figure: 28 to 48 s measured, and 10+ minutes before the fix).
                assert restarted_s <= RESTART_DEADLINE_S, (
                    f"b took {restarted_s:.0f} s to restart beside a (over {RESTART_DEADLINE_S} s):\n{b.log_tail()}")
                # Both start lines of b (its first start and this one) and a's name the cores they took.
                lines = [server.start_lines() for server in (a, b)]
                assert [len(found) for found in lines] == [1, 2], lines
                assert all("CPU cores" in line for found in lines for line in found), lines
                clients.resume(b)
                watch.wait_for("server_back", server=b.url)
                watch.wait_for("reload_done", step="step_6", server=b.url)

                # SIGTERM during a reload: it finishes (or is abandoned) cleanly, nothing stays paused, exit 0.
                trainer.write("step_7", "multiply")
                watch.wait_for("reload_started", step="step_7")
            finally:
                code = watch.finish(signal.SIGTERM)
            log(f"watcher 1 ended ({code})")
            assert code == 0, watch.stderr
            assert not a.is_paused() and not b.is_paused()
            before_restart = {s.url: weight_version(s.url) for s in (a, b)}
            assert set(before_restart.values()) <= {"step_6", "step_7"}

            # --- watcher 2, restarted with the marker: servers already on step_7 are not reloaded; a step
            # written slowly is loaded only once its marker (written last) is there.
            again = WatchProcess(str(root), *urls, "--marker", MARKER, *FAST, "--keep", "2", "--log", str(log_path))
            try:
                for server in (a, b):
                    wait_until(lambda s=server: weight_version(s.url) == "step_7", 60, f"{server.url} on step_7")
                trainer.write("step_8", "add", delay=0.2)
                for server in (a, b):
                    again.wait_for("reload_done", step="step_8", server=server.url)
                # The trainer deletes step_9 the moment a server starts loading it, then writes step_10.
                trainer.write("step_9", "multiply")
                again.wait_for("reload_started", step="step_9", timeout=60)
                shutil.rmtree(root / "step_9")
                trainer.write("step_10", "add")
                for server in (a, b):
                    again.wait_for("reload_done", step="step_10", server=server.url)
            finally:
                assert again.finish(signal.SIGINT) == 0, again.stderr
    except BaseException:
        for server in (a, b):
            log(f"--- {server.url} (alive: {server.alive()}), its log's last lines:\n{server.log_tail(30)}\n"
                f"--- its errors:\n{error_lines(server, 20)}")
        raise
    current = [url for url, version in before_restart.items() if version == "step_7"]
    assert not [e for e in again.of("reload_started", step="step_7") if e["server"] in current], again.events

    # --- --once, restarted again: everything is current, nothing is reloaded, exit 0.
    once = subprocess.run([LAYERWISE, "watch", str(root), *urls, "--once", "--settle", "0.2", *FAST, "--json"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert once.returncode == 0, once.stderr
    assert not [line for line in once.stdout.splitlines() if '"reload_started"' in line]

    # --- what the whole run proves ------------------------------------------------------------------------
    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    for e in events:  # the timeline, shown when the test fails
        if e["event"].startswith("reload_") or e["event"].startswith("server_"):
            log(f"{e['time']:.2f} {e['event']} {e.get('step', '')} {e['server']} wall={e.get('wall_s')} "
                f"paused={e.get('paused_s')} {e.get('message', '')}")
    assert not clients.failures, clients.failures[:5]
    assert len(clients.answers) > 20
    assert not clients.wrong(), clients.wrong()[:5]
    # Every reload was of a complete step: it started after the trainer's last write.
    for e in [e for e in events if e["event"] == "reload_started"]:
        assert e["time"] >= trainer.completed_at[e["step"]], e
    # The broken step was reported (once) and skipped; no other reload failed except of the step deleted.
    skipped_broken = [e for e in events if e["event"] == "step_skipped" and "broken" in e.get("message", "")]
    assert [e["step"] for e in skipped_broken] == ["step_3"]
    assert {e["step"] for e in events if e["event"] == "reload_done"} <= set(trainer.completed_at) - {"step_3"}
    failed = [e for e in events if e["event"] == "reload_failed" and e["step"] != "step_3"]
    assert all(e["step"] == "step_9" and "deleted" in e["message"] for e in failed), failed
    # step_4 came with step_5: passed over.
    assert "step_4" in {e["step"] for e in events if e["event"] == "step_skipped"}
    # The killed server was seen down, came back on its base weights, and was brought to the newest step.
    assert [e["version"] for e in watch.of("server_back", server=b.url)] == ["default"]
    assert watch.of("server_down", server=b.url) and not watch.of("server_down", server=a.url)
    # step_9, deleted while loading: each server either got it first or failed and kept what it had.
    for server in (a, b):
        ends = [e for e in events if e.get("step") == "step_9" and e.get("server") == server.url
                and e["event"] in ("reload_done", "reload_failed")]
        assert all(e["event"] == "reload_done" or "deleted" in e["message"] for e in ends), ends
    # Both servers end on the newest step, answering with its weights, not paused.
    for server in (a, b):
        assert weight_version(server.url) == "step_10"
        assert server.answers([(3, 4), (9, 9)]) == [answer("add", 3, 4), answer("add", 9, 9)]
        assert not server.is_paused()
    # --keep never deleted a step a server held or was loading (by the log of both watchers).
    by_watch = [e for e in events if e["event"] == "step_deleted" and e.get("by") == "watch"]
    assert by_watch, "--keep 2 deleted nothing"
    for e in by_watch:
        for server in (a, b):
            assert e["step"] not in held_at(events, server.url, e["time"]), (e, server.url)
    # The log carries each server's full report; --json leaves it out.
    done = [e for e in events if e["event"] == "reload_done"]
    assert all(e["report"]["report"]["wall_s"] > 0 for e in done)
    assert all("report" not in e for e in watch.events)


def test_watch_usage_errors(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["watch", str(tmp_path / "nope"), "--url", "http://127.0.0.1:9"])
    assert missing.exit_code == 1 and "nope" in missing.output and "no such directory" in missing.output
    no_url = runner.invoke(app, ["watch", str(tmp_path)])
    assert no_url.exit_code == 2 and "--url" in no_url.output
    twice = runner.invoke(app, ["watch", str(tmp_path), "--url", "http://127.0.0.1:9", "--url",
                                "http://127.0.0.1:9"])
    assert twice.exit_code == 2 and "twice" in twice.output
    bad_mode = runner.invoke(app, ["watch", str(tmp_path), "--url", "http://127.0.0.1:9", "--pause-mode", "x"])
    assert bad_mode.exit_code == 2
    bad_keep = runner.invoke(app, ["watch", str(tmp_path), "--url", "http://127.0.0.1:9", "--keep", "0"])
    assert bad_keep.exit_code == 2


def test_watch_passes_allow_unchecked_to_every_target():
    """`--allow-unchecked` reaches each server's verify (RemoteOptions) and an in-process engine's."""
    for accept in (False, True):
        for verify in (False, True):  # without --verify it keeps a reload vLLM could not complete
            options = WatchOptions(verify=verify, allow_unchecked=accept)
            (target,) = server_targets(["http://127.0.0.1:9"], options)
            assert target.options.verify is verify and target.options.reload.allow_unchecked is accept
            engine = EngineTarget(object(), verify=verify, options=options.reload_options())
            assert engine.options.allow_unchecked is accept


def test_watch_once_without_a_server_exits_1(tmp_path):
    """--once against a port nothing listens on: retried, then one error line naming the server, exit 1."""
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / MARKER).touch()
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([LAYERWISE, "watch", str(tmp_path), "--url", url, "--once", "--marker", MARKER,
                           "--interval", "0.1"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and url in errors[0] and "connect" in errors[0], done.stderr
    # Not a terminal: one line per event on stderr.
    assert f"server down {url}" in done.stderr and "step seen step_1" in done.stderr


@pytest.mark.engine
def test_python_api_keeps_an_in_process_engine_on_the_newest_step(demo_models, sources, tmp_path):
    """`layerwise_cli.watch(root, llm=...)`: the broken newest step is skipped, the engine takes the one before."""
    from vllm import SamplingParams  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    root = tmp_path / "run"
    root.mkdir()
    trainer = Trainer(root, sources)
    trainer.write("step_1", "add")
    trainer.write("step_2", "broken")
    # In this process (start_here: about 3 s, where processes of its own took 30 s or more here).
    llm = start_here(str(demo_models["multiply"]), EngineOptions(max_model_len=64))
    try:
        events = list(layerwise.watch(root, llm=llm, marker=MARKER, interval=0.1, once=True))
        outputs = llm.generate([demo_prompt(a, b) for a, b in PAIRS], SamplingParams(temperature=0.0, max_tokens=4),
                               use_tqdm=False)
        assert [o.outputs[0].text.strip() for o in outputs] == [answer("add", a, b) for a, b in PAIRS]
        assert llm.get_weight_version() == "step_1"
        assert [(e.kind, e.step) for e in events if e.kind in ("reload_done", "step_skipped")] == [
            ("step_skipped", "step_2"), ("reload_done", "step_1")]
        assert all(isinstance(e, layerwise.WatchEvent) for e in events)
        # Restarted, it keeps step_1 (a new watcher tries the broken step once more: it fails before touching).
        again = list(layerwise.watch(root, llm=llm, marker=MARKER, interval=0.1, once=True))
        assert not [e for e in again if e.kind == "reload_started" and e.step == "step_1"]
        assert llm.get_weight_version() == "step_1"
    finally:
        stop_here(llm)
