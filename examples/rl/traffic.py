"""The loop's client: completions sent to the servers the whole run, each answer recorded with its weight version.

Client threads share the servers round robin, as a load balancer in front of them does: a server the loop has
taken out (killed, restarting) gets no new requests, and a request that was in flight on it when it died is
sent again to another server (counted as retried, not failed). Every other error is a failed request.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass

import httpx

VERSION_HEADER = "x-weight-versions"  # layerwise serve names the weights of every answer here
THINK_S = 0.05  # between an answer and the thread's next request


@dataclass(frozen=True)
class Answer:
    """One request: when it was sent and answered, by which server, with which weights, and what it said."""

    sent: float
    done: float
    server: str
    versions: tuple[str, ...]  # the weight versions that produced its tokens, in order (one, unless it spans a reload)
    prompt: str
    text: str


@dataclass(frozen=True)
class Failure:
    time: float
    server: str
    error: str
    retried: bool  # the server had been taken out: sent again elsewhere


class Traffic:
    """THREADS client threads sending greedy completions of PROMPTS to the servers that are in."""

    def __init__(self, urls: list[str], model: str, prompts: list[str], threads: int = 2, max_tokens: int = 2) -> None:
        self.urls = list(urls)
        self.model = model
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.answers: list[Answer] = []
        self.failures: list[Failure] = []
        self._out: set[str] = set()
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def take_out(self, url: str) -> None:
        """No new requests to URL (it is about to be killed, or restarting)."""
        with self._lock:
            self._out.add(url)

    def put_back(self, url: str) -> None:
        with self._lock:
            self._out.discard(url)

    def _pick(self) -> str | None:
        with self._lock:
            serving = [url for url in self.urls if url not in self._out]
        return serving[next(self._turn) % len(serving)] if serving else None

    def _run(self, index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                url = self._pick()
                if url is None:
                    time.sleep(0.1)
                    continue
                self._one(client, url, rng.choice(self.prompts))
                time.sleep(THINK_S)

    def _one(self, client: httpx.Client, url: str, prompt: str) -> None:
        sent = time.time()
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0}
        try:
            response = client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            with self._lock:
                retried = url in self._out
            self.failures.append(Failure(time.time(), url, f"{type(exc).__name__}: {exc}", retried))
            return
        header = response.headers.get(VERSION_HEADER, "")
        versions = tuple(v for v in header.split(",") if v)
        text = response.json()["choices"][0]["text"].strip()
        self.answers.append(Answer(sent, time.time(), url, versions, prompt, text))

    @property
    def failed(self) -> list[Failure]:
        """Requests that got no answer from a server that was in."""
        return [f for f in self.failures if not f.retried]
