"""The RL loop's record and fault checks (examples/rl/record.py, faults.py) on hand-made runs."""

from __future__ import annotations

import pytest

from examples.rl import faults as f
from examples.rl.record import build_record, percentiles
from examples.rl.stores import Names, Published
from examples.rl.traffic import Answer, Failure

A, B = "http://a", "http://b"


def pub(step: int, at: float, *, nan: bool = False, kind: str = "delta") -> Published:
    return Published(step, f"step_{step}", at, 0.5, 100, 1000, kind, nan)


def answer(server: str, sent: float, version: str) -> Answer:
    return Answer(sent, sent + 0.1, server, (version,), "1 2 = ", "2")


def names(*published: Published) -> Names:
    found = Names()
    found.steps.update({p.name: p.step for p in published})
    return found


def test_step_to_serve_is_the_first_answer_with_the_step_after_its_save():
    steps = [pub(0, 0.0, kind="full"), pub(1, 10.0), pub(2, 20.0)]
    answers = [answer(A, 1.0, "default"), answer(A, 10.5, "step_0"), answer(A, 11.0, "step_1"),
               answer(A, 12.0, "step_1"), answer(B, 13.9, "step_1"), answer(A, 21.0, "step_2")]
    record = build_record(steps, answers, [Failure(15.0, B, "x", retried=False)], [A, B], names(*steps).step_of,
                          pauses={(A, 1): 0.25}, reloads={(A, 1): 0.2})
    one = record.steps[1]
    assert one.servers[0].serve_s == pytest.approx(1.1) and one.servers[1].serve_s == pytest.approx(4.0)
    assert one.servers[0].paused_s == 0.25 and one.servers[1].paused_s is None
    assert record.steps[2].servers[1].serve_s is None  # b never answered with step_2
    assert (one.served, one.failed) == (4, 1)
    assert record.answers_per_step == {0: 2, 1: 3, 2: 1}
    # Staleness: the step_0 answer sent at 10.5 came when step_1 was the newest.
    assert record.staleness == {0: 5, 1: 1}
    assert record.figures()["bytes_over_full"]["p50"] == pytest.approx(0.1)


def test_the_pause_splits_into_its_drain_and_the_rest_each_against_the_fleet_s_slowest_apply():
    steps = [pub(0, 0.0, kind="full"), pub(1, 10.0), pub(2, 20.0)]
    pauses = {(A, 1): 1.0, (B, 1): 1.2, (A, 2): 0.6, (B, 2): 0.5}
    drains = {(A, 1): 0.2, (B, 1): 0.1, (A, 2): 0.1, (B, 2): 0.05}
    applies = {(A, 1): 0.5, (B, 1): 0.8, (A, 2): 0.45, (B, 2): 0.4}
    record = build_record(steps, [], [], [A, B], names(*steps).step_of, pauses=pauses, reloads=applies,
                          drains=drains)
    one = record.steps[1]
    assert one.apply_s == 0.8 and one.servers[1].stopped_s == pytest.approx(1.1)
    figures = record.figures()
    assert figures["apply_s"]["n"] == 2 and figures["drain_s"]["n"] == 4
    # A's pause at step 1 covers B's slower apply: 1.0 / 0.8, not 1.0 / 0.5.
    ratios = sorted([1.0 / 0.8, 1.2 / 0.8, 0.6 / 0.45, 0.5 / 0.45])
    assert figures["pause_over_apply"]["p50"] == pytest.approx((ratios[1] + ratios[2]) / 2)
    stopped = sorted([0.8 / 0.8, 1.1 / 0.8, 0.5 / 0.45, 0.45 / 0.45])
    assert figures["stopped_over_apply"]["p95"] == pytest.approx(stopped[-1])
    # Without the drain histogram (an older server), the stopped part is unknown, not the whole pause.
    bare = build_record(steps, [], [], [A, B], names(*steps).step_of, pauses=pauses, reloads=applies)
    assert bare.steps[1].servers[0].stopped_s is None and bare.figures()["stopped_over_apply"]["n"] == 0


def test_unpaused_servers_stopped_for_the_engine_core_s_hold_on_the_reload():
    """Pause mode `none`: no lease pause (its histogram grew by 0), and the engine generated nothing only while the
    reload held its core; paused servers keep the pause less its drain, which covers that hold."""
    steps = [pub(0, 0.0, kind="full"), pub(1, 10.0)]
    pauses = {(A, 1): 0.0, (B, 1): 0.9}
    drains = {(A, 1): 0.0, (B, 1): 0.2}
    stalls = {(A, 1): 0.52, (B, 1): 0.55}
    applies = {(A, 1): 0.5, (B, 1): 0.45}
    record = build_record(steps, [], [], [A, B], names(*steps).step_of, pauses=pauses, reloads=applies,
                          drains=drains, stalls=stalls)
    a, b = record.steps[1].servers
    assert a.stopped_s == 0.52 and b.stopped_s == pytest.approx(0.7)
    figures = record.figures()
    assert figures["stalled_over_apply"]["p95"] == pytest.approx(0.55 / 0.5)
    assert figures["stopped_over_apply"]["p50"] == pytest.approx((0.52 / 0.5 + 0.7 / 0.5) / 2)


def test_percentiles_are_nearest_rank():
    assert percentiles([]) == {"p50": None, "p95": None, "n": 0}
    values = [float(v) for v in range(1, 21)]
    assert percentiles(values) == {"p50": 10.5, "p95": 19.0, "n": 20}


def test_the_default_schedule_strikes_each_fault_once_and_a_schedule_reads_back():
    assert sorted(fault for faults in f.default_schedule(6).values() for fault in faults) == sorted(f.FAULTS)
    assert f.default_schedule(50)[33] == (f.NAN,)
    assert f.parse_schedule("nan@4,server_kill@4") == {4: (f.NAN, f.SERVER_KILL)}
    with pytest.raises(ValueError, match="FAULT@STEP"):
        f.parse_schedule("oops@2")


def test_an_answer_from_a_version_never_fully_loaded_fails_the_check():
    events = [{"event": "reload_done", "server": A, "step": "step_1", "time": 1.0}]
    assert f.check_versions_loaded(events, [answer(A, 2.0, "step_1"), answer(B, 2.0, "default")], set()).ok
    assert not f.check_versions_loaded(events, [answer(B, 2.0, "step_1")], set()).ok
    assert f.check_versions_loaded(events, [answer(B, 2.0, "old")], {(B, "old")}).ok


def test_a_reload_before_its_step_was_written_fails_the_check():
    steps = [pub(1, 10.0)]  # written from 9.5 to 10.0
    assert f.check_reloads_after_complete([{"event": "reload_started", "step": "step_1", "time": 9.8}], steps).ok
    assert not f.check_reloads_after_complete([{"event": "reload_started", "step": "step_1", "time": 5.0}],
                                              steps).ok
    assert not f.check_reloads_after_complete([{"event": "reload_started", "step": "step_9", "time": 20}],
                                              steps).ok


def test_the_nan_step_check_needs_a_refusal_and_no_load():
    nan, before = pub(4, 40.0, nan=True), pub(3, 30.0)
    refused = [{"event": "reload_failed", "step": "step_4", "time": 41.0, "message": "NaN"}]
    assert f.check_nan(refused, [answer(A, 42.0, "step_3")], nan, before).ok
    assert not f.check_nan([], [], nan, before).ok
    assert not f.check_nan([*refused, {"event": "reload_done", "step": "step_4", "time": 43.0}], [], nan, before).ok


def test_the_killed_server_must_come_back_on_the_newest_step_in_its_first_reload():
    newest = pub(3, 30.0)
    back = [{"event": "reload_done", "server": B, "step": "step_3", "time": 100.0}]
    assert f.check_server_kill(back, B, 90.0, newest, 40.0).ok
    twice = [{"event": "reload_done", "server": B, "step": "step_2", "time": 95.0}, *back]
    assert not f.check_server_kill(twice, B, 90.0, newest, 40.0).ok


def test_the_killed_servers_first_reload_counts_from_watch_seeing_it_back():
    # Killed at 90; `watch` tried it while down (not reached), saw it back at 120, and reloaded it at 125, before
    # the loop's own health check returned (at 130, on a loaded machine): the reload at 125 is the one that counts.
    newest = pub(3, 30.0)
    down = [{"event": "reload_failed", "server": B, "step": "step_3", "time": 91.0},
            {"event": "server_down", "server": B, "time": 91.0},
            {"event": "server_back", "server": B, "time": 120.0}]
    caught_up = [*down, {"event": "reload_done", "server": B, "step": "step_3", "time": 125.0},
                 {"event": "reload_failed", "server": B, "step": "step_4", "time": 140.0}]
    assert f.check_server_kill(caught_up, B, 90.0, newest, 40.0).ok
    refused = [*down, {"event": "reload_failed", "server": B, "step": "step_3", "time": 125.0}]
    assert not f.check_server_kill(refused, B, 90.0, newest, 40.0).ok
    other = [{**e, "server": A} for e in caught_up]
    assert not f.check_server_kill(other, B, 90.0, newest, 40.0).ok
