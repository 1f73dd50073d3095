"""`watch org/model`'s own logic, fast: the loop polls a real loopback Hub (tests/support/hub_server.py) over HTTP
and brings fake targets to each new commit of the ref (the servers themselves: test_watch_hub_server.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from layerwise_cli.cli.app import app
from layerwise_cli.cli.watch import _status
from layerwise_cli.client.watch.entry import Watcher, WatchOptions
from layerwise_cli.client.watch.targets import Outcome
from layerwise_cli.errors import LayerwiseError, UsageError
from tests.support.hub_server import HubServer

REPO = "org/run"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    # huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE at import: point its constants here instead.
    from huggingface_hub import constants  # noqa: PLC0415 - huggingface_hub: heavy (test collection stays fast)

    server = HubServer()
    with server:
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield server


def folder(tmp_path: Path, name: str) -> Path:
    """A commit's content: the loop reads only config.json (the poll's HEAD), never the weights."""
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "' + name + '"}')
    return path


class HubTarget:
    """An inline target reading the loopback Hub as a server's pre-flight would: a commit it cannot find fails."""

    threaded = False

    def __init__(self, name: str, hub: HubServer, version: str | None = None,
                 on_reload: Callable[[str], None] | None = None) -> None:
        self.name, self.hub, self.version, self.on_reload = name, hub, version, on_reload
        self.reloads: list[tuple[str, str, str | None]] = []

    def weight_version(self) -> str | None:
        return self.version

    def reload(self, source: str, version: str, revision: str | None = None) -> Outcome:
        self.reloads.append((source, version, revision))
        if self.on_reload is not None:
            self.on_reload(version)
        assert revision is not None
        if self.hub.resolve(source, revision) is None:
            return Outcome(ok=False, holds="previous", error=f"pre-flight failed: {source}@{revision}: gone",
                           failed_in_reload=True, version=self.version)
        self.version = version
        return Outcome(ok=True, holds="new", version=version, wall_s=0.01, peak_bytes=10)


def watcher(targets, **options) -> Watcher:
    return Watcher(REPO, targets, WatchOptions(interval=0.01, **options))


def test_once_brings_every_target_to_the_commit_the_ref_names_and_a_current_one_is_left_alone(hub, tmp_path):
    first = hub.add_repo(REPO, folder(tmp_path, "c1"))
    a, b = HubTarget("a", hub), HubTarget("b", hub, version=first)
    run = watcher([a, b], once=True)
    events = list(run.run())
    assert run.failure is None
    # Reloaded as the repo id at the commit, named by the commit: never the branch.
    assert a.reloads == [(REPO, first, first)] and b.reloads == []
    assert [e.step for e in events if e.kind == "step_complete"] == [first]
    polls = [r.path for r in hub.requests]
    assert polls and all(p == f"/{REPO}/resolve/main/config.json" for p in polls), polls
    # One-line output shortens the commit; the JSON names it in full.
    done = next(e for e in events if e.kind == "reload_done")
    assert first[:12] in done.line() and first not in done.line()
    assert done.to_dict()["step"] == first and done.to_dict()["version"] == first


def test_a_ref_moved_during_a_reload_changes_nothing_for_it_and_the_next_poll_takes_the_new_commit(hub, tmp_path):
    first = hub.add_repo(REPO, folder(tmp_path, "c1"))
    moved: list[str] = []

    def push_during_the_reload(version: str) -> None:
        if not moved:
            moved.append(hub.move_ref(REPO, "main", folder(tmp_path, "c2")))

    a = HubTarget("a", hub, on_reload=push_during_the_reload)
    run = watcher([a])
    seen = []
    for event in run.run():
        seen.append(event)
        if event.kind == "reload_done" and moved and event.step == moved[0]:
            run.stop()
    assert a.reloads == [(REPO, first, first), (REPO, moved[0], moved[0])]
    assert a.version == moved[0]
    assert [e.step for e in seen if e.kind == "step_seen"] == [first, moved[0]]


def test_a_poll_that_fails_is_an_event_and_the_watch_goes_on(hub, tmp_path):
    first = hub.add_repo(REPO, folder(tmp_path, "c1"))
    a = HubTarget("a", hub)
    run = watcher([a], once=True)
    hub.outage = 503
    events = []
    for event in run.run():
        events.append(event)
        if event.kind == "source_down":
            hub.outage = None  # the Hub is back for the next poll
    assert run.failure is None and a.version == first
    down = [e for e in events if e.kind == "source_down"]
    assert len(down) == 1 and "503" in down[0].message and REPO in down[0].message, down
    kinds = [e.kind for e in events]
    assert kinds.index("source_down") < kinds.index("source_back") < kinds.index("reload_done")


def test_once_gives_up_after_three_failed_polls(hub, tmp_path):
    hub.add_repo(REPO, folder(tmp_path, "c1"))
    hub.outage = 500
    run = watcher([HubTarget("a", hub)], once=True)
    events = list(run.run())
    assert [e.kind for e in events].count("source_down") == 1
    assert run.failure is not None and run.failure.startswith("3 polls in a row failed: ") and "500" in run.failure


def test_a_commit_that_vanished_before_it_was_loaded_is_skipped_with_an_event(hub, tmp_path):
    first = hub.add_repo(REPO, folder(tmp_path, "c1"))
    gone = hub.move_ref(REPO, "main", folder(tmp_path, "c2"))
    pushed: list[str] = []

    def force_push(version: str) -> None:  # as the target starts reading GONE, a force-push replaces it
        if version == gone and not pushed:
            hub.forget_commit(REPO, gone)
            pushed.append(hub.move_ref(REPO, "main", folder(tmp_path, "c3")))

    a = HubTarget("a", hub, version=first, on_reload=force_push)
    run = watcher([a], once=True)
    events = list(run.run())
    assert run.failure is None and a.version == pushed[0]
    failed = [e for e in events if e.kind == "reload_failed"]
    assert [e.step for e in failed] == [gone]
    skipped = [e for e in events if e.kind == "step_skipped"]
    assert [e.step for e in skipped] == [gone]
    assert skipped[0].message.startswith(f"vanished: {REPO}@{gone}: this commit is no longer on the Hub"), skipped
    assert [v for _, v, _ in a.reloads] == [gone, pushed[0]]


def test_once_fails_in_one_line_when_the_only_commit_vanished(hub, tmp_path):
    gone = hub.add_repo(REPO, folder(tmp_path, "c1"))
    a = HubTarget("a", hub, version="base", on_reload=lambda version: hub.forget_commit(REPO, gone))
    run = watcher([a], once=True)
    list(run.run())
    assert a.version == "base" and len(a.reloads) == 1
    assert run.failure is not None and run.failure.startswith(f"{REPO}: no commit to load (skipped: {gone[:12]} ")
    assert "\n" not in run.failure


def test_an_unknown_repo_or_ref_fails_on_the_first_poll(hub, tmp_path):
    hub.add_repo(REPO, folder(tmp_path, "c1"))
    with pytest.raises(LayerwiseError, match=r"^org/none: .*not a local directory"):
        list(Watcher("org/none", [HubTarget("a", hub)], WatchOptions(interval=0.01, once=True)).run())
    with pytest.raises(LayerwiseError, match=r"^org/run@nope: revision not found on the Hub$"):
        list(watcher([HubTarget("a", hub)], once=True, revision="nope").run())


def test_local_root_options_are_refused_for_a_hub_root_and_revision_for_a_local_one(tmp_path):
    target = HubTarget("a", HubServer())
    for options, named in ((WatchOptions(keep=2), "--keep"), (WatchOptions(marker="STABLE"), "--marker"),
                           (WatchOptions(patterns=("ckpt_*",)), "--pattern")):
        with pytest.raises(UsageError, match=f"^{named} applies to a local directory of steps, not to the Hub repo "
                                             f"{REPO}"):
            Watcher(REPO, [target], options)
    Watcher(REPO, [target], WatchOptions(settle=5.0))  # ignored: a commit is complete as pushed
    with pytest.raises(UsageError, match="--revision applies to a Hub repo id"):
        Watcher(tmp_path, [target], WatchOptions(revision="main"))
    assert Watcher(REPO, [target]).interval == 10.0 and Watcher(tmp_path, [target]).interval == 1.0


def test_a_hub_root_is_refused_offline(monkeypatch):
    from huggingface_hub import constants  # noqa: PLC0415 - huggingface_hub: heavy (test collection stays fast)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError, match=f"^watching the Hub repo {REPO} needs the Hub, and HF_HUB_OFFLINE=1 is set$"):
        Watcher(REPO, [HubTarget("a", HubServer())])


def test_live_status_names_the_ref_and_commits_by_their_first_characters(hub, tmp_path):
    first = hub.add_repo(REPO, folder(tmp_path, "c1"))
    run = watcher([HubTarget("http://a:1", hub)], once=True)
    list(run.run())
    console = Console(record=True, width=200)
    console.print(_status(run))
    text = console.export_text()
    assert f"watch {REPO}: newest commit {first[:12]}, target {first[:12]}" in text
    assert "current" in text and first not in text


def test_the_command_refuses_local_root_options_and_names_a_repo_the_hub_does_not_know(hub, tmp_path):
    hub.add_repo(REPO, folder(tmp_path, "c1"))
    runner = CliRunner()
    keep = runner.invoke(app, ["watch", REPO, "--url", "http://127.0.0.1:9", "--keep", "2"])
    assert keep.exit_code == 2 and f"--keep applies to a local directory of steps, not to the Hub repo {REPO}" \
        in keep.output, keep.output
    unknown = runner.invoke(app, ["watch", "org/none", "--url", "http://127.0.0.1:9", "--once"])
    assert unknown.exit_code == 1 and "org/none" in unknown.output and "not a local directory" in unknown.output
    assert len(unknown.output.strip().splitlines()) == 1, unknown.output
