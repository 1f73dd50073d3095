"""`watch s3://bucket/run/` against a real S3 server (SeaweedFS on loopback), its targets recording (no engine).

The listing, the completeness checks, the pins and `--keep` all run against the store for real; the target
re-reads each step's headers at the pin the watch hands it (`open_checkpoint(url, pin)`, as every worker does),
so a pin a worker would refuse fails the test. The servers' side is `test_watch_store_server.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.checkpoint.steps.store import list_objects
from layerwise_cli.cli.app import app
from layerwise_cli.client.watch.entry import Watcher, WatchOptions
from layerwise_cli.client.watch.targets import Outcome
from layerwise_cli.errors import LayerwiseError
from tests.support.seaweed import BUCKET, READER_KEY, READER_SECRET, SECRET_KEY, SeaweedS3, running_seaweed
from tests.support.server_support import free_port
from tests.support.synthetic import SyntheticModel, write_checkpoint

DENSE = SyntheticModel(layers=2, hidden=64, intermediate=128, vocab=128)


@pytest.fixture(scope="module")
def s3() -> SeaweedS3:
    with running_seaweed() as server:
        yield server


@pytest.fixture
def store_env(s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Two steps' worth of different checkpoints (three shards and an index each)."""
    root = tmp_path_factory.mktemp("watch-store")
    made = {}
    for seed in (1, 2):
        made[f"v{seed}"] = root / f"v{seed}"
        write_checkpoint(made[f"v{seed}"], DENSE, "trainer_export", 3,
                         data=lambda name, n, seed=seed: bytes((seed + i) % 251 for i in range(n)))
    return made


class Recorder:
    """An inline target that reads each step at the pin it is given, as a worker would, and records it."""

    threaded = False
    name = "engine"

    def __init__(self, on_reload=None) -> None:
        self.version: str | None = None
        self.loaded: list[tuple[str, str | None]] = []  # (version, pin)
        self.on_reload = on_reload

    def weight_version(self):
        return self.version

    def reload(self, source: str, version: str, revision: str | None = None) -> Outcome:
        if self.on_reload is not None:
            self.on_reload(source, version)
        try:
            checkpoint = open_checkpoint(source, revision)
        except LayerwiseError as exc:
            return Outcome(ok=False, holds="previous", error=str(exc), failed_in_reload=True, version=self.version)
        assert revision is not None and checkpoint.revision == revision
        self.loaded.append((version, revision))
        self.version = version
        return Outcome(ok=True, holds="new", version=version, wall_s=0.01, peak_bytes=1)


def put(s3: SeaweedS3, run: str, step: str, folder: Path, *, only: set[str] | None = None) -> str:
    """Upload FOLDER's files (or only those named) as the step RUN/STEP; its URL."""
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    store = s3.objects(f"{run}/{step}")
    for path in sorted(folder.iterdir()):
        if path.is_file() and (only is None or path.name in only):
            obstore.put(store, path.name, path.read_bytes())
    return f"s3://{BUCKET}/{run}/{step}"


def run_watch(url: str, targets, **options):
    watcher = Watcher(url, targets, WatchOptions(interval=0.05, settle=0.0, **options))
    return watcher, list(watcher.run())


def test_steps_written_one_after_another_are_each_loaded_at_their_pin(store_env, folders) -> None:
    s3, run = store_env, "one-after-another"
    first = put(s3, run, "step_1", folders["v1"])
    target = Recorder()
    watcher = Watcher(f"s3://{BUCKET}/{run}/", [target], WatchOptions(interval=0.05, settle=0.0))
    events = []
    for event in watcher.run():
        events.append(event)
        if event.kind == "reload_done" and event.step == "step_1":
            second = put(s3, run, "step_2", folders["v2"])
        if event.kind == "reload_done" and event.step == "step_2":
            watcher.stop()
    assert [version for version, _ in target.loaded] == ["step_1", "step_2"]
    # Each at the pin of its own objects: what a worker reading the step now finds.
    assert target.loaded[0][1] == open_checkpoint(first).revision
    assert target.loaded[1][1] == open_checkpoint(second).revision
    assert target.loaded[0][1] != target.loaded[1][1]
    assert [e.step for e in events if e.kind == "step_complete"] == ["step_1", "step_2"]


def test_an_incomplete_step_is_never_loaded(store_env, folders) -> None:
    s3, run = store_env, "incomplete"
    put(s3, run, "step_1", folders["v1"])
    shards = sorted(p.name for p in folders["v2"].glob("*.safetensors"))
    # step_2: its index and its first shard only (the trainer is still uploading).
    put(s3, run, "step_2", folders["v2"], only={"config.json", "model.safetensors.index.json", shards[0]})
    target = Recorder()
    _, events = run_watch(f"s3://{BUCKET}/{run}", [target], once=True)
    assert [version for version, _ in target.loaded] == ["step_1"]
    assert "step_2" in [e.step for e in events if e.kind == "step_seen"]
    # With a marker: step_3 complete but unmarked is not loaded; marked, it is.
    put(s3, run, "step_3", folders["v2"])
    _, events = run_watch(f"s3://{BUCKET}/{run}", [target], once=True, marker="STABLE")
    assert target.version == "step_1" and "step_3" not in [e.step for e in events if e.kind == "reload_started"]
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    obstore.put(s3.objects(f"{run}/step_3"), "STABLE", b"")
    run_watch(f"s3://{BUCKET}/{run}", [target], once=True, marker="STABLE")
    assert [version for version, _ in target.loaded] == ["step_1", "step_3"]


def test_a_step_rewritten_after_it_was_pinned_is_refused_and_skipped(store_env, folders) -> None:
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    s3, run = store_env, "rewritten"
    put(s3, run, "step_1", folders["v1"])
    shard = sorted(p.name for p in folders["v2"].glob("*.safetensors"))[-1]

    def rewrite(source: str, version: str) -> None:
        # The trainer rewrites a shard of step_2 after the watch pinned it, before the target reads it.
        if version == "step_2":
            obstore.put(s3.objects(f"{run}/step_2"), shard, (folders["v1"] / shard).read_bytes())

    target = Recorder(on_reload=rewrite)
    target.version = "step_1"
    put(s3, run, "step_2", folders["v2"])
    _, events = run_watch(f"s3://{BUCKET}/{run}", [target], once=True)
    failed = [e for e in events if e.kind == "reload_failed"]
    assert len(failed) == 1 and "changed since this operation pinned them" in failed[0].message, failed
    skipped = [e.message for e in events if e.kind == "step_skipped" and e.step == "step_2"]
    assert len(skipped) == 1 and skipped[0].startswith("vanished:") and shard in skipped[0], skipped
    assert target.loaded == [] and target.version == "step_1"


def test_keep_deletes_old_steps_where_the_store_allows_it_and_says_once_where_it_does_not(
        store_env, folders, monkeypatch) -> None:
    s3, run = store_env, "keep"
    for n in (1, 2, 3):
        put(s3, run, f"step_{n}", folders[f"v{1 + n % 2}"])
    # A reader's credentials: nothing may be deleted; said once, however many polls follow.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READER_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READER_SECRET)
    target = Recorder()
    watcher = Watcher(f"s3://{BUCKET}/{run}", [target], WatchOptions(interval=0.05, settle=0.0, keep=1))
    events = []
    for event in watcher.run():
        events.append(event)
        if event.kind == "step_skipped" and "could not delete" in (event.message or ""):
            put(s3, run, "step_4", folders["v1"])  # a second chance to delete: not taken, not said again
        if event.kind == "reload_done" and event.step == "step_4":
            watcher.stop()
    refused = [e for e in events if e.kind == "step_skipped" and "could not delete" in (e.message or "")]
    assert len(refused) == 1 and "access denied" in refused[0].message, refused
    assert READER_SECRET not in refused[0].message
    assert not [e for e in events if e.kind == "step_deleted"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    assert {path.split("/")[0] for path, _, _ in list_objects(f"s3://{BUCKET}/{run}")} == {
        "step_1", "step_2", "step_3", "step_4"}
    # With the writer's: the held step stays, the older ones go.
    target = Recorder()
    _, events = run_watch(f"s3://{BUCKET}/{run}", [target], once=True, keep=1)
    assert target.version == "step_4"
    assert sorted(e.step for e in events if e.kind == "step_deleted" and e.by == "watch") == [
        "step_1", "step_2", "step_3"]
    assert {path.split("/")[0] for path, _, _ in list_objects(f"s3://{BUCKET}/{run}")} == {"step_4"}


def test_a_listing_that_fails_mid_watch_is_an_event_and_the_watch_goes_on(store_env, folders, monkeypatch) -> None:
    s3, run = store_env, "down"
    put(s3, run, "step_1", folders["v1"])
    target = Recorder()
    watcher = Watcher(f"s3://{BUCKET}/{run}", [target], WatchOptions(interval=0.05, settle=0.0))
    events = []
    for event in watcher.run():
        events.append(event)
        if event.kind == "reload_done" and event.step == "step_1":
            # The store stops answering (its endpoint now a closed port): the next listings fail.
            monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        if event.kind == "source_down":
            monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
            put(s3, run, "step_2", folders["v2"])
        if event.kind == "reload_done" and event.step == "step_2":
            watcher.stop()
    kinds = [e.kind for e in events]
    assert kinds.count("source_down") == 1 and kinds.count("source_back") == 1
    assert kinds.index("source_down") < kinds.index("source_back")
    assert [version for version, _ in target.loaded] == ["step_1", "step_2"]


@pytest.mark.parametrize(("url", "env", "message"), [
    ("s3://no-such-bucket/run/", {}, "s3://no-such-bucket/run: no such bucket"),
    (f"s3://{BUCKET}/keep/", {"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, "access denied"),
])
def test_the_first_listing_fails_in_one_line(store_env, monkeypatch, url, env, message) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    done = CliRunner().invoke(app, ["watch", url, "--url", "http://127.0.0.1:9", "--once"])
    errors = [line for line in done.output.splitlines() if line.startswith("Error:")]
    assert done.exit_code == 1 and len(errors) == 1 and message in errors[0], done.output
    assert "wrong-secret" not in done.output and SECRET_KEY not in done.output
