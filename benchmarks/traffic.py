"""Client traffic against a vLLM server: threads in a process of their own posting completions until stopped.

The one traffic generator of the benchmarks and the tests (`benchmarks/load_test.py`,
`tests/test_traffic_server.py`, the pause-mode tests in `tests/test_serve_server.py`). The clients run in
another process so that their threads do not starve the caller's (the tool's requests,
the reloads) of the GIL; `time.monotonic()` is one clock for all processes on Linux, so
their request times compare with the caller's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass

# Runs in the client process: argv[1] is the JSON config; one JSON line per event on stdout;
# a line on stdin stops it.
_CLIENT = """
import json, random, sys, threading, time
import httpx

config = json.loads(sys.argv[1])
stop = threading.Event()
lock = threading.Lock()

def emit(*event):
    with lock:
        print(json.dumps(event), flush=True)

def loop(index):
    rng = random.Random(index)
    first = True
    while not stop.is_set():
        prompt = rng.choice(config["prompts"])
        emit("sent", index)
        start = time.monotonic()
        try:
            # A connection per request, as most clients of a shared endpoint: a kept-alive connection
            # that the server closed while idle fails the next request on it ("Server disconnected"),
            # which is the client's pooling, not the reload.
            response = httpx.post(config["url"], json={**config["body"], "prompt": prompt},
                                  headers=config["headers"], timeout=config["timeout"])
            response.raise_for_status()
            choice = response.json()["choices"][0]
            reason, text, error = choice["finish_reason"], choice["text"], None
        except Exception as exc:  # every failure is counted
            reason, text, error = None, None, f"{type(exc).__name__}: {exc}"
        emit("done", index, prompt, start, time.monotonic(), reason, text, error)
        if first:
            emit("ready", index)
            first = False
        if config["once"]:
            return

threads = [threading.Thread(target=loop, args=(i,)) for i in range(config["threads"])]
for thread in threads:
    thread.start()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
for thread in threads:
    thread.join()
"""


@dataclass(frozen=True)
class Request:
    """One completion request as its client saw it."""

    prompt: str
    start: float  # time.monotonic() when sent
    end: float  # ... when the answer (or the failure) came back
    finish_reason: str | None  # the first choice's; None when the request failed
    text: str | None
    error: str | None = None  # "ExceptionType: message" when it failed

    @property
    def latency(self) -> float:
        return self.end - self.start


class Traffic:
    """Client threads sending completions of `prompts` back to back, one request at a time each, until `stop`.

    Args:
        url: the server's base URL.
        body: the request body without the prompt (model, max_tokens, temperature, ...).
        prompts: each request's prompt is drawn from these (seeded per thread: the same run repeats).
        threads: client threads.
        headers: HTTP headers (an API key).
        once: each thread sends one request and ends.
        timeout: seconds per request.
    """

    def __init__(self, url: str, body: dict, prompts: list[str], *, threads: int,
                 headers: dict[str, str] | None = None, once: bool = False, timeout: float = 300.0) -> None:
        config = {"url": f"{url}/v1/completions", "body": body, "prompts": prompts, "threads": threads,
                  "headers": headers or {}, "once": once, "timeout": timeout}
        self.threads = threads
        self.once = once
        self.done: list[Request] = []  # grows while the traffic runs
        self.sent = 0
        self.first_done = threading.Event()
        self.all_ready = threading.Event()  # every thread has had its first answer
        self._ready: set[int] = set()
        self._proc = subprocess.Popen([sys.executable, "-c", _CLIENT, json.dumps(config)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            kind, *data = json.loads(line)
            if kind == "sent":
                self.sent += 1
            elif kind == "done":
                _, prompt, start, end, reason, text, error = data
                self.done.append(Request(prompt, start, end, reason, text, error))
                self.first_done.set()
            elif kind == "ready":
                self._ready.add(data[0])
                if len(self._ready) == self.threads:
                    self.all_ready.set()

    def start(self) -> Traffic:
        """Start reading the clients' events (the clients start at once); returns self."""
        self._reader.start()
        return self

    def stop(self) -> list[Request]:
        """Let every thread finish its request, end the process, and return every request, in order of answer."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write("stop\n")
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        self._proc.wait(timeout=300)
        self._reader.join(timeout=60)
        return self.done
