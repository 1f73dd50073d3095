"""`layerwise watch` against two real vLLM servers on loopback while a test trainer writes steps and clients generate.

One module-scoped pair of servers (plus one restart) carries the whole proof: the trainer alternates the demo's
*add* and *multiply* weights, writes some steps slowly (shards appear over seconds; the index first, or the marker
last), writes one broken step, deletes old steps itself; client threads send greedy requests the whole time.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.engine_support import parameter_kind, reshard
from tests.support.server_support import LAYERWISE, RunningServer

REPO = Path(__file__).resolve().parent.parent
# The watcher runs this checkout's code (also when the installed package is another checkout's).
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}

MARKER = "STABLE"
PAIRS = [(a, b) for a in range(10) for b in range(10)]


def answer(name: str, a: int, b: int) -> str:
    from layerwise_cli.demo import expected_answer

    return expected_answer(name, a, b)


def weight_version(url: str) -> str | None:
    return httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def start(server: RunningServer) -> None:
    """Start SERVER; if it dies, say why (the error lines of its whole log, not only its last lines)."""
    try:
        server.start()
    except RuntimeError as exc:
        text = Path(server._log.name).read_text(errors="replace").splitlines()
        errors = [line for line in text if "error" in line.lower() and "File " not in line][-25:]
        raise RuntimeError(f"{exc}\n--- error lines of its log:\n" + "\n".join(errors)) from None


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


@pytest.fixture(scope="module")
def sources(demo_models, tmp_path_factory):
    """add, multiply and a broken multiply (one tensor of the wrong shape), each in several shards."""
    base = tmp_path_factory.mktemp("watch-sources")

    def broken(tensors: dict) -> dict:
        name = next(n for n in sorted(tensors) if n.endswith("norm.weight"))
        tensors[name] = tensors[name][:-1].clone()
        return tensors

    return {"add": reshard(demo_models["add"], base / "add", parameter_kind),
            "multiply": reshard(demo_models["multiply"], base / "multiply", parameter_kind),
            "broken": reshard(demo_models["multiply"], base / "broken", parameter_kind, transform=broken)}


@pytest.fixture(scope="module")
def servers(demo_models):
    """Two `layerwise serve` servers on *multiply*, started at once."""
    # INFO logs: a server that fails to start says where it stopped.
    pair = [RunningServer(demo_models["multiply"], env={"VLLM_LOGGING_LEVEL": "INFO"}) for _ in range(2)]
    errors: list[BaseException] = []

    def start_one(server):
        try:
            start(server)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=start_one, args=(s,)) for s in pair]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        yield pair
    finally:
        for server in pair:
            server.__exit__(None, None, None)


class Trainer:
    """Writes step directories into ROOT the ways trainers do, recording when each became complete."""

    def __init__(self, root: Path, sources: dict[str, Path]) -> None:
        self.root = root
        self.sources = sources
        self.completed_at: dict[str, float] = {}
        self.model_of: dict[str, str] = {}

    def write(self, name: str, model: str, *, delay: float = 0.0, index_first: bool = False,
              marker: bool = True) -> Path:
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
        log(f"wrote {name} ({model})")
        if marker:
            (dst / MARKER).touch()  # last
        self.model_of[name] = model
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

    def _run(self, server: RunningServer) -> None:
        from layerwise_cli.demo import demo_prompt

        rng = random.Random(server.port)
        while not self._stop.is_set():
            if self.paused[server.url].is_set():
                time.sleep(0.1)
                continue
            a, b = rng.choice(PAIRS)
            try:
                text = server.complete(demo_prompt(a, b), timeout=120)["text"].strip()
                self.answers.append((server.url, a, b, text))
            except Exception as exc:  # noqa: BLE001 - recorded, asserted on
                if not self.paused[server.url].is_set():
                    self.failures.append(f"{server.url}: {type(exc).__name__}: {exc}")


class WatchProcess:
    """`layerwise watch ... --json` as a real subprocess; its events read as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([LAYERWISE, "watch", *args, "--json"], cwd=REPO, env=ENV, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.events: list[dict] = []
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def of(self, kind: str, **match) -> list[dict]:
        return [e for e in self.events if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]

    def wait_for(self, kind: str | tuple[str, ...], timeout: float = 300, **match) -> dict:
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


@pytest.mark.server
def test_watch_keeps_two_servers_on_the_newest_complete_step(servers, sources, tmp_path):
    a, b = servers
    root = tmp_path / "run"
    root.mkdir()
    log_path = tmp_path / "watch.jsonl"
    trainer = Trainer(root, sources)
    urls = ["--url", a.url, "--url", b.url]

    with Clients([a, b]) as clients:
        watch = WatchProcess(str(root), *urls, "--interval", "0.3", "--settle", "1", "--keep", "3",
                             "--log", str(log_path))
        try:
            for server in (a, b):  # seen, or back after a first probe that timed out on a loaded machine
                watch.wait_for(("server_seen", "server_back"), server=server.url)
            # A fast step, then a slow one whose index comes first (its shards are half-written for seconds).
            trainer.write("step_1", "add")
            watch.wait_for("reload_done", step="step_1", server=a.url)
            watch.wait_for("reload_done", step="step_1", server=b.url)
            trainer.write("step_2", "multiply", delay=0.4, index_first=True)
            trainer.write("step_3", "broken")
            watch.wait_for("step_skipped", step="step_3")
            # Two steps at once: step_4 is passed over for step_5.
            trainer.write("step_4", "add")
            trainer.write("step_5", "multiply")
            trainer.delete_older_than(2)
            for server in (a, b):
                watch.wait_for("reload_done", step="step_5", server=server.url)

            trainer.write("step_6", "add")
            for server in (a, b):
                watch.wait_for("reload_done", step="step_6", server=server.url)

            # SIGTERM during a reload: it finishes (or is abandoned) cleanly, nothing stays paused, exit 0.
            trainer.write("step_7", "multiply")
            watch.wait_for("reload_started", step="step_7")
        finally:
            code = watch.finish(signal.SIGTERM)
        assert code == 0, watch.stderr
        assert not a.is_paused() and not b.is_paused()
        before_restart = {s.url: weight_version(s.url) for s in (a, b)}
        assert set(before_restart.values()) <= {"step_6", "step_7"}

        # A watcher restarted mid-run, now with the marker: servers already on step_7 are not reloaded, and a step
        # written slowly is loaded only once its marker (written last) is there.
        again = WatchProcess(str(root), *urls, "--marker", MARKER, "--interval", "0.3", "--keep", "3",
                             "--log", str(log_path))
        try:
            for server in (a, b):
                wait_until(lambda s=server: weight_version(s.url) == "step_7", 120, f"{server.url} on step_7")
            trainer.write("step_8", "add", delay=0.5)
            for server in (a, b):
                again.wait_for("reload_done", step="step_8", server=server.url)
            # The trainer deletes step_9 the moment a server starts loading it, then writes step_10.
            trainer.write("step_9", "multiply")
            again.wait_for("reload_started", step="step_9", timeout=60)
            shutil.rmtree(root / "step_9")
            trainer.write("step_10", "add")
            for server in (a, b):
                again.wait_for("reload_done", step="step_10", server=server.url)
        finally:
            assert again.finish(signal.SIGINT) == 0, again.stderr
        current = [url for url, version in before_restart.items() if version == "step_7"]
        assert not [e for e in again.of("reload_started", step="step_7") if e["server"] in current], again.events

    # --once, restarted again: everything is current, nothing is reloaded, exit 0.
    once = subprocess.run([LAYERWISE, "watch", str(root), *urls, "--once", "--settle", "0.5", "--interval", "0.2",
                           "--json"], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert once.returncode == 0, once.stderr
    assert not [json.loads(line) for line in once.stdout.splitlines() if '"reload_started"' in line]

    # --- what the whole run proves --------------------------------------------------------------------------
    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    for e in events:  # the timeline, shown when the test fails
        if e["event"].startswith("reload_"):
            log(f"{e['time']:.2f} {e['event']} {e['step']} {e['server']} wall={e.get('wall_s')} "
                f"paused={e.get('paused_s')} {e.get('message', '')}")
    assert not clients.failures, clients.failures[:5]
    assert len(clients.answers) > 50
    wrong = [(url, x, y, text) for url, x, y, text in clients.answers
             if text not in (answer("add", x, y), answer("multiply", x, y))]
    assert not wrong, wrong[:5]
    # Every reload was of a complete step: it started after the trainer's last write.
    for e in [e for e in events if e["event"] == "reload_started"]:
        assert e["time"] >= trainer.completed_at[e["step"]], e
    # The broken step was reported (once) and skipped; no other step failed except the one deleted or killed.
    skipped_broken = [e for e in events if e["event"] == "step_skipped" and "broken" in e.get("message", "")]
    assert [e["step"] for e in skipped_broken] == ["step_3"]
    assert {e["step"] for e in events if e["event"] == "reload_done"} <= set(trainer.completed_at) - {"step_3"}
    failed = [e for e in events if e["event"] == "reload_failed" and e["step"] != "step_3"]
    assert all("deleted" in e["message"] for e in failed), failed
    # step_4 came with step_5: passed over.
    assert "step_4" in {e["step"] for e in events if e["event"] == "step_skipped"}
    # step_9, deleted while loading: each server either got it first or failed and kept what it had.
    for server in (a, b):
        ends = [e for e in events if e["step"] == "step_9" and e.get("server") == server.url
                and e["event"] in ("reload_done", "reload_failed")]
        assert all(e["event"] == "reload_done" or "deleted" in e["message"] for e in ends), ends
    # Both servers end on the newest step, answering with its weights.
    for server in (a, b):
        assert weight_version(server.url) == "step_10"
        assert server.answers([(3, 4), (9, 9)]) == [answer("add", 3, 4), answer("add", 9, 9)]
    # --keep never deleted a step a server held or was loading (by the log of both watchers).
    by_watch = [e for e in events if e["event"] == "step_deleted" and e.get("by") == "watch"]
    assert by_watch, "--keep 3 deleted nothing"
    for e in by_watch:
        for server in (a, b):
            assert e["step"] not in held_at(events, server.url, e["time"]), (e, server.url)
    # The log carries each server's full report; --json leaves it out.
    done = [e for e in events if e["event"] == "reload_done"]
    assert all(e["report"]["report"]["wall_s"] > 0 for e in done)
    assert all("report" not in e for e in watch.events)


@pytest.mark.server
def test_a_server_killed_and_restarted_is_brought_to_the_newest_step(servers, sources, tmp_path):
    """Server b dies (SIGKILL, as in a crash); a moves on alone; b, restarted on its base weights, is brought back."""
    a, b = servers
    root = tmp_path / "run"
    root.mkdir()
    trainer = Trainer(root, sources)
    with Clients([a, b]) as clients:
        watch = WatchProcess(str(root), "--url", a.url, "--url", b.url, "--interval", "0.3", "--settle", "0.5")
        try:
            trainer.write("step_20", "multiply")
            for server in (a, b):
                watch.wait_for("reload_done", step="step_20", server=server.url)
            clients.paused[b.url].set()
            time.sleep(0.5)  # b's client finishes its request
            os.killpg(b.pid, signal.SIGKILL)
            b._proc.wait(timeout=60)
            trainer.write("step_21", "add")
            watch.wait_for("reload_done", step="step_21", server=a.url)
            watch.wait_for("server_down", server=b.url)
            log("restarting b")
            start(b)
            log("b restarted")
            clients.paused[b.url].clear()
            watch.wait_for("server_back", server=b.url)
            watch.wait_for("reload_done", step="step_21", server=b.url)
        finally:
            assert watch.finish(signal.SIGTERM) == 0, watch.stderr
    assert not clients.failures, clients.failures[:5]
    wrong = [(url, x, y, text) for url, x, y, text in clients.answers
             if text not in (answer("add", x, y), answer("multiply", x, y))]
    assert not wrong, wrong[:5]
    assert [e["version"] for e in watch.of("server_back", server=b.url)] == ["default"]  # its base weights
    for server in (a, b):
        assert weight_version(server.url) == "step_21"
        assert server.answers([(3, 4), (9, 9)]) == [answer("add", 3, 4), answer("add", 9, 9)]
        assert not server.is_paused()


def test_watch_usage_errors(tmp_path):
    from typer.testing import CliRunner

    from layerwise_cli.cli.app import app

    runner = CliRunner()
    missing = runner.invoke(app, ["watch", str(tmp_path / "nope"), "--url", "http://127.0.0.1:9"])
    assert missing.exit_code == 1 and "nope" in missing.output and "no such directory" in missing.output
    no_url = runner.invoke(app, ["watch", str(tmp_path)])
    assert no_url.exit_code == 2 and "--url" in no_url.output
    twice = runner.invoke(app, ["watch", str(tmp_path), "--url", "http://127.0.0.1:9", "--url",
                                "http://127.0.0.1:9"])
    assert twice.exit_code == 2 and "twice" in twice.output
    bad_mode = runner.invoke(app, ["watch", str(tmp_path), "--url", "http://127.0.0.1:9", "--pause-mode", "x"])
    assert bad_mode.exit_code == 2
    bad_keep = runner.invoke(app, ["watch", str(tmp_path), "--url", "http://127.0.0.1:9", "--keep", "0"])
    assert bad_keep.exit_code == 2


def test_watch_once_without_a_server_exits_1(tmp_path):
    """--once against a port nothing listens on: retried, then one error line naming the server, exit 1."""
    from tests.support.server_support import free_port

    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / MARKER).touch()
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([LAYERWISE, "watch", str(tmp_path), "--url", url, "--once", "--marker", MARKER,
                           "--interval", "0.1"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and url in errors[0] and "connect" in errors[0], done.stderr
    # Not a terminal: one line per event on stderr.
    assert f"server down {url}" in done.stderr and "step seen step_1" in done.stderr


@pytest.mark.engine
def test_python_api_keeps_an_in_process_engine_on_the_newest_step(demo_models, sources, tmp_path):
    """`layerwise_cli.watch(root, llm=...)`: the broken newest step is skipped, the engine takes the one before."""
    from vllm import SamplingParams

    import layerwise_cli as layerwise
    from layerwise_cli.client.local import EngineOptions, start_engine, stop_engine
    from layerwise_cli.demo import demo_prompt

    root = tmp_path / "run"
    root.mkdir()
    trainer = Trainer(root, sources)
    trainer.write("step_1", "add")
    trainer.write("step_2", "broken")
    llm = start_engine(str(demo_models["multiply"]), EngineOptions(max_model_len=64))
    try:
        events = list(layerwise.watch(root, llm=llm, marker=MARKER, interval=0.1, once=True))
        outputs = llm.generate([demo_prompt(a, b) for a, b in PAIRS], SamplingParams(temperature=0.0, max_tokens=4),
                               use_tqdm=False)
        assert [o.outputs[0].text.strip() for o in outputs] == [answer("add", a, b) for a, b in PAIRS]
        assert llm.get_weight_version() == "step_1"
        assert [(e.kind, e.step) for e in events if e.kind in ("reload_done", "step_skipped")] == [
            ("step_skipped", "step_2"), ("reload_done", "step_1")]
        assert all(isinstance(e, layerwise.WatchEvent) for e in events)
        # Restarted, it keeps step_1 (a new watcher tries the broken step once more: it fails before touching).
        again = list(layerwise.watch(root, llm=llm, marker=MARKER, interval=0.1, once=True))
        assert not [e for e in again if e.kind == "reload_started" and e.step == "step_1"]
        assert llm.get_weight_version() == "step_1"
    finally:
        stop_engine(llm)
