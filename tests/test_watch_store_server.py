"""`layerwise watch s3://bucket/run/` for real: two `layerwise serve` servers kept on the newest step in SeaweedFS.

One server starts on the demo's *multiply*, the other on *add*: each is a fresh engine, and its fingerprints
(every module's) and answers are what a fresh engine on that model holds. The test trainer uploads steps into
the bucket one after another (several shards and an index each); the watcher (a subprocess, the store's
credentials in its environment and in the servers') must:

- load step_1 (*add*) and step_3 (*multiply*) into both servers, all or nothing, each equal to the fresh engine
  on that model by fingerprints and answers;
- never load step_2, whose index names a shard that is not there;
- roll back step_4 (*add* with a NaN in its final norm, found after every other layer was loaded), report it
  once as broken, leave both servers on step_3, and go on to step_5 (*add*);
- fetch each step in the servers' pre-flight, into their store cache, so that the reloads fetch nothing.
"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from layerwise_cli.client.servers.reload_servers import server_fingerprints
from tests.support.engine_support import nan_in_final_norm, parameter_kind, reshard
from tests.support.seaweed import BUCKET, SeaweedS3, running_seaweed
from tests.support.server_support import LAYERWISE, ROOT, RunningServer, error_lines, own_core, running_together
from tests.support.watch_support import ENV, WatchProcess, answer, log, weight_version

pytestmark = pytest.mark.server

PAIRS = [(3, 4), (2, 5), (7, 1)]
RUN = "run"


@pytest.fixture(scope="module")
def sources(demo_models, tmp_path_factory):
    """add, multiply and add with a NaN in its final norm, each in several shards with an index."""
    base = tmp_path_factory.mktemp("watch-store-sources")
    return {"add": reshard(demo_models["add"], base / "add", parameter_kind),
            "multiply": reshard(demo_models["multiply"], base / "multiply", parameter_kind),
            "nan": reshard(demo_models["add"], base / "nan", parameter_kind, transform=nan_in_final_norm)}


@pytest.fixture(scope="module")
def s3():
    with running_seaweed() as server:
        yield server


@pytest.fixture(scope="module")
def servers(demo_models, s3):
    """Two `layerwise serve` servers, fresh on *multiply* and on *add*, reading the store with its credentials."""
    with running_together([RunningServer(demo_models[model], env={**s3.env(), **own_core(i)}, start_timeout=600)
                           for i, model in enumerate(("multiply", "add"))]) as pair:
        yield pair


def upload(s3: SeaweedS3, step: str, folder, *, leave_out: str | None = None) -> None:
    """Put FOLDER's files under RUN/STEP, shards first and the index after them (as `put_folder` sorts them)."""
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    store = s3.objects(f"{RUN}/{step}")
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != leave_out:
            obstore.put(store, path.name, path.read_bytes())
    log(f"uploaded {step}")


def held(server) -> tuple:
    """What SERVER holds: every module's fingerprint, its answers, its weight version."""
    return server_fingerprints(server.url), server.answers(PAIRS), weight_version(server.url)


def test_watch_keeps_two_servers_on_the_newest_complete_step_in_a_bucket(servers, sources, s3, tmp_path):
    a, b = servers
    log_path = tmp_path / "watch.jsonl"
    fresh = {"multiply": held(a)[:2], "add": held(b)[:2]}
    assert fresh["multiply"][1] == [answer("multiply", x, y) for x, y in PAIRS]
    assert fresh["add"][1] == [answer("add", x, y) for x, y in PAIRS]
    watch = WatchProcess(f"s3://{BUCKET}/{RUN}/", "--url", a.url, "--url", b.url, "--interval", "0.2",
                         "--settle", "0.5", "--log", str(log_path), env=s3.env())
    try:
        for server in (a, b):
            watch.wait_for(("server_seen", "server_back"), server=server.url)
        upload(s3, "step_1", sources["add"])
        for server in (a, b):
            watch.wait_for("reload_done", step="step_1", server=server.url)
            assert held(server) == (*fresh["add"], "step_1")
        # step_2: its index names a shard that never arrives. step_3 comes after it, complete.
        shards = sorted(p.name for p in sources["multiply"].glob("*.safetensors"))
        upload(s3, "step_2", sources["multiply"], leave_out=shards[-1])
        watch.wait_for("step_seen", step="step_2")
        upload(s3, "step_3", sources["multiply"])
        for server in (a, b):
            watch.wait_for("reload_done", step="step_3", server=server.url)
            assert held(server) == (*fresh["multiply"], "step_3")
        # step_4: NaN in the final norm, the last layer loaded: rolled back (read at step_3's pin), reported once.
        upload(s3, "step_4", sources["nan"])
        skipped = watch.wait_for("step_skipped", step="step_4")
        assert "broken" in skipped["message"] and "NaN" in skipped["message"], skipped
        for server in (a, b):
            assert held(server) == (*fresh["multiply"], "step_3")
            assert not server.is_paused()
        upload(s3, "step_5", sources["add"])
        for server in (a, b):
            watch.wait_for("reload_done", step="step_5", server=server.url)
            assert held(server) == (*fresh["add"], "step_5")
    except BaseException:
        for server in (a, b):
            log(f"--- {server.url} (alive: {server.alive()}), its errors:\n{error_lines(server, 20)}")
        raise
    finally:
        code = watch.finish(signal.SIGTERM)
    assert code == 0, watch.stderr
    events = watch.events
    assert not [e for e in events if e.get("step") == "step_2" and e["event"] in ("reload_started", "step_complete")]
    assert [e["step"] for e in events if e["event"] == "step_skipped" and "broken" in e.get("message", "")] == [
        "step_4"]
    failed = [e for e in events if e["event"] == "reload_failed"]
    assert failed and {e["step"] for e in failed} == {"step_4"}, failed
    # Each server's pre-flight fetched the step into its store cache while it still served: the reloads (the
    # pauses) fetched nothing.
    done = [json.loads(line) for line in log_path.read_text().splitlines() if '"reload_done"' in line]
    assert len(done) == 6 and all(e["report"]["report"]["fetched_bytes"] == 0 for e in done), [
        e["report"]["report"]["fetched_bytes"] for e in done]
    # Restarted with --once: both servers hold the newest step; nothing is reloaded.
    once = subprocess.run([LAYERWISE, "watch", f"s3://{BUCKET}/{RUN}/", "--url", a.url, "--url", b.url, "--once",
                           "--settle", "0", "--interval", "0.2", "--json"], cwd=ROOT, env={**ENV, **s3.env()},
                          capture_output=True, text=True, timeout=120)
    assert once.returncode == 0, once.stderr
    assert not [line for line in once.stdout.splitlines() if json.loads(line)["event"] == "reload_started"]
