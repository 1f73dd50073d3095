"""Real vLLM server processes for tests: automatic loopback port, polled on /health, terminated then killed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from layerwise_cli.demo import demo_prompt
from layerwise_cli.engine_cpus import MULTIPROCESSING_ENV

ROOT = Path(__file__).resolve().parents[2]  # the repository root
LAYERWISE = str(Path(sys.executable).with_name("layerwise"))
# Tiny debug models: a small context.
SMALL = ["--max-model-len", "64", "--max-num-seqs", "8"]
# A small explicit KV cache (64 MiB: about 130k tokens of the debug models), so that several servers fit
# beside other work; on CPU, vLLM's memory fraction is of host RAM and must also cover the process itself.
KV_CACHE = ["--kv-cache-memory-bytes", str(64 * 2**20)]
# Starts of one server when a port it binds was taken first by another process (`RunningServer.start`).
PORT_TRIES = 3
T = TypeVar("T")
# A single-rank engine with its worker inside its engine-core process (vLLM's layout for one rank on a GPU).
# The CPU backend gives the worker a process of its own unless this is 0, and each spawned process imports vLLM
# and torch again: about 8 of a server's 25 CPU seconds to start. With the worker inside, nothing binds its
# OpenMP threads (vLLM binds them as it spawns a worker process): one thread, as a worker bound to one core has.
WORKER_IN_ENGINE_CORE = {MULTIPROCESSING_ENV: "0", "OMP_NUM_THREADS": "1"}
# Flags that give an engine more than one rank (a worker process for each, whatever the layout asked for).
_RANK_FLAGS = ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size", "-tp", "-pp", "-dp")


def own_core(index: int) -> dict[str, str]:
    """Environment pinning the INDEXth of several servers on this host to a core of its own (round robin).

    vLLM's CPU worker binds its OpenMP threads itself, and with `auto` every
    server on a host picks the same core: two servers' workers then share one
    core, where each idle worker busy-polls its message queue, while the other
    core is left to the rest. On 2 cores with client traffic, a reload or a
    start-up there took minutes (`layerwise watch`'s proof timed out on it).
    Operators partition cores between servers the same way.
    """
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[index % len(cpus)])}


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningServer:
    """A vLLM OpenAI server started for a test, on 127.0.0.1 and a free port.

    `kind`: `layerwise` (`layerwise serve`: extension, dev endpoints),
    `plain` (vLLM's server with VLLM_SERVER_DEV_MODE=1, no extension) or
    `no-dev` (vLLM's server without the dev endpoints).

    `worker_process`: a single-rank engine's worker in a process of its own,
    the CPU backend's default (and every multi-rank engine's layout). Without
    it, the worker runs inside the engine-core process (`WORKER_IN_ENGINE_CORE`),
    as vLLM runs one rank on a GPU: one process fewer to start. The servers
    whose layout is the subject keep the CPU default (the main `layerwise
    serve` server and vLLM's plain one in `test_serve_server.py`, the watch
    pair, the RL example's fleet), so both layouts stay tested.
    """

    def __init__(self, model: Path | str, *, kind: str = "layerwise", api_key: str | None = None,
                 extra: list[str] | None = None, env: dict[str, str] | None = None,
                 start_timeout: float = 300.0, cwd: Path | None = None, worker_process: bool = False) -> None:
        self.model = str(model)
        # Its working directory: a relative SOURCE path resolves there (a node's own disk, in the fleet tests).
        self.cwd = cwd or ROOT
        self.kind = kind
        self.api_key = api_key
        self._env = dict(env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._extra = list(extra if extra is not None else SMALL)
        self._start_timeout = start_timeout
        self.worker_process = worker_process
        self._proc: subprocess.Popen | None = None
        self._healthy_once = False  # a restart keeps the URL its clients know
        # Open for the server's lifetime (its stdout and stderr), read by log_tail; deleted on exit.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix=f"vllm-{kind}-{self.port}-", suffix=".log", delete=False)
        # One client for every request to it: `httpx.get` builds a client, and its TLS context, per call (about
        # 30 ms of CPU each; the start's health polls alone took 1.5 s of the test process's CPU per server).
        # No connection is kept between requests, as before: a restarted server is reached afresh.
        self.http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
        env.pop("VLLM_SERVER_DEV_MODE", None)
        env.pop("LAYERWISE_API_KEY", None)
        if not self.worker_process and not any(flag in self._extra for flag in _RANK_FLAGS):
            env.update(WORKER_IN_ENGINE_CORE)
        env.update(self._env)
        if self.kind == "layerwise":
            argv = [LAYERWISE, "serve", self.model, "--port", str(self.port), *KV_CACHE]
            if self.api_key:
                argv += ["--api-key", self.api_key]
            return argv + self._extra, env
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
                "--gpu-memory-utilization", "0.1", *KV_CACHE]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        if self.kind == "plain":
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return argv + self._extra, env

    def start(self) -> RunningServer:
        """Start the server and wait until it is healthy. A first start that fails because a port it binds was
        taken between `free_port` and the bind (another process of the run got it first: "Address already in
        use", seen once in a whole run) is tried again on fresh ports (`started_on_free_ports`); a restart keeps
        its URL."""
        def fresh_port() -> None:
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"

        return started_on_free_ports(self._start_once, Path(self._log.name), (b"Address already in use",),
                                     fresh_port, tries=1 if self._healthy_once else PORT_TRIES)

    def _start_once(self) -> RunningServer:
        argv, env = self.command()
        # A process group of its own (stop() signals the server and every process it spawned), in the test run's
        # session: Linux's scheduler shares a CPU between sessions first (autogroups), so a server in a session of
        # its own got as much CPU as the whole test run, and an engine of the run's on the core a busy server's
        # worker held got almost none (a worker runnable for 400 s with 0.1 s of CPU on a 2-core VM).
        self._proc = subprocess.Popen(argv, env=env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                      process_group=0)
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self._proc.returncode} before it was healthy:\n"
                                   f"{self.log_tail()}")
            try:
                if self.http.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._healthy_once = True
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server was not healthy within {self._start_timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)
        except ProcessLookupError:
            pass

    def kill(self) -> list[str]:
        """Crash it: SIGKILL its whole process group (API server, engine core, workers), as an OOM kill or a lost
        node does, then remove the shared-memory segments its processes had mapped, as a supervisor would before
        restarting it (a killed vLLM leaves its message queues in /dev/shm: two sparse files of 160 and 240 MiB).

        Returns the segments removed.
        """
        assert self._proc is not None
        segments = self._shm_segments()
        os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait(timeout=60)
        deadline = time.monotonic() + 30  # the engine core and workers, reparented, die with it
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        for path in segments:
            Path(path).unlink(missing_ok=True)
        return segments

    def _group(self) -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self._proc.pid and fields[0] != "Z":  # its process group, not zombies
                    pids.append(int(entry.name))
        return pids

    def _group_alive(self) -> bool:
        return bool(self._group())

    def _shm_segments(self) -> list[str]:
        segments: set[str] = set()
        for pid in self._group():
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            segments.update(line.split(None, 5)[5].strip() for line in maps.splitlines()
                            if " /dev/shm/" in line and len(line.split(None, 5)) == 6)
        return sorted(s.removesuffix(" (deleted)") for s in segments if not s.endswith("(deleted)"))

    @property
    def pid(self) -> int:
        """The server process (`layerwise serve` replaces itself with it: same PID)."""
        assert self._proc is not None
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_text(self) -> str:
        """Everything the server wrote so far, every start of it."""
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def start_lines(self) -> list[str]:
        """The `Serving ...` lines `layerwise serve` printed, one per start, each naming its CPU cores."""
        # Rich wraps the line at the console's width: joined again.
        return [" ".join(found.split()) for found in re.findall(
            r"^(Serving [^(]*?(?:\([^)]*\)[^(]*?)*?)\s+\(reload\s+it\s+with", self.log_text(), re.M)]

    def __enter__(self) -> RunningServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.http.close()
        Path(self._log.name).unlink(missing_ok=True)

    # --- talking to it -------------------------------------------------------------------------

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def complete(self, prompt: str, max_tokens: int = 4, timeout: float = 60.0, **extra: object) -> dict:
        """A greedy /v1/completions call; the first choice."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
        response = self.http.post(f"{self.url}/v1/completions", json=body, headers=self.headers(), timeout=timeout)
        response.raise_for_status()
        return response.json()["choices"][0]

    def answers(self, pairs: list[tuple[int, int]]) -> list[str]:
        return [self.complete(demo_prompt(a, b))["text"].strip() for a, b in pairs]

    def is_paused(self) -> bool:
        response = self.http.get(f"{self.url}/is_paused", headers=self.headers(), timeout=10)
        response.raise_for_status()
        return response.json()["is_paused"]


def started_on_free_ports(start: Callable[[], T], log: Path, taken: tuple[bytes, ...], fresh_ports: Callable[[], None],
                          tries: int = PORT_TRIES) -> T:
    """START() once it succeeds, trying again after FRESH_PORTS() when it failed (RuntimeError) because a port was
    taken: one of TAKEN in what the process wrote to LOG since that try began. At most TRIES starts in all."""
    for tries_left in range(tries - 1, -1, -1):
        begun = log.stat().st_size
        try:
            return start()
        except RuntimeError:
            with open(log, "rb") as written:
                written.seek(begun)
                said = written.read()
            if not (tries_left and any(marker in said for marker in taken)):
                raise
            fresh_ports()
    raise AssertionError("unreachable")


def start(server: RunningServer) -> None:
    """Start SERVER; if it dies, say why: the worker's and engine's error lines and tracebacks from its whole log."""
    try:
        server.start()
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n--- errors in its log:\n{error_lines(server)}") from None


def error_lines(server: RunningServer, limit: int = 60) -> str:
    """The last LIMIT lines of SERVER's log that say something failed."""
    text = server.log_text().splitlines()
    keep = [line for line in text if any(w in line for w in ("ERROR", "Error", "Traceback", "failed", "Killed"))
            and "ulimit" not in line]
    return "\n".join(keep[-limit:])


def start_servers(servers: list[RunningServer]) -> None:
    """Start SERVERS at once (their start-up overlaps); raise the first failure."""
    errors: list[BaseException] = []

    def start_one(server: RunningServer) -> None:
        try:
            start(server)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=start_one, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@contextlib.contextmanager
def running_together(servers: list[RunningServer]) -> Iterator[list[RunningServer]]:
    """SERVERS started at once (`start_servers`), each stopped on exit, also when one of them failed to start.

    Example, a module's fleet: `with running_together([RunningServer(m, env=own_core(i)) ...]) as fleet: yield fleet`.
    """
    try:
        start_servers(servers)
        yield servers
    finally:
        for server in servers:
            server.__exit__(None, None, None)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run the installed `layerwise` console script (a real subprocess), capturing text output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([LAYERWISE, *args], env=full_env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def server_fixture(model: str, *, scope: str = "module", **kwargs: object):
    """A pytest fixture yielding a `RunningServer` on the demo model `model`, shared per `scope`.

    Example: `multiply_server = server_fixture("multiply", api_key="k")` in a test module.
    """
    @pytest.fixture(scope=scope)
    def fixture(demo_models):
        with RunningServer(demo_models[model], **kwargs) as server:  # type: ignore[arg-type]
            yield server

    return fixture
