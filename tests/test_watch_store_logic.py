"""`watch` on a URL prefix, its own logic, fast: steps from a listing, completeness and pins, --keep (no store)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from layerwise_cli.checkpoint.steps.local import COMPLETE, INCOMPLETE, SETTLING, CompletenessTracker, steps_to_delete
from layerwise_cli.checkpoint.steps.store import StoreStep, changed_objects, steps_in_listing
from layerwise_cli.checkpoint.store.headers import store_pin
from layerwise_cli.client.watch.entry import Watcher, WatchOptions
from layerwise_cli.client.watch.listed_steps import ListedSteps
from layerwise_cli.errors import UsageError

RUN = "s3://ckpts/run"
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def listing(step: str, names: tuple[str, ...], etag: str = "e1") -> list[tuple[str, str, int]]:
    return [(f"{step}/{name}", f'"{etag}-{name}"', 100 + i) for i, name in enumerate(names)]


# --- steps from a listing ----------------------------------------------------------------------------

def test_a_listing_groups_objects_into_steps_by_their_first_folder_sorted_by_number():
    objects = [*listing("step_10", (INDEX, *SHARDS)), *listing("step_9", ("model.safetensors",)),
               *listing("global_step_11", ("model.safetensors", "tokenizer/vocab.json")),
               *listing("notes", ("a.txt",)), *listing("step_x", ("model.safetensors",)),
               ("step_12", '"e"', 4),  # an object named like a step, not a folder: not a step
               ("README.md", '"e"', 1)]
    steps = steps_in_listing(RUN + "/", objects)
    assert [(s.name, s.number) for s in steps] == [("step_9", 9), ("step_10", 10), ("global_step_11", 11)]
    assert steps[1].url == f"{RUN}/step_10" and steps[2].url == f"{RUN}/global_step_11"
    assert steps[2].names() == ["model.safetensors", "tokenizer/vocab.json"]
    under = [(path.split("/", 1)[1], etag, size) for path, etag, size in listing("step_10", (INDEX, *SHARDS))]
    assert steps[1].objects == tuple(sorted(under))
    assert [s.name for s in steps_in_listing(RUN, objects, ["step_*"])] == ["step_9", "step_10"]
    assert steps_in_listing(RUN, []) == []


def test_a_step_is_pinned_only_once_checked_and_its_pin_is_the_store_pin_of_what_was_read():
    step = steps_in_listing(RUN, listing("step_1", ("config.json", INDEX, *SHARDS, "STABLE")))[0]
    assert step.pinned is None and step.revision is None and step.source == f"{RUN}/step_1"
    read = {name: (etag, size) for name, etag, size in step.objects if name != "STABLE"}
    pinned = StoreStep(step.name, step.number, step.url, step.objects,
                       tuple(sorted((n, e, s) for n, (e, s) in read.items())))
    assert pinned.revision == store_pin(read) and pinned.revision.startswith("etags:")
    # Another ETag for any object read: another pin.
    other = dict(read, **{SHARDS[1]: ('"new"', read[SHARDS[1]][1])})
    assert store_pin(other) != pinned.revision


def test_changed_objects_names_what_changed_or_went_in_sorted_order():
    pinned = {"a": ('"1"', 10), "b": ('"2"', 20), "c": ('"3"', 30)}
    assert changed_objects(pinned, dict(pinned)) == []
    assert changed_objects(pinned, {"a": ('"1"', 10), "b": ('"2b"', 20)}) == ["b", "c"]
    assert changed_objects(pinned, {**pinned, "a": ('"1"', 11), "extra": ('"x"', 1)}) == ["a"]


# --- completeness of store steps (their examination faked: the store's is tested in test_watch_store_cli.py) -----

@dataclass(frozen=True)
class Examined(StoreStep):
    """A store step whose examination is given: (problem, pinned) instead of reading headers from a store."""

    problem: str | None = None
    calls: list | None = None

    def examine(self):
        if self.calls is not None:
            self.calls.append(self.name)
        if self.problem is not None:
            return self.problem, None
        return None, StoreStep(self.name, self.number, self.url, self.objects, self.objects)


def step_of(names: tuple[str, ...], *, etag: str = "e1", problem: str | None = None, calls=None) -> Examined:
    objects = tuple(sorted((n, f'"{etag}-{n}"', 1) for n in names))
    return Examined("step_1", 1, f"{RUN}/step_1", objects, None, problem=problem, calls=calls)


def test_auto_completeness_of_a_store_step_needs_its_check_to_pass_and_its_listing_to_settle():
    now, calls = [100.0], []
    tracker = CompletenessTracker("auto", settle=2.0, clock=lambda: now[0])
    partial = step_of((INDEX, SHARDS[0]), problem="index names shard 'model-00002-of-00002.safetensors', which "
                      "is not there", calls=calls)
    state = tracker.check(partial)
    assert state.state == INCOMPLETE and "not there" in state.reason and state.loadable is None
    now[0] += 5
    assert tracker.check(partial).state == INCOMPLETE and calls == ["step_1"]  # same listing: not read again
    whole = step_of((INDEX, *SHARDS), calls=calls)
    assert tracker.check(whole).state == SETTLING and calls == ["step_1", "step_1"]
    now[0] += 1.0
    assert tracker.check(whole).state == SETTLING
    now[0] += 1.5
    state = tracker.check(whole)
    assert state.state == COMPLETE and calls == ["step_1", "step_1"]
    assert state.loadable.revision is not None and state.loadable.revision == store_pin(
        {n: (e, s) for n, e, s in whole.objects})
    # Rewritten (another ETag): examined again, settles again.
    again = step_of((INDEX, *SHARDS), etag="e2", calls=calls)
    assert tracker.check(again).state == SETTLING and len(calls) == 3


def test_marker_completeness_of_a_store_step_pins_it_once_and_loads_it_even_if_its_check_failed():
    calls = []
    tracker = CompletenessTracker("STABLE", settle=100)
    assert tracker.check(step_of((INDEX, *SHARDS), calls=calls)).state == INCOMPLETE and calls == []
    marked = step_of((INDEX, *SHARDS, "STABLE"), calls=calls)
    state = tracker.check(marked)
    assert state.complete and state.loadable.pinned is not None and calls == ["step_1"]
    assert tracker.check(marked).complete and calls == ["step_1"]
    # A marker over a bad step: complete, unpinned; its reload fails on what is there, and the step is skipped.
    bad = step_of(("model.safetensors", "STABLE"), etag="e3", problem="header: bad JSON")
    state = tracker.check(bad)
    assert state.complete and state.loadable is None and "bad JSON" in state.reason


def test_keep_picks_old_store_steps_like_directories():
    steps = [StoreStep(f"step_{n}", n, f"{RUN}/step_{n}", ()) for n in range(1, 6)]
    gone = steps_to_delete(steps, 2, steps[3], protected={"step_2"})
    assert [s.name for s in gone] == ["step_1", "step_3"]


# --- the watcher's options for a URL root ----------------------------------------------------------------

class Idle:
    threaded = False
    name = "engine"

    def weight_version(self):
        return None

    def reload(self, source, version, revision=None):
        raise AssertionError("not reached")


def test_a_url_root_is_polled_every_10_s_named_without_credentials_and_refuses_revision():
    watcher = Watcher("s3://user:secret@ckpts/run/?X-Amz-Signature=abc", [Idle()], WatchOptions())
    assert isinstance(watcher.source, ListedSteps) and watcher.source.remote and watcher.interval == 10.0
    assert "secret" not in watcher.where and "Signature" not in watcher.where
    assert Watcher(f"{RUN}/", [Idle()], WatchOptions(interval=0.5)).interval == 0.5
    with pytest.raises(UsageError, match="--revision applies to a Hub repo id"):
        Watcher(f"{RUN}/", [Idle()], WatchOptions(revision="main"))
