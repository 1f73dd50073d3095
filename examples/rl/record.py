"""The record of an RL run: every step's save, and per server its step-to-serve latency and pause, from what was
measured (the trainer's clock, the servers' answers and `/metrics`, `watch`'s events)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

from examples.rl.stores import Published
from examples.rl.traffic import Answer, Failure


@dataclass(frozen=True)
class ServerStep:
    """One server and one step.

    Attributes:
        serve_s: from the trainer's save returning to the server's first answer with this step; None: it never
            answered with it (passed over, refused, or down).
        paused_s: what the server's `layerwise_pause_seconds` histogram grew by for this step's reload.
        reload_s: the apply: the reload's time in the server with the step's bytes on its host (`watch`'s
            reload_done report: its plan phase and its wall time).
        drain_s: the first part of the pause (`layerwise_pause_drain_seconds`): the in-flight requests
            finishing (pause mode `wait`: served, new ones held).
        stalled_s: what the server's `layerwise_engine_stall_seconds` grew by: the reload's time inside the
            engine core, where no scheduler step runs, paused or not.
    """

    server: str
    serve_s: float | None
    paused_s: float | None
    reload_s: float | None
    drain_s: float | None = None
    stalled_s: float | None = None

    @property
    def stopped_s(self) -> float | None:
        """The time the server generated nothing for this step: the pause less its drain; where nothing paused
        it (pause mode `none`: the engine takes the reload between two of its steps), the reload's hold on the
        engine core."""
        if self.paused_s:
            return None if self.drain_s is None else self.paused_s - self.drain_s
        return self.stalled_s


@dataclass(frozen=True)
class StepRecord:
    """One step: the trainer's save, what each server did with it, the requests while it was the newest."""

    step: int
    name: str
    kind: str
    save_s: float
    written_bytes: int
    full_bytes: int
    nan: bool
    servers: tuple[ServerStep, ...]
    served: int  # requests answered while this step was the newest
    failed: int  # requests that got no answer in that time (from a server that was in)

    @property
    def apply_s(self) -> float | None:
        """The step's apply: its slowest server's (None when no server reported one)."""
        applied = [s.reload_s for s in self.servers if s.reload_s is not None]
        return max(applied) if applied else None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunRecord:
    """The whole run: the steps, the answers per step, the staleness of each answer, the checks of the faults."""

    steps: tuple[StepRecord, ...]
    answers_per_step: dict[int, int]
    staleness: dict[int, int]  # steps behind the newest -> answers
    checks: dict[str, str] = field(default_factory=dict)  # fault -> what was checked and its outcome
    start_lines: dict[str, list[str]] = field(default_factory=dict)  # server -> its start lines (CPU cores)

    def figures(self) -> dict:
        """Step-to-serve and pause per step (p50, p95), bytes per step against the full step, the pause's drain
        and the rest (stopped: generating nothing), the engine core's hold, and each against the step's apply.

        The apply of a step is its slowest server's (`ServerStep.reload_s`): an all-or-nothing fleet resumes
        every server together, once the last one has applied it.
        """
        later = [r for r in self.steps if r.step > 0]
        serve = [s.serve_s for r in later for s in r.servers if s.serve_s is not None]
        pause = [s.paused_s for r in later for s in r.servers if s.paused_s is not None]
        saves = [r.save_s for r in later]
        written = [r.written_bytes / r.full_bytes for r in later if r.full_bytes]
        paused, stopped, stalled = (_with_apply(later, name) for name in ("paused_s", "stopped_s", "stalled_s"))
        return {"serve_s": percentiles(serve), "pause_s": percentiles(pause), "save_s": percentiles(saves),
                "bytes_over_full": percentiles(written),
                "drain_s": percentiles([s.drain_s for s, _ in paused if s.drain_s is not None]),
                "stopped_s": percentiles([s.stopped_s for s, _ in stopped]),
                "stalled_s": percentiles([s.stalled_s for s, _ in stalled]),
                "apply_s": percentiles([r.apply_s for r in later if r.apply_s]),
                "pause_over_apply": percentiles([s.paused_s / apply for s, apply in paused]),
                "stopped_over_apply": percentiles([s.stopped_s / apply for s, apply in stopped]),
                "stalled_over_apply": percentiles([s.stalled_s / apply for s, apply in stalled])}


def _with_apply(steps: list[StepRecord], name: str) -> list[tuple[ServerStep, float]]:
    """Each server of STEPS whose figure NAME is known, with its step's apply, for the steps that have one."""
    return [(s, r.apply_s) for r in steps for s in r.servers if getattr(s, name) is not None and r.apply_s]


def percentiles(values: list[float]) -> dict:
    """p50 and p95 (nearest rank) and the count; None where there are no values."""
    if not values:
        return {"p50": None, "p95": None, "n": 0}
    ordered = sorted(values)
    rank = max(0, math.ceil(0.95 * len(ordered)) - 1)
    return {"p50": statistics.median(ordered), "p95": ordered[rank], "n": len(ordered)}


def answer_steps(answers: list[Answer], step_of) -> list[tuple[Answer, int | None]]:
    """Each answer with the step its (last) weight version names (None: a version no step has)."""
    return [(a, step_of(a.versions[-1] if a.versions else None)) for a in answers]


def newest_at(published: list[Published], when: float) -> int:
    """The newest step the trainer had saved by WHEN (0 before any)."""
    return max((p.step for p in published if p.saved_at <= when), default=0)


def build_record(published: list[Published], answers: list[Answer], failures: list[Failure], urls: list[str],
                 step_of, pauses: dict[tuple[str, int], float], reloads: dict[tuple[str, int], float],
                 drains: dict[tuple[str, int], float] | None = None,
                 stalls: dict[tuple[str, int], float] | None = None) -> RunRecord:
    """The run's record from what the loop measured.

    Args:
        published: every step the trainer saved, in order.
        answers: every answer, with its weight versions.
        failures: every request that got no answer.
        urls: the servers.
        step_of: weight version -> step number (the store's naming).
        pauses: (server, step) -> paused seconds from the server's metrics.
        reloads: (server, step) -> the apply's seconds (the reload's plan and wall time) from `watch`.
        drains: (server, step) -> the pause's drain seconds from the server's metrics.
        stalls: (server, step) -> the reload's seconds inside the engine core, from the server's metrics.
    """
    tagged = answer_steps(answers, step_of)
    first: dict[tuple[str, int], float] = {}
    for answer, step in tagged:
        if step is not None:
            key = (answer.server, step)
            first[key] = min(first.get(key, answer.done), answer.done)
    records = []
    for index, pub in enumerate(published):
        until = published[index + 1].saved_at if index + 1 < len(published) else float("inf")
        servers = tuple(
            ServerStep(url, _since(first.get((url, pub.step)), pub.saved_at), pauses.get((url, pub.step)),
                       reloads.get((url, pub.step)), (drains or {}).get((url, pub.step)),
                       (stalls or {}).get((url, pub.step)))
            for url in urls)
        served = sum(1 for a in answers if pub.saved_at <= a.done < until)
        failed = sum(1 for f in failures if not f.retried and pub.saved_at <= f.time < until)
        records.append(StepRecord(pub.step, pub.name, pub.kind, pub.save_s, pub.written_bytes, pub.full_bytes,
                                  pub.nan, servers, served, failed))
    per_step = Counter(step for _, step in tagged if step is not None)
    stale = Counter(newest_at(published, a.sent) - step for a, step in tagged if step is not None)
    return RunRecord(tuple(records), dict(sorted(per_step.items())), dict(sorted(stale.items())))


def _since(when: float | None, saved_at: float) -> float | None:
    return None if when is None else max(0.0, when - saved_at)
