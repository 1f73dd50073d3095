"""Single-rank engines whose engine core and worker run in the test's own process.

`start_engine` as users call it gives vLLM its default layout: an engine-core
process and (on the CPU backend always) a worker process, each spawned and
importing vLLM and torch: about 40 s of a start's 45 on a loaded 2-core
machine, a few seconds of which are vLLM's own work. With
`VLLM_ENABLE_V1_MULTIPROCESSING=0` the same engine (the same `CPUWorker`,
model runner, reload code and kernels) runs in this process, already importing
vLLM, and starts in about 3 s. vLLM's own test suite runs most of its engines
this way.

What differs, and stays tested in other files with the default layout: what
crosses the process boundary (`collective_rpc` results are not serialized
here), the engine process's logs on a failed start, the read-ahead thread's
placement beside a `VLLM::Worker` process, and multi-rank engines. The
answers are the same: `tests/test_in_process_engine.py` compares them with an
engine started the default way, bit for bit.

An in-process engine leaves state in this process that the next one must not
inherit: vLLM's cache of its environment variables (taken once the engine core
is up, so a later `VLLM_CPU_OMP_THREADS_BIND` would be ignored; `start_here`
turns it off at once), its distributed groups, the worker extension class
added to vLLM's worker class, the environment variables its start wrote
(`VLLM_DIST_IDENT`, `LOCAL_WORLD_SIZE`, `LD_PRELOAD`: a server started later
would inherit them), and the OpenMP binding of this thread to the engine's
core. `stop_here` clears all of it.

vLLM collects garbage several times as an engine loads and stops, each time
the whole heap (it also unfreezes the heap it froze at start-up). In a test
process, which holds vLLM, torch, transformers and pytest's items, that was a
third of the time of the equivalence matrix's in-process engines. So the
heap this process held before an engine starts is frozen (`gc.freeze`), and
vLLM's own freeze and unfreeze are left out for in-process engines
(`_collections_of_the_engine_only`): its collections then look only at what
came after, the engine among it, and free the engine as before. The engine
and its answers are the same; only how much the collector walks changes.
What is frozen stays frozen for the rest of the process: a cycle among it
that becomes garbage later is never collected (the equivalence file's peak
memory was the same, 2.5 GB, with and without the freeze).

Two things it could not clear are avoided: models on vLLM's Transformers
backend (it patches the `transformers` classes) start the default way, as do
all engines once llvmlite is loaded here (vLLM's CPU worker then fails to
start in process). One runs at a time: stopping one tears down the groups any
other would use, so while one runs `start_here` starts the next the default
way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
import warnings
from pathlib import Path

from layerwise_cli.client.engine.in_process import EngineOptions, start_engine, stop_engine
from layerwise_cli.engine_cpus import MULTIPROCESSING_ENV

# The test models' KV cache at max_model_len 64 needs well under 1 MiB; the size does not change an answer.
KV_CACHE_BYTES = 256 * 2**20


@dataclasses.dataclass
class _InProcess:
    """The in-process engine running now, and what to put back in this process when it stops."""

    affinity: set[int]  # the CPUs this thread could use before
    worker_bases: tuple  # the worker class's bases before (vLLM adds the worker extension class)
    environ: dict[str, str | None] = dataclasses.field(default_factory=dict)  # what its start wrote: old values
    engine_id: int | None = None  # None while it starts


# One at most; and the engines `start_here` started the default way because one was running.
_RUNNING: _InProcess | None = None
_ELSEWHERE: set[int] = set()


def start_here(model: str, options=None):
    """`start_engine(model, options)` with the engine core and its single worker in this process.

    While an in-process engine runs, the default way (processes of its own): vLLM runs
    one in-process engine per process at a time.
    """
    global _RUNNING
    options = options or EngineOptions()
    ranks = options.tensor_parallel_size * options.pipeline_parallel_size
    assert ranks == 1, f"an in-process engine has one rank, not {ranks}: use start_engine"
    if _RUNNING is not None or _keeps_state_here(model):
        llm = start_engine(model, options)
        assert type(llm.llm_engine.engine_core).__name__ != "InprocClient"
        _ELSEWHERE.add(id(llm))
        return llm
    _RUNNING = _InProcess(os.sched_getaffinity(0), _worker_class().__bases__)
    environ_before = dict(os.environ)
    if "kv_cache_memory_bytes" not in options.extra:
        # vLLM's CPU worker gives the KV cache its share of host memory minus the RSS of its own process:
        # here that is this test process. A size of its own instead.
        options = dataclasses.replace(options, extra={**options.extra, "kv_cache_memory_bytes": KV_CACHE_BYTES})
    saved = os.environ.get(MULTIPROCESSING_ENV)
    os.environ[MULTIPROCESSING_ENV] = "0"
    # What this process holds so far outlives the engine: vLLM's collections need not walk it again.
    gc.collect()
    gc.freeze()
    try:
        with _collections_of_the_engine_only():
            llm = start_engine(model, options)
    except BaseException:
        _RUNNING.environ = _changed_since(environ_before)
        _clear()
        raise
    finally:
        if saved is None:
            os.environ.pop(MULTIPROCESSING_ENV, None)
        else:
            os.environ[MULTIPROCESSING_ENV] = saved
    _RUNNING.environ = _changed_since(environ_before)
    _RUNNING.engine_id = id(llm)
    # The engine core cached vLLM's environment variables when it came up (MULTIPROCESSING_ENV=0 among
    # them): without this, any other engine started in this process while this one runs would start in
    # process too, and its stop tear down this one's distributed groups. vLLM reads them live after.
    from vllm import envs  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    envs.disable_envs_cache()
    return llm


def running_here() -> bool:
    """Whether an in-process engine runs now (another `start_here` would start with processes of its own)."""
    return _RUNNING is not None


def stop_here(llm) -> None:
    """`stop_engine(llm)`, then clear what an in-process engine left in this process."""
    with _collections_of_the_engine_only():
        stop_engine(llm)
    if id(llm) in _ELSEWHERE:
        _ELSEWHERE.discard(id(llm))
        return
    assert _RUNNING is not None and _RUNNING.engine_id == id(llm), "not an engine start_here started"
    _clear()


def _keeps_state_here(model: str) -> str | None:
    """Why an engine on MODEL would leave this process unfit for what follows (None: it would not)."""
    from vllm.model_executor.models.registry import ModelRegistry  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    if "llvmlite" in sys.modules:
        # vLLM's CPU worker rebinds its kernels by walking every loaded module, and fails on llvmlite's
        # (numba's) function wrappers: "'_lib_fn_wrapper' object has no attribute 'get'".
        reason = "llvmlite is loaded in this process (vLLM's CPU kernel rebinding fails on it)"
        warnings.warn(f"{model}: started the default way: {reason}", stacklevel=3)
        return reason
    config = Path(model) / "config.json"
    architectures = json.loads(config.read_text()).get("architectures", []) if config.is_file() else []
    for arch in architectures:
        entry = ModelRegistry.models.get(arch)
        if entry is None or getattr(entry, "module_name", "").endswith(".transformers"):
            # vLLM's Transformers backend patches the `transformers` model classes it runs, for the
            # process's lifetime: a later `save_pretrained` producer here would build vLLM's version.
            return f"{arch} runs on vLLM's Transformers backend"
    return None


def _changed_since(before: dict[str, str]) -> dict[str, str | None]:
    """The variables set or changed in this process since BEFORE, with their values then (None: unset).

    vLLM's CPU platform and worker write them into `os.environ` (`VLLM_DIST_IDENT`,
    `LOCAL_WORLD_SIZE`, `LD_PRELOAD`, ...): processes this one starts later (servers,
    other ranks) would inherit this engine's.
    """
    changed = {key: before.get(key) for key in set(before) | set(os.environ) if before.get(key) != os.environ.get(key)}
    changed.pop(MULTIPROCESSING_ENV, None)
    return changed


def _clear() -> None:
    """Put back what the in-process engine (stopped, or failed to start) changed in this process."""
    global _RUNNING
    # vLLM's own clean-up between in-process engines (EngineCore.shutdown runs it too, not on a failed
    # start): the environment cache off, the groups destroyed, a collection (of what came after the freeze).
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    with _collections_of_the_engine_only():
        cleanup_dist_env_and_memory()
    running, _RUNNING = _RUNNING, None
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, running.affinity)
    for key, value in running.environ.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    # vLLM adds the engine's `worker_extension_cls` to the worker class's bases, for the process's
    # lifetime: a later engine with another extension class would then fail its start.
    _worker_class().__bases__ = running.worker_bases


@contextlib.contextmanager
def _collections_of_the_engine_only():
    """vLLM's `gc.freeze` and `gc.unfreeze` left out while an in-process engine starts or stops.

    `start_here` froze the heap this process held before the engine: vLLM's
    unfreeze would hand all of it back to its collections, and its freeze
    would keep the engine (its weights, its KV cache) from the collections
    that free it at its stop.
    """
    freeze, unfreeze = gc.freeze, gc.unfreeze
    gc.freeze = gc.unfreeze = _left_out
    try:
        yield
    finally:
        gc.freeze, gc.unfreeze = freeze, unfreeze


def _left_out() -> None:
    """In place of `gc.freeze` and `gc.unfreeze` (`_collections_of_the_engine_only`)."""


def _worker_class():
    """The worker class vLLM's CPU platform runs (`parallel_config.worker_cls` there)."""
    from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    return CPUWorker
