"""One RL run: the trainer writes a step, `layerwise watch` brings the two servers to it under traffic, faults
strike on schedule; every step, answer and watch event is recorded, and each fault's outcome checked."""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from examples.rl import faults as f
from examples.rl.fleet import Fleet, PauseMeter, weight_version
from examples.rl.proof import prove, sample, write_full_step
from examples.rl.record import RunRecord, build_record
from examples.rl.stores import Published
from examples.rl.traffic import Traffic
from examples.rl.trainers import Trainer, with_nan
from tests.support.watch_support import WatchProcess

KILLED = 1  # the server the SERVER_KILL fault kills (the other serves meanwhile)


@dataclass(frozen=True)
class LoopOptions:
    """How the run goes.

    Attributes:
        steps: steps after step 0 (the starting weights, written in full).
        schedule: step -> the faults that strike at it (`faults.default_schedule`).
        outage_s: how long the store is down (STORE_DOWN).
        step_timeout_s: how long the servers get to reach each step.
        gap_s: traffic on each step before the trainer writes the next.
        threads: client threads.
        interval: seconds between two listings of the run by `watch`.
        proof_steps: steps at which each server is verified and compared with a fresh engine (after the run).
        pause_mode: how `watch` pauses the servers for a reload (`wait`: in-flight requests finish first;
            `keep`: they are frozen where they are and go on with the new weights, no drain inside the pause;
            `none`: no pause, each engine takes the reload between two of its steps).
    """

    steps: int = 6
    schedule: dict[int, tuple[str, ...]] = field(default_factory=lambda: f.default_schedule(6))
    outage_s: float = 15.0
    step_timeout_s: float = 600.0
    gap_s: float = 1.0
    threads: int = 2
    interval: float = 0.2
    proof_steps: tuple[int, ...] = ()
    pause_mode: str = "wait"


class Run:
    """The run's state while it goes: what was published, the watcher, the traffic, the checks."""

    def __init__(self, trainer: Trainer, store, fleet: Fleet, options: LoopOptions, out: Path,
                 prompts: list[str]) -> None:
        self.trainer, self.store, self.fleet, self.options, self.out = trainer, store, fleet, options, out
        self.prompts = prompts
        self.published: list[Published] = []
        self.good: Published | None = None  # the newest step the servers must reach
        self.pauses = PauseMeter()
        self.reloads: dict[tuple[str, int], float] = {}
        self.seen_events = 0
        self.checks: list[f.Check] = []
        self.later: list = []  # (events, answers) -> Check, for the faults' outcomes once the run is over
        self.marks: list[dict] = []  # the loop's own events (faults, restarts), for the JSONL and the timeline
        self.watch: WatchProcess | None = None
        self.traffic: Traffic | None = None
        self.samples: list = []
        self.began = time.time()

    def mark(self, event: str, **data) -> None:
        """Record one of the loop's own events, and say it on stderr."""
        self.marks.append({"event": event, "time": time.time(), **data})
        shown = " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in data.items())
        print(f"{time.strftime('%H:%M:%S')} {event} {shown}", file=sys.stderr, flush=True)

    def run(self) -> RunRecord:
        self.out.mkdir(parents=True, exist_ok=True)
        urls = self.fleet.urls
        for index, url in enumerate(urls):
            self.mark("server_started", server=url, line=(self.fleet.start_lines(index) or ["?"])[-1])
        # What the servers hold before the run (another run's step, when servers are shared): loaded, and counted.
        self.initial = {(url, weight_version(url)) for url in urls}
        for url in urls:
            self.pauses.restarted(url, fleet_total=True)
        self.publish(0, self.trainer.tensors())
        self.watch = WatchProcess(
            self.store.watch_root, *(a for u in urls for a in ("--url", u)), "--marker", "STABLE", "--settle", "0",
            "--interval", str(self.options.interval), "--log", str(self.out / "watch.jsonl"),
            "--pause-mode", self.options.pause_mode, env=self.store.env)
        model = self.fleet.servers[0].model
        try:
            with Traffic(urls, model, self.prompts, threads=self.options.threads) as traffic:
                self.traffic = traffic
                # The run begins once every server holds step 0 (by its name: another run's newer step, on
                # shared servers, may bear a later number); earlier answers are that run's.
                self.wait_served(exact=True)
                self.began = time.time()
                for step in range(1, self.options.steps + 1):
                    self.one_step(step)
                time.sleep(self.options.gap_s)
                self.take_events()
        finally:
            self.watch.finish(signal.SIGTERM)  # also when the run failed: a watch left behind polls on
        if self.samples:
            self.checks += prove(self.samples, self.prompts)
        return self.record()

    def publish(self, step: int, tensors, *, nan: bool = False) -> Published:
        pub = self.store.publish(step, tensors, nan=nan)
        self.published.append(pub)
        self.mark("step_saved", step=pub.name, number=step, save_s=pub.save_s, bytes=pub.written_bytes,
                  kind=pub.kind, nan=nan)
        if not nan:
            self.good = pub
        return pub

    def one_step(self, step: int) -> None:
        faults = self.options.schedule.get(step, ())
        down = None
        if f.STORE_DOWN in faults:
            down = time.time()
            self.mark("store_down", seconds=self.options.outage_s)
            if not self.store.outage(self.options.outage_s):
                down = None
            self.mark("store_back")
        self.trainer.step()
        tensors = self.trainer.tensors()
        if f.TRAINER_KILL in faults:
            self.mark("trainer_killed", number=step)
            self.store.publish_killed(step, tensors)
        before = self.good
        pub = self.publish(step, with_nan(tensors) if f.NAN in faults else tensors, nan=f.NAN in faults)
        if f.SERVER_KILL in faults:
            self.kill_server(pub)
        self.wait_served(nan=pub if pub.nan else None)
        self.mark("step_served", step=self.good.name)
        if step in self.options.proof_steps and not pub.nan:
            self.take_sample(pub, tensors)
        # Checked at the end: `watch` logs a reload once its call returns, after the server answers with it.
        if pub.nan:
            self.later.append(lambda events, answers: f.check_nan(events, answers, pub, before))
        if down is not None:
            up = time.time()
            self.later.append(lambda events, answers: f.check_store_down(events, down, up, pub))
        time.sleep(self.options.gap_s)

    def take_sample(self, pub: Published, tensors) -> None:
        """Verify every server on PUB and keep what it holds, for the fresh engine after the run."""
        folder = write_full_step(self.out / "proof" / pub.name, tensors, self.trainer.config, self.trainer.start)
        self.samples.append(sample(pub.step, pub.name, self.store.source_of(pub), folder, self.fleet.urls,
                                   self.fleet.servers[0].model, self.prompts))
        self.mark("step_sampled", step=pub.name)

    def kill_server(self, newest: Published) -> None:
        url = self.fleet.urls[KILLED]
        self.traffic.take_out(url)
        self.mark("server_killed", server=url)
        killed = time.time()
        took = self.fleet.kill_and_restart(KILLED)
        self.pauses.restarted(url)
        self.mark("server_restarted", server=url, start_s=took, line=self.fleet.start_lines(KILLED)[-1])
        self.traffic.put_back(url)
        self.wait_served()
        newest = self.good
        self.later.append(lambda events, answers: f.check_server_kill(events, url, killed, newest, took))

    def events(self) -> list[dict]:
        return list(self.watch.events)

    def wait_served(self, nan: Published | None = None, *, exact: bool = False) -> None:
        """Until every server answers with the newest good step or a later one (EXACT: that step, by name), and,
        for a NaN step, `watch` refused it."""
        deadline = time.monotonic() + self.options.step_timeout_s
        target = self.store.step_of(self.good.name)
        while time.monotonic() < deadline:
            self.take_events()
            versions = [weight_version(url) for url in self.fleet.urls]
            held = [self.store.step_of(v) if not exact or v == self.good.name else None for v in versions]
            refused = nan is None or any(e.get("step") == nan.name and e["event"] in ("reload_failed", "step_skipped")
                                         for e in self.events())
            if refused and all(h is not None and h >= target for h in held):
                self.take_events()
                return
            if self.watch.proc.poll() is not None:
                raise RuntimeError(f"watch exited ({self.watch.proc.returncode}): {self.watch.finish()}")
            time.sleep(0.2)
        raise TimeoutError(f"the servers did not reach {self.good.name} in {self.options.step_timeout_s:.0f} s; "
                           f"watch's last events: {self.events()[-8:]}")

    def take_events(self) -> None:
        """Read the pause metrics of each server that finished a reload since the last call."""
        events = self.events()
        for event in events[self.seen_events:]:
            if event["event"] == "reload_done":
                step = self.store.step_of(event["step"])
                if step is not None:
                    self.pauses.reloaded(event["server"], step)
                    if event.get("wall_s") is not None:
                        # The apply: the reload's plan phase and wall time in the server.
                        report = (event.get("report") or {}).get("report") or {}
                        self.reloads[(event["server"], step)] = event["wall_s"] + (report.get("plan_s") or 0.0)
        self.seen_events = len(events)

    def record(self) -> RunRecord:
        events = self.events()
        answers = [a for a in self.traffic.answers if a.done >= self.began]
        self.checks += [check(events, answers) for check in self.later]
        self.checks.append(f.check_reloads_after_complete(events, self.published))
        self.checks.append(f.check_versions_loaded(events, answers, self.initial))
        failures = [x for x in self.traffic.failures if x.time >= self.began]
        record = build_record(self.published, answers, failures, self.fleet.urls, self.store.step_of,
                              self.pauses.pauses, self.reloads, self.pauses.drains, self.pauses.stalls)
        checks = {c.name: ("ok: " if c.ok else "FAILED: ") + c.detail for c in self.checks}
        lines = {url: self.fleet.start_lines(i) for i, url in enumerate(self.fleet.urls)}
        record = RunRecord(record.steps, record.answers_per_step, record.staleness, checks, lines)
        self.write_events(events)
        return record

    def write_events(self, events: list[dict]) -> None:
        """Every event of the run in time order, one JSON object a line: the loop's, watch's, each answer."""
        rows = [*self.marks, *events]
        rows += [{"event": "answer", "time": a.done, "sent": a.sent, "server": a.server,
                  "versions": list(a.versions), "prompt": a.prompt, "text": a.text} for a in self.traffic.answers]
        rows += [{"event": "request_failed", "time": x.time, "server": x.server, "error": x.error,
                  "retried": x.retried} for x in self.traffic.failures]
        with open(self.out / "events.jsonl", "w") as handle:
            for row in sorted(rows, key=lambda r: r["time"]):
                handle.write(json.dumps(row) + "\n")
