"""Helpers of the `layerwise watch` proof: a test trainer, client threads, the watcher as a subprocess."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx

from layerwise_cli.demo import demo_prompt, expected_answer
from tests.support.server_support import LAYERWISE, ROOT, RunningServer

# The watcher runs this checkout's code (also when the installed package is another checkout's).
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
MARKER = "STABLE"
PAIRS = [(a, b) for a in range(10) for b in range(10)]
# Between a client's answer and its next request: requests still overlap every pause, and the servers leave
# the 2-core CI machine some room.
THINK_S = 0.05


def answer(name: str, a: int, b: int) -> str:
    return expected_answer(name, a, b)


def weight_version(url: str) -> str | None:
    return httpx.get(f"{url}/weight_info", timeout=30).json()["weight_version"]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


class Trainer:
    """Writes step directories into ROOT the ways trainers do, recording when each became complete."""

    def __init__(self, root: Path, sources: dict[str, Path]) -> None:
        self.root = root
        self.sources = sources
        self.completed_at: dict[str, float] = {}
        self.model_of: dict[str, str] = {}

    def write(self, name: str, model: str, *, delay: float = 0.0, index_first: bool = False,
              marker: bool = True) -> Path:
        """Copy MODEL's shards into ROOT/NAME; with DELAY, each shard is half on disk for DELAY/2 s.

        INDEX_FIRST: the index is written before the shards (the shards it lists are incomplete for a while);
        else last. MARKER: the marker file is written last of all.
        """
        src, dst = self.sources[model], self.root / name
        dst.mkdir()
        for path in sorted(src.iterdir()):
            if not path.name.endswith((".safetensors", "index.json")):
                shutil.copy2(path, dst / path.name)
        index = src / "model.safetensors.index.json"
        if index_first:
            shutil.copy2(index, dst / index.name)
        for shard in sorted(src.glob("*.safetensors")):
            data = shard.read_bytes()
            with open(dst / shard.name, "wb") as f:
                f.write(data[: len(data) // 2])  # half a shard is on disk for a while
                f.flush()
                time.sleep(delay / 2)
                f.write(data[len(data) // 2:])
            time.sleep(delay / 2)
        if not index_first:
            shutil.copy2(index, dst / index.name)
        self.completed_at[name] = time.time()  # every weight is on disk
        self.model_of[name] = model
        log(f"wrote {name} ({model})")
        if marker:
            (dst / MARKER).touch()  # last
        return dst

    def delete_older_than(self, number: int) -> None:
        """What prime-rl does: remove its own old steps, whoever may be loading them."""
        for path in self.root.iterdir():
            if path.name.startswith("step_") and int(path.name.split("_")[1]) < number:
                shutil.rmtree(path, ignore_errors=True)


class Clients:
    """One thread per server sending greedy requests the whole time; every answer and failure recorded."""

    def __init__(self, servers: list[RunningServer]) -> None:
        self.servers = servers
        self.answers: list[tuple[str, int, int, str]] = []
        self.failures: list[str] = []
        self.paused = {s.url: threading.Event() for s in servers}  # set: leave that server alone
        self.idle = {s.url: threading.Event() for s in servers}  # set: paused, and no request in flight
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in servers]

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def pause(self, server: RunningServer) -> None:
        """Stop sending to SERVER; returns once its last request is answered."""
        self.paused[server.url].set()
        assert self.idle[server.url].wait(timeout=120), f"{server.url}: a request did not end within 120 s"

    def resume(self, server: RunningServer) -> None:
        self.idle[server.url].clear()
        self.paused[server.url].clear()

    def wrong(self) -> list[tuple[str, int, int, str]]:
        """Answers that are neither add's nor multiply's."""
        return [(url, x, y, text) for url, x, y, text in self.answers
                if text not in (answer("add", x, y), answer("multiply", x, y))]

    def _run(self, server: RunningServer) -> None:
        rng = random.Random(server.port)
        while not self._stop.is_set():
            if self.paused[server.url].is_set():
                self.idle[server.url].set()
                time.sleep(0.05)
                continue
            a, b = rng.choice(PAIRS)
            try:
                text = server.complete(demo_prompt(a, b), timeout=120)["text"].strip()
                self.answers.append((server.url, a, b, text))
                time.sleep(THINK_S)
            except Exception as exc:  # noqa: BLE001 - recorded, asserted on
                self.failures.append(f"{time.strftime('%H:%M:%S')} {server.url}: {type(exc).__name__}: {exc}")


class WatchProcess:
    """`layerwise watch ... --json` as a real subprocess; its events read as they come."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        """Start `layerwise watch ARGS --json`, with ENV's variables added to the test's (e.g. `HF_ENDPOINT`)."""
        self.proc = subprocess.Popen([LAYERWISE, "watch", *args, "--json"], cwd=ROOT, env={**ENV, **(env or {})},
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.events: list[dict] = []
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def of(self, kind: str, **match) -> list[dict]:
        return [e for e in list(self.events)
                if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]

    def wait_for(self, kind: str | tuple[str, ...], timeout: float = 120, **match) -> dict:
        kinds = (kind,) if isinstance(kind, str) else kind

        def found_now() -> list[dict]:
            return [e for k in kinds for e in self.of(k, **match)]

        try:
            wait_until(lambda: found_now() or self.proc.poll() is not None, timeout, f"{kind} {match}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the watcher's last events: {self.events[-12:]}") from None
        found = found_now()
        assert found, f"watch exited ({self.proc.returncode}) before {kind} {match}: {self.finish()}"
        log(f"{kind} {match}")
        return found[0]

    def finish(self, sig: int | None = None, timeout: float = 120) -> int:
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(timeout=10)
        self.stderr = self.proc.stderr.read() if self.proc.stderr else ""
        return code


def held_at(events: list[dict], server: str, when: float) -> set[str]:
    """What SERVER held or was loading at WHEN, by the log: the last reload_done before it, and any reload in flight."""
    held: set[str] = set()
    loading: set[str] = set()
    for e in sorted(events, key=lambda e: e["time"]):
        if e["time"] > when or e.get("server") != server:
            continue
        if e["event"] == "reload_started":
            loading.add(e["step"])
        elif e["event"] in ("reload_done", "reload_failed"):
            loading.discard(e["step"])
            if e["event"] == "reload_done":
                held = {e["step"]}
    return held | loading
