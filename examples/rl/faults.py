"""The loop's faults on a schedule, and the outcome each must have, checked against what was recorded."""

from __future__ import annotations

from dataclasses import dataclass

from examples.rl.stores import Published
from examples.rl.traffic import Answer

TRAINER_KILL = "trainer_kill"  # the trainer SIGKILLed halfway through saving the step, then saving it again
SERVER_KILL = "server_kill"  # the second server SIGKILLed right after the step is saved, restarted at once
NAN = "nan"  # the step holds a NaN
STORE_DOWN = "store_down"  # the store stopped for a while before the step is saved (bucket and Hub)
FAULTS = (TRAINER_KILL, SERVER_KILL, NAN, STORE_DOWN)


def default_schedule(steps: int) -> dict[int, tuple[str, ...]]:
    """Each fault once, spread over STEPS (at least 5; the NaN step is followed by a clean one)."""
    if steps < 5:
        return {}
    at = {TRAINER_KILL: max(2, steps * 2 // 6), SERVER_KILL: max(3, steps * 3 // 6), NAN: max(4, steps * 4 // 6),
          STORE_DOWN: max(5, steps * 5 // 6)}
    schedule: dict[int, tuple[str, ...]] = {}
    for fault, step in at.items():
        schedule[step] = (*schedule.get(step, ()), fault)
    return schedule


def parse_schedule(text: str) -> dict[int, tuple[str, ...]]:
    """`trainer_kill@2,nan@4` -> {2: ("trainer_kill",), 4: ("nan",)}; `none` -> {}."""
    schedule: dict[int, tuple[str, ...]] = {}
    if text.strip() in ("", "none"):
        return schedule
    for part in text.split(","):
        fault, _, step = part.strip().partition("@")
        if fault not in FAULTS or not step.isdigit():
            raise ValueError(f"{part!r}: expected FAULT@STEP with FAULT one of {', '.join(FAULTS)}")
        schedule[int(step)] = (*schedule.get(int(step), ()), fault)
    return schedule


@dataclass(frozen=True)
class Check:
    """One expected outcome, and whether it held."""

    name: str
    ok: bool
    detail: str


def _of(events: list[dict], kind: str, **match) -> list[dict]:
    return [e for e in events if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]


def check_reloads_after_complete(events: list[dict], published: list[Published]) -> Check:
    """Every reload started with a step the trainer had completed, after it began writing it (a step killed
    mid-save, and written again, was never loaded before it was whole)."""
    began = {p.name: p.saved_at - p.save_s for p in published}
    early = [e for e in _of(events, "reload_started") if e["step"] not in began or e["time"] < began[e["step"]]]
    return Check("incomplete steps never loaded", not early,
                 f"{len(_of(events, 'reload_started'))} reloads, each of a complete step" if not early
                 else f"reloads of incomplete steps: {early[:3]}")


def check_versions_loaded(events: list[dict], answers: list[Answer], initial: set[tuple[str, str | None]]) -> Check:
    """No answer is tagged with a weight version its server had not fully loaded (a reload_done of it, or what it
    held when the run began: INITIAL, (server, version) pairs)."""
    done = {(e["server"], e["step"]) for e in _of(events, "reload_done")} | initial
    wrong = [a for a in answers if any(v != "default" and (a.server, v) not in done for v in a.versions)]
    return Check("answers only from fully loaded versions", not wrong,
                 f"{len(answers)} answers" if not wrong else f"{len(wrong)} answers, such as {wrong[:2]}")


def check_server_kill(events: list[dict], server: str, killed: float, newest: Published, started_s: float) -> Check:
    """The killed server, restarted, came up and caught up with the newest step in one reload.

    Counted from the kill, not from the restart's return: `watch` may see the server answer, and reload it, before
    the loop's own health check does (a loaded machine). Reloads that failed because the killed server did not
    answer are `watch` noticing it down; the first reload after `watch` saw it back is the one that counts."""
    mine = [e for e in events if e.get("server") == server and e["time"] >= killed]
    back = [e["time"] for e in mine if e["event"] == "server_back"]
    since = back[0] if back else killed
    after = sorted((e for e in mine if e["time"] >= since and e["event"] in ("reload_done", "reload_failed")),
                   key=lambda e: e["time"])
    first = after[0] if after else None
    ok = first is not None and first["event"] == "reload_done" and first["step"] == newest.name
    return Check("killed server back on the newest step in one reload", ok,
                 f"restarted in {started_s:.0f} s; then {first['event'] if first else 'nothing'} of "
                 f"{first['step'] if first else '-'} (newest: {newest.name})")


def check_nan(events: list[dict], answers: list[Answer], nan: Published, before: Published) -> Check:
    """The NaN step was refused and skipped; no server loaded it, and no answer came from it."""
    refused = _of(events, "reload_failed", step=nan.name) + _of(events, "step_skipped", step=nan.name)
    loaded = _of(events, "reload_done", step=nan.name)
    answered = [a for a in answers if nan.name in a.versions]
    ok = bool(refused) and not loaded and not answered
    why = refused[0].get("message", "") if refused else "not refused"
    return Check("NaN step refused and skipped", ok,
                 f"{nan.name}: {why[:160]}; servers stayed on {before.name}" if ok
                 else f"refused {len(refused)}, loaded {len(loaded)}, answers {len(answered)}: {why[:160]}")


def check_store_down(events: list[dict], down_at: float, up_at: float, after: Published) -> Check:
    """`watch` reported the store down and back, and the servers then loaded the step saved after it."""
    down = [e for e in _of(events, "source_down") if down_at <= e["time"] <= up_at + 60]
    back = [e for e in _of(events, "source_back") if e["time"] >= down_at]
    caught = _of(events, "reload_done", step=after.name)
    ok = bool(down) and bool(back) and bool(caught)
    return Check("store outage reported and recovered", ok,
                 f"down {len(down)}, back {len(back)}, then {after.name} loaded by {len(caught)} servers")
