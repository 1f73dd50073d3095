"""`watch`'s own logic, fast: step names, completeness, --keep, and the loop against fake targets (no server)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from safetensors.numpy import save_file

from layerwise_cli.checkpoint.steps.local import (
    COMPLETE,
    INCOMPLETE,
    SETTLING,
    CompletenessTracker,
    StepDir,
    deletion_refusal,
    files_problem,
    list_steps,
    step_number,
    steps_to_delete,
)
from layerwise_cli.cli.watch import _status
from layerwise_cli.client.watch import watcher as watcher_module
from layerwise_cli.client.watch.entry import Watcher, WatchOptions
from layerwise_cli.client.watch.hub_source import HubStepSource
from layerwise_cli.client.watch.listed_steps import ListedSteps
from layerwise_cli.client.watch.options import HUB_INTERVAL_S, LOCAL_INTERVAL_S
from layerwise_cli.client.watch.targets import Outcome, TargetDown
from layerwise_cli.client.watch.watcher import open_step_source
from layerwise_cli.errors import UsageError


def write_step(root: Path, name: str, *, shards: int = 1, marker: str | None = None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    weight_map = {}
    for i in range(shards):
        shard = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"w{i}": np.full((4, 4), i, dtype=np.float32)}, str(folder / shard))
        weight_map[f"w{i}"] = shard
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if marker:
        (folder / marker).touch()
    return folder


# --- names and listing ---------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "number"), [("step_12", 12), ("global_step_120", 120), ("checkpoint-7", 7),
                                              ("iter_0000300", 300), ("step-3-v2", 2), ("step_x", None)])
def test_step_number_is_the_last_integer(name, number):
    assert step_number(name) == number


def test_list_steps_matches_patterns_and_sorts_by_number(tmp_path):
    for name in ("step_10", "step_9", "global_step_11", "notes", "step_x", "checkpoint-2"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_99").write_text("a file, not a step")
    assert [s.name for s in list_steps(tmp_path)] == ["checkpoint-2", "step_9", "step_10", "global_step_11"]
    assert [s.name for s in list_steps(tmp_path, ["step_*"])] == ["step_9", "step_10"]
    with pytest.raises(Exception, match="missing"):
        list_steps(tmp_path / "missing")


# --- completeness ----------------------------------------------------------------------------------

def test_files_problem_needs_every_shard_whole(tmp_path):
    step = write_step(tmp_path, "step_1", shards=3)
    assert files_problem(step) is None
    shard = step / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-8])  # still being written
    assert "truncated" in files_problem(step)
    shard.unlink()
    assert "does not exist yet" in files_problem(step)
    shard.write_bytes(data)
    (step / "model.safetensors.index.json").write_text('{"weight_map": {"w0": "model-00001-of-00003.saf')
    assert "not valid yet" in files_problem(step)
    (step / "model.safetensors.index.json").unlink()
    assert "no model.safetensors.index.json" in files_problem(step)
    assert files_problem(write_step(tmp_path, "step_2")) is None  # one shard needs no index
    (tmp_path / "step_3").mkdir()
    assert "no .safetensors" in files_problem(tmp_path / "step_3")


def test_auto_completeness_waits_for_the_step_to_settle(tmp_path):
    now = [100.0]
    tracker = CompletenessTracker("auto", settle=2.0, clock=lambda: now[0])
    step = StepDir("step_1", write_step(tmp_path, "step_1", shards=2), 1)
    assert tracker.check(step).state == SETTLING
    now[0] += 1.5
    assert tracker.check(step).state == SETTLING
    (step.path / "extra.json").write_text("{}")  # a change restarts the clock
    now[0] += 1.0
    assert tracker.check(step).state == SETTLING
    now[0] += 2.0
    assert tracker.check(step).state == COMPLETE
    (step.path / "model-00002-of-00002.safetensors").write_bytes(b"\x08\x00")
    now[0] += 10
    assert tracker.check(step).state == INCOMPLETE


def test_marker_completeness_ignores_the_files(tmp_path):
    tracker = CompletenessTracker("STABLE", settle=100)
    step = StepDir("step_1", tmp_path / "step_1", 1)
    step.path.mkdir()
    assert tracker.check(step).state == INCOMPLETE
    (step.path / "STABLE").touch()
    assert tracker.check(step).complete


def test_keep_never_deletes_held_or_newer_steps():
    steps = [StepDir(f"step_{n}", Path(f"/r/step_{n}"), n) for n in range(1, 8)]
    held = steps[4]  # step_5; step_6 and step_7 are newer (being written)
    gone = steps_to_delete(steps, 2, held, protected={"step_2"})
    assert [s.name for s in gone] == ["step_1", "step_3", "step_4"]
    assert steps_to_delete(steps, 7, held, set()) == []


# --- the loop, against fake targets ------------------------------------------------------------------

class FakeTarget:
    """An inline target: records reloads; `broken` steps fail pre-flight; `down` probes fail first."""

    threaded = False

    def __init__(self, name: str, version: str | None = None, *, down: int = 0, broken=(), on_reload=None):
        self.name, self.version, self.down, self.broken, self.on_reload = name, version, down, set(broken), on_reload
        self.reloads: list[str] = []

    def weight_version(self):
        if self.down > 0:
            self.down -= 1
            raise TargetDown("connection refused")
        return self.version

    def reload(self, path: str, version: str, revision: str | None = None) -> Outcome:
        assert revision is None  # a folder step has no commit
        self.reloads.append(version)
        if self.on_reload is not None:
            self.on_reload(Path(path))
        if not Path(path).exists():
            return Outcome(ok=False, holds="previous", error=f"{path}: no such directory", failed_in_reload=True,
                           version=self.version)
        if version in self.broken:
            return Outcome(ok=False, holds="previous", error="pre-flight: shapes differ", failed_in_reload=True,
                           version=self.version)
        self.version = version
        return Outcome(ok=True, holds="new", version=version, wall_s=0.01, peak_bytes=10)


def run_once(root, targets, **options):
    watcher = Watcher(root, targets, WatchOptions(marker="STABLE", interval=0.01, once=True, **options))
    events = list(watcher.run())
    return watcher, events


def kinds(events, kind):
    return [(e.step, e.server) for e in events if e.kind == kind]


def test_goes_to_the_newest_complete_step_and_restarting_is_free(tmp_path):
    for n in (1, 2, 3):
        write_step(tmp_path, f"step_{n}", marker="STABLE")
    write_step(tmp_path, "step_4")  # no marker: still being written
    a, b = FakeTarget("a"), FakeTarget("b", version="step_3")
    watcher, events = run_once(tmp_path, [a, b])
    assert watcher.failure is None
    assert a.reloads == ["step_3"] and b.reloads == []  # b already held it
    assert kinds(events, "step_complete") == [("step_3", None)]
    again = FakeTarget("a", version="step_3")
    _, events = run_once(tmp_path, [again])
    assert again.reloads == [] and not kinds(events, "reload_started")


def test_a_broken_step_is_reported_once_and_skipped(tmp_path):
    write_step(tmp_path, "step_1", marker="STABLE")
    write_step(tmp_path, "step_2", marker="STABLE")
    a, b = FakeTarget("a", version="step_1", broken={"step_2"}), FakeTarget("b", version="step_1",
                                                                             broken={"step_2"})
    watcher, events = run_once(tmp_path, [a, b])
    assert watcher.failure is None  # both hold step_1, the newest step that loads
    assert len([e for e in events if e.kind == "step_skipped" and e.step == "step_2"]) == 1
    assert a.version == b.version == "step_1"
    assert a.reloads.count("step_2") + b.reloads.count("step_2") <= 2


def test_a_step_deleted_while_loading_is_reported_and_the_watch_goes_on(tmp_path):
    write_step(tmp_path, "step_1", marker="STABLE")
    write_step(tmp_path, "step_2", marker="STABLE")
    deleted = []

    def trainer_deletes(path: Path) -> None:
        if path.name == "step_2" and not deleted:
            shutil.rmtree(path)
            deleted.append(path.name)
            write_step(tmp_path, "step_3", marker="STABLE")

    a = FakeTarget("a", version="step_1", on_reload=trainer_deletes)
    watcher, events = run_once(tmp_path, [a])
    assert watcher.failure is None and a.version == "step_3"
    failed = [e for e in events if e.kind == "reload_failed"]
    assert len(failed) == 1 and "deleted while it was loading" in failed[0].message
    assert ("step_2", None) in kinds(events, "step_deleted")
    assert not [e for e in events if e.kind == "step_skipped" and "broken" in (e.message or "")]


def test_a_down_server_is_retried_and_brought_up_to_date(tmp_path):
    write_step(tmp_path, "step_5", marker="STABLE")
    a = FakeTarget("a", down=2)
    watcher, events = run_once(tmp_path, [a])
    assert watcher.failure is None and a.version == "step_5"
    assert kinds(events, "server_down") == [(None, "a")] and kinds(events, "server_back") == [(None, "a")]


def test_once_fails_when_a_server_never_answers(tmp_path):
    write_step(tmp_path, "step_5", marker="STABLE")
    watcher, _ = run_once(tmp_path, [FakeTarget("a", down=99)])
    assert watcher.failure is not None and "connection refused" in watcher.failure


def test_keep_deletes_only_what_no_server_holds(tmp_path):
    for n in range(1, 6):
        write_step(tmp_path, f"step_{n}", marker="STABLE")
    a, b = FakeTarget("a", version="step_5"), FakeTarget("b", version="step_5")
    run_once(tmp_path, [a, b], keep=2)  # every server holds step_5 at once
    # Older than the newest 2 and held by nobody: deleted; nothing else.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5"]
    write_step(tmp_path, "step_6", marker="STABLE")
    write_step(tmp_path, "step_7", marker="STABLE")
    c = FakeTarget("c", version="step_4", broken={"step_7"})  # c will stay on step_6
    _, events = run_once(tmp_path, [c], keep=1)
    assert c.version == "step_6"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "step_6" in names and "step_7" in names and "step_4" not in names
    assert all(e.by == "watch" for e in events if e.kind == "step_deleted")


def test_keep_deletes_only_steps_it_would_load_never_through_a_link_and_reports_only_what_it_deleted(tmp_path):
    """A `step_0` holding a user's notes, a step with neither marker nor complete files, and a symlinked step
    are left in place and not reported; a complete old step goes (by its files, when its marker is gone)."""
    notes = tmp_path / "step_0"
    notes.mkdir()
    (notes / "notes.txt").write_text("my notes")
    partial = write_step(tmp_path, "step_1", shards=2)
    (partial / "model-00002-of-00002.safetensors").unlink()  # the index names a shard that is not there
    outside = write_step(tmp_path / "elsewhere", "step_2", marker="STABLE")
    (tmp_path / "step_2").symlink_to(outside, target_is_directory=True)
    write_step(tmp_path, "step_3")  # complete files, no marker: a step this watch would load
    for n in (4, 5):
        write_step(tmp_path, f"step_{n}", marker="STABLE")
    a = FakeTarget("a", version="step_5")
    _, events = run_once(tmp_path, [a], keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "step_0", "step_1", "step_2", "step_5"]
    assert (notes / "notes.txt").read_text() == "my notes"
    assert (outside / "STABLE").exists() and (tmp_path / "step_2").is_symlink()
    assert sorted(step for step, _ in kinds(events, "step_deleted")) == ["step_3", "step_4"]


def test_deletion_refusal_says_why_a_step_stays(tmp_path):
    def step(name):
        return StepDir(name, tmp_path / name, 1)

    (tmp_path / "step_a").mkdir()
    assert "not a complete checkpoint: no .safetensors file yet" in deletion_refusal(step("step_a"), "STABLE")
    write_step(tmp_path, "step_b")
    assert deletion_refusal(step("step_b"), "STABLE") is None and deletion_refusal(step("step_b")) is None
    (tmp_path / "step_c").symlink_to(tmp_path / "step_b", target_is_directory=True)
    assert "symbolic link" in deletion_refusal(step("step_c"))
    (tmp_path / "step_d").mkdir()
    (tmp_path / "step_d" / "STABLE").touch()
    assert deletion_refusal(step("step_d"), "STABLE") is None


def test_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="twice"):
        Watcher(tmp_path, [FakeTarget("a"), FakeTarget("a")])
    with pytest.raises(UsageError, match="--keep"):
        Watcher(tmp_path, [FakeTarget("a")], WatchOptions(keep=0))


def test_live_status_shows_each_server(tmp_path):
    write_step(tmp_path, "step_2", marker="STABLE")
    watcher = Watcher(tmp_path, [FakeTarget("http://a:1"), FakeTarget("http://b:2", down=99)],
                      WatchOptions(marker="STABLE", interval=0.01, once=True))
    list(watcher.run())
    console = Console(record=True, width=200)
    console.print(_status(watcher))
    text = console.export_text()
    assert "newest step step_2, complete step_2" in text
    assert "http://a:1" in text and "current" in text and "http://b:2" in text and "down" in text


def test_when_every_step_is_broken_each_is_tried_once(tmp_path):
    write_step(tmp_path, "step_1", marker="STABLE")
    write_step(tmp_path, "step_2", marker="STABLE")
    a = FakeTarget("a", version="base", broken={"step_1", "step_2"})
    watcher, events = run_once(tmp_path, [a])
    assert a.reloads == ["step_2", "step_1"] and a.version == "base"
    assert [e.step for e in events if e.kind == "step_skipped"] == ["step_2", "step_1"]
    assert watcher.failure is not None and "no complete step" in watcher.failure
    assert "broken: step_2, step_1" in watcher.failure


class ThreadedTarget(FakeTarget):
    """A fake server target: threaded, so `watch` brings several of them to a step all or nothing."""

    threaded = True


def test_several_servers_are_brought_to_a_step_together_and_a_dead_one_is_left_out(tmp_path, monkeypatch):
    """The scheduling of --atomic (our logic; the fleet rule itself is proven on real servers in test_fleet_server)."""
    write_step(tmp_path, "step_1", marker="STABLE")
    a, b = ThreadedTarget("a"), ThreadedTarget("b")
    calls: list[tuple[list[str], str]] = []

    def reload_together(targets, path, version, revision):
        calls.append(([t.name for t in targets], version))
        if len(calls) == 1:  # b dies during the first update: a is reloaded back, b is down
            b.down = 1
            return {"a": Outcome(ok=False, holds="previous", error="b failed; reloaded back", version=None),
                    "b": Outcome(ok=False, holds="unknown", error="cannot connect", reached=False)}
        return {t.name: t.reload(path, version, revision) for t in targets}

    monkeypatch.setattr(watcher_module, "reload_together", reload_together)
    watcher, events = run_once(tmp_path, [a, b])
    assert watcher.failure is None and a.version == b.version == "step_1"
    assert calls[0] == (["a", "b"], "step_1")
    # Never one server alone while the other answers: after b went down, a alone; b, back, alone (a held it).
    assert [names for names, _ in calls[1:]] in (
        [["a"], ["b"]], [["a", "b"]], [["b"], ["a"]]), calls
    assert not [e for e in events if e.kind == "step_skipped"]  # a server's death does not break the step


def test_no_atomic_reloads_each_server_on_its_own(tmp_path, monkeypatch):
    write_step(tmp_path, "step_1", marker="STABLE")
    a, b = ThreadedTarget("a"), ThreadedTarget("b")
    monkeypatch.setattr(watcher_module, "reload_together", lambda *args: pytest.fail("reloaded together"))
    watcher, _ = run_once(tmp_path, [a, b], atomic=False)
    assert watcher.failure is None and a.reloads == ["step_1"] and b.reloads == ["step_1"]


# --- the step source protocol --------------------------------------------------------------------

def test_a_listed_root_polls_as_a_step_source(tmp_path):
    """ListedSteps answers the loop's questions: what was seen, the newest complete step above the floor, the
    steps it passes over, and a target deleted under it."""
    source = ListedSteps(tmp_path, WatchOptions(marker="STABLE"))
    for number in (1, 2, 3):
        write_step(tmp_path, f"step_{number}", marker="STABLE")
    write_step(tmp_path, "step_4")  # no marker yet
    first = source.poll(None, -1, {})
    assert [fields["step"] for kind, fields in first.events] == ["step_1", "step_2", "step_3", "step_4"]
    assert first.target.name == "step_3" and [s.name for s in first.passed_over] == ["step_1", "step_2"]
    assert first.newest_seen == "step_4" and not first.target_gone
    # step_3 broken: the newest complete step below it is chosen; nothing new is reported again.
    again = source.poll(None, -1, {"step_3": "NaN"})
    assert again.events == [] and again.target.name == "step_2"
    shutil.rmtree(tmp_path / "step_3")
    gone = source.poll(first.target, 3, {})
    assert gone.target_gone and gone.target is None
    assert gone.events == [("step_deleted", {"step": "step_3", "by": "other"})]
    assert source.once_failure({}, tries=3, settling=False).startswith(f"{tmp_path}: no complete step")


def test_the_poll_interval_is_the_sources_own_and_a_bad_one_is_refused(tmp_path):
    assert open_step_source(tmp_path, WatchOptions()).interval == LOCAL_INTERVAL_S
    remote = [open_step_source(root, WatchOptions()) for root in ("s3://bucket/run/", "hf://org/run", "org/name")]
    assert [s.interval for s in remote] == [HUB_INTERVAL_S] * 3 and isinstance(remote[-1], HubStepSource)
    assert remote[-1].steps.interval == HUB_INTERVAL_S
    assert open_step_source(tmp_path, WatchOptions(interval=0.25)).interval == 0.25
    for bad in (WatchOptions(interval=0), WatchOptions(settle=-1)):
        with pytest.raises(UsageError, match="--interval must be positive"):
            open_step_source(tmp_path, bad)
