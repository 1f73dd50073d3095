"""Reload a live vLLM server under traffic: clients ask `a b = ` while the tool swaps add/multiply.

Client threads send greedy completions of `a b = ` prompts continuously;
meanwhile `layerwise reload --url` (its core function) reloads the debug *add*
and *multiply* models alternately. It checks that no request fails and that
every answer is the multiply or the add answer for its prompt (never torn
weights); a request that ran entirely between two reloads must give the answer
of the model the server held then. It prints requests served, reloads done,
and latency during reloads against idle.

Usage:
    python -m benchmarks.load_test --duration 120 --threads 8          # starts `layerwise serve` on multiply
    python -m benchmarks.load_test --url http://127.0.0.1:8000 --duration 60   # a server already on multiply

Exit status: 0 when every check held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.traffic import Traffic
from layerwise_cli.client.servers.reload_servers import RemoteOptions, reload_server
from layerwise_cli.demo import demo_checkpoint, demo_prompt, expected_answer
from tests.support.server_support import RunningServer


@dataclass
class Sample:
    """One client request."""

    pair: tuple[int, int]
    start: float
    end: float
    text: str | None = None
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class ReloadWindow:
    """One reload as the client saw it: from the call to its return (pause, reload, resume inside)."""

    model: str
    start: float
    end: float
    ok: bool
    error: str | None = None
    paused_s: float = 0.0
    reload_s: float = 0.0
    # From just before the pause request to the resume's answer (generation held back in between).
    pause_start: float = 0.0
    pause_end: float = 0.0


@dataclass
class LoadResult:
    samples: list[Sample] = field(default_factory=list)
    reloads: list[ReloadWindow] = field(default_factory=list)
    # Requests whose answer was neither model's; requests that ran wholly between two
    # reloads and did not give the held model's answer.
    wrong: list[Sample] = field(default_factory=list)
    torn: list[tuple[Sample, str]] = field(default_factory=list)
    # Requests that ran wholly between two reloads (checked against the model held then).
    between: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> list[Sample]:
        return [s for s in self.samples if s.error is not None]

    def during_reload(self, sample: Sample) -> bool:
        """Whether the request overlapped a pause (generation held back for a reload)."""
        return any(sample.start < w.pause_end and sample.end > w.pause_start for w in self.reloads)

    def latencies(self) -> tuple[list[float], list[float]]:
        done = [s for s in self.samples if s.error is None]
        during = sorted(s.latency for s in done if self.during_reload(s))
        idle = sorted(s.latency for s in done if not self.during_reload(s))
        return during, idle

    def summary(self) -> str:
        during, idle = self.latencies()
        ok_reloads = sum(1 for w in self.reloads if w.ok)
        lines = [
            f"requests served: {len(self.samples) - len(self.failed)} ({len(self.failed)} failed) in "
            f"{self.seconds:.1f} s, {len(self.samples) / self.seconds if self.seconds else 0:.1f} req/s",
            f"reloads done:    {ok_reloads} of {len(self.reloads)} (add/multiply alternately); reload "
            f"{_ms(_median([w.reload_s for w in self.reloads]))} median, generation paused "
            f"{_ms(_median([w.paused_s for w in self.reloads]))} median, whole call (checks, pause, reload, "
            f"resume) {_ms(_median([w.end - w.start for w in self.reloads]))} median",
            f"answers:         {len(self.wrong)} neither model's; {len(self.torn)} of {self.between} that ran "
            "wholly between two reloads not the held model's",
            f"latency idle:    p50 {_ms(_pct(idle, 0.5))}, p99 {_ms(_pct(idle, 0.99))} ({len(idle)} requests)",
            f"latency reload:  p50 {_ms(_pct(during, 0.5))}, p99 {_ms(_pct(during, 0.99))} ({len(during)} requests "
            "overlapping a pause for a reload)",
        ]
        return "\n".join(lines)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def _median(values: list[float]) -> float | None:
    return _pct(sorted(values), 0.5)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def run_load(url: str, sources: dict[str, str], *, first: str = "multiply", threads: int = 4,
             min_reloads: int = 10, max_seconds: float = 60.0, idle_seconds: float = 3.0,
             interval: float = 0.2, api_key: str | None = None, pause_mode: str = "wait",
             keep_reloading: bool = False) -> LoadResult:
    """Traffic against `url` while reloading the models in `sources` alternately.

    Args:
        url: a server already serving `sources[first]`, with layerwise's extension.
        sources: model name (`multiply`, `add`) -> checkpoint path as the server sees it.
        first: the model the server holds at the start.
        threads: client threads (one request at a time each), in a process of their own (`Traffic`).
        min_reloads: reloads to do (at least; more with `keep_reloading` until `max_seconds`).
        max_seconds: stop reloading after this long, even with fewer reloads.
        idle_seconds: traffic without reloads before the first and after the last, for idle latency.
        interval: seconds between two reloads.
        api_key: the server's API key, if any.
        pause_mode: passed to the reload.
        keep_reloading: go on reloading until `max_seconds` (the long form).

    Returns:
        Every request and reload, and the checks' findings.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model_id = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    result = LoadResult()
    pair_of = {demo_prompt(a, b): (a, b) for a in range(10) for b in range(10)}
    traffic = Traffic(url, {"model": model_id, "max_tokens": 4, "temperature": 0.0}, list(pair_of),
                      threads=threads, headers=headers, timeout=120).start()
    try:
        assert traffic.all_ready.wait(120), "not every client got an answer within 120 s"
        began = time.monotonic()
        time.sleep(idle_seconds)
        names = [first] + [name for name in sources if name != first]
        deadline = began + idle_seconds + max_seconds
        index = 0
        while time.monotonic() < deadline and (index < min_reloads or keep_reloading):
            model = names[(index + 1) % len(names)]
            events: dict[str, float] = {}
            start = time.monotonic()
            outcome = reload_server(url, sources[model], RemoteOptions(api_key=api_key, pause_mode=pause_mode),
                                    # Called during this iteration only: binding `events` late is fine.
                                    on_event=lambda event: events.setdefault(event.kind, time.monotonic()))  # noqa: B023
            end = time.monotonic()
            result.reloads.append(ReloadWindow(
                model=model, start=start, end=end, ok=outcome.ok, error=outcome.error,
                paused_s=outcome.paused_s, reload_s=outcome.report.wall_s if outcome.report else 0.0,
                pause_start=events.get("checked", start), pause_end=events.get("resumed", end)))
            index += 1
            time.sleep(interval)
        time.sleep(idle_seconds)
    finally:
        requests = traffic.stop()
    result.samples = [Sample(pair_of[r.prompt], r.start, r.end, None if r.text is None else r.text.strip(), r.error)
                      for r in requests if r.start >= began]
    result.seconds = time.monotonic() - began

    # The model held between reloads: `first`, then each successful reload's model.
    segments: list[tuple[float, float, str]] = []
    held, since = first, began
    for window in result.reloads:
        segments.append((since, window.start, held))
        held = window.model if window.ok else "?"
        since = window.end
    segments.append((since, float("inf"), held))
    for sample in result.samples:
        if sample.error is not None:
            continue
        answers = {expected_answer(name, *sample.pair) for name in sources}
        if sample.text not in answers:
            result.wrong.append(sample)
            continue
        for start, end, model in segments:
            if start <= sample.start and sample.end <= end and model != "?":
                result.between += 1
                if sample.text != expected_answer(model, *sample.pair):
                    result.torn.append((sample, model))
                break
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a server already serving the debug multiply model (default: start one)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of reloading (default 120)")
    parser.add_argument("--threads", type=int, default=8, help="client threads (default 8)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between reloads (default 1)")
    parser.add_argument("--min-reloads", type=int, default=10, help="reloads at least (default 10)")
    parser.add_argument("--pause-mode", default="wait", choices=["wait", "keep", "abort", "none"])
    parser.add_argument("--idle", type=float, default=5.0, help="idle seconds before and after (default 5)")
    parser.add_argument("--api-key", default=os.environ.get("LAYERWISE_API_KEY"))
    args = parser.parse_args()

    sources = {name: str(demo_checkpoint(name)) for name in ("multiply", "add")}
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            print("starting layerwise serve on multiply ...", file=sys.stderr)
            url = stack.enter_context(RunningServer(sources["multiply"], extra=["--max-model-len", "64"])).url
        result = run_load(url, sources, threads=args.threads, min_reloads=args.min_reloads,
                          max_seconds=args.duration, idle_seconds=args.idle, interval=args.interval,
                          api_key=args.api_key,
                          pause_mode=args.pause_mode, keep_reloading=True)
    print(result.summary())
    for sample in result.failed[:5]:
        print(f"failed: {sample.pair}: {sample.error}")
    for sample in result.wrong[:5]:
        print(f"neither model's answer: {sample.pair} -> {sample.text!r}")
    for sample, model in result.torn[:5]:
        print(f"not the held model's ({model}) answer: {sample.pair} -> {sample.text!r}")
    for window in result.reloads:
        if not window.ok:
            print(f"reload of {window.model} failed: {window.error}")
    ok = (not result.failed and not result.wrong and not result.torn and len(result.reloads) >= args.min_reloads
          and all(w.ok for w in result.reloads))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
