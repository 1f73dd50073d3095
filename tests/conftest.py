"""Shared fixtures: an isolated machine for every test, and checkpoint builders."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest
from hypothesis import settings

from layerwise_cli.demo import demo_checkpoint
from tests.support import engine_starts
from tests.support.cpu_flags import cpu_flags
from tests.support.engine_support import FRESH_DIR_ENV
from tests.support.synthetic import SyntheticModel, write_checkpoint

# Property tests judge results, never time: hypothesis' per-example deadline (200 ms) fails a correct example
# on a loaded 2-core machine (seen with five test processes sharing it).
settings.register_profile("layerwise", deadline=None)
settings.load_profile("layerwise")

# Seconds each test file of 40 s or more took in a whole run in two xdist workers on a 2-core Intel Xeon (AVX-512
# with AMX; 2026-12-07, `.ci/run` in 31.8 min, a slow hour; `LAYERWISE_TEST_STARTS`, `scripts/engine_starts.py`).
# Under xdist the files start heaviest first (and the rest in collection order), so that no long file is left to
# run alone at the end. Order only: no test depends on it.
HEAVY_FILES = {
    "test_serve_server.py": 355, "test_rl_loop_server.py": 350, "test_equivalence_engine.py": 237,
    "test_pause_lease_server.py": 209, "test_start_failure_server.py": 204, "test_nodes_server.py": 191,
    "test_watch_server.py": 162, "test_reload_cli.py": 141, "test_store_delta_server.py": 123,
    "test_data_parallel_server.py": 95, "test_repairs_server.py": 95, "test_pipeline_parallel_engine.py": 94,
    "test_nodes_pp_server.py": 89, "test_fleet_server.py": 84, "test_bench_quick.py": 72,
    "test_hub_fleet_server.py": 63, "test_demo_cli.py": 62, "test_watch_store_server.py": 52,
    "test_delta_tp_engine.py": 52, "test_delta_server.py": 50, "test_online_quant_engine.py": 49,
    "test_weight_transfer_server.py": 49, "test_arch_table.py": 43, "test_hub_cli.py": 41,
    "test_tensor_parallel_engine.py": 41,
}


# Known gaps on particular CPUs: (a /proc/cpuinfo flag, a test id part, a parameter id part, why). Expected to fail
# there, strictly: a fix makes them pass and the mark must then go. Listed in docs/model-families.md ("Known gaps on
# AMX / AVX-512 CPUs"). Both found in session 16 on an AMX/AVX-512 Xeon are fixed (2026-12-04); none is known now.
KNOWN_CPU_GAPS: tuple[tuple[str, str, str, str], ...] = ()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Heaviest files first (a stable sort: tests keep their order within a file); known CPU gaps marked."""
    items.sort(key=lambda item: -HEAVY_FILES.get(item.path.name, 0))
    flags = cpu_flags()
    for item in items:
        for flag, where, param, reason in KNOWN_CPU_GAPS:
            if flag in flags and where in item.nodeid and param in item.nodeid:
                item.add_marker(pytest.mark.xfail(reason=f"known gap on this CPU ({flag}): {reason}", strict=True))


def xdist_core() -> int | None:
    """Under pytest-xdist on two or more CPUs: the CPU this worker's engines are bound to (round robin)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cpus = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or len(cpus) < 2:
        return None
    return cpus[int(worker[2:]) % len(cpus)]


@pytest.fixture(scope="session", autouse=True)
def engines_on_own_core():
    """Under xdist, each worker's single-rank engines and servers get a core of their own.

    vLLM's CPU worker binds its threads itself; with `auto` every engine on
    the host takes the same core, so two workers' engines would compute on
    one core while the other does the rest (`own_core` in
    tests/support/server_support.py measured what that costs). Tests that
    start several ranks drop the variable (they give each rank its own core).

    The worker's own torch work, and the engines it runs in its own process
    (`tests/support/in_process.py`: vLLM binds no thread there), use one
    thread: torch's default is one per core, and two workers' engines each
    using both cores kept four compute threads on two.
    """
    core = xdist_core()
    if core is None or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        yield
        return
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    torch.set_num_threads(1)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    try:
        yield
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


@pytest.fixture(scope="session", autouse=True)
def fresh_answers_shared(tmp_path_factory: pytest.TempPathFactory):
    """Under xdist, the workers share fresh engines' answers (`engine_support.fresh_answers`) in this run."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    # Every worker's base temp is a folder of the run's own: their parent is the run's.
    os.environ[FRESH_DIR_ENV] = str(tmp_path_factory.getbasetemp().parent / "fresh-answers")
    try:
        yield
    finally:
        os.environ.pop(FRESH_DIR_ENV, None)


@pytest.fixture(scope="module", autouse=True)
def timeline(request: pytest.FixtureRequest):
    """With LAYERWISE_TEST_TIMELINE=FILE: one line per test file (worker, start, seconds), to see the schedule.

    With LAYERWISE_TEST_STARTS=FILE: one line per test file of the engines and servers it started, by kind
    (`tests/support/engine_starts.py`; `scripts/engine_starts.py FILE` makes a table of them).
    """
    path, starts_path = os.environ.get("LAYERWISE_TEST_TIMELINE"), os.environ.get(engine_starts.FILE_ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if starts_path:
        engine_starts.install()
        engine_starts.take()  # what the file's collection started is no start of its tests
    start = time.time()
    yield
    if path:
        with open(path, "a") as out:
            out.write(f"{worker} {start:.0f} {time.time() - start:.0f} {request.node.path.name}\n")
    if starts_path:
        with open(starts_path, "a") as out:
            out.write(engine_starts.line(worker, request.node.path.name, time.time() - start, engine_starts.take()))


@pytest.fixture(autouse=True)
def isolated_machine(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private HF_HOME, no colour and a fixed terminal width for every test."""
    hf_home = tmp_path_factory.mktemp("hf_home")
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("LAYERWISE_DEBUG", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


@pytest.fixture
def local_some_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """`some/model` as a local folder in the working directory, for tests of command lines alone.

    A Hub repo id is resolved to its commit before a server is started (`client.pinning`), which asks the Hub;
    these tests are about the options around the model, not about pinning (tests/test_hub_cli.py has that).
    """
    (tmp_path / "some" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    return "some/model"


@pytest.fixture
def make_checkpoint(tmp_path: Path):
    """Write a synthetic checkpoint: `make_checkpoint(layout="trainer_export", layers=4, ...)`."""

    def make(layout: str = "in_order", shards: int = 4, name: str | None = None, **shape: object) -> Path:
        folder = tmp_path / (name or f"{layout}-{len(os.listdir(tmp_path))}")
        write_checkpoint(folder, SyntheticModel(**shape), layout, shards)
        return folder

    return make


class _DemoModels:
    """`demo_models["add"]`: a debug checkpoint, built on first use into a cache of this run's."""

    def __init__(self, cache: Path) -> None:
        self._cache = cache

    def __getitem__(self, name: str) -> Path:
        # One build per model in the run: a worker that needs one another worker is building waits for it
        # (`demo_checkpoint` alone would be safe too, but would train it twice on the same two cores).
        with open(self._cache / f".{name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return demo_checkpoint(name, cache_dir=self._cache)


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> _DemoModels:
    """The debug checkpoints (multiply, add, moe-multiply, moe-add), built in this run: under xdist, once for all
    its workers (their base temps share a parent of the run's own, as in `fresh_answers_shared`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        cache = tmp_path_factory.getbasetemp().parent / "layerwise-cache"
        cache.mkdir(exist_ok=True)
        return _DemoModels(cache)
    return _DemoModels(tmp_path_factory.mktemp("layerwise-cache"))
