"""Where the read-ahead thread runs when vLLM bound the worker to some cores: on them (default), or beside them.

vLLM's CPU backend binds each worker's OpenMP threads, its main thread
included, to the cores it gives that rank (`VLLM_CPU_OMP_THREADS_BIND`,
`auto` by default) and leaves the rest to the engine-core process
(`reserved_cpus` in its log). A thread the worker starts inherits its
creator's binding, so the read-ahead thread reads and checks on the core that
runs vLLM's loading and processing.

`LAYERWISE_READAHEAD_CPUS=spare` in the engine's environment moves it to the
CPUs the worker's parent process may use (the user's own `taskset` or cgroup,
never wider) minus the engine's. It is not the default: with `auto` binding
those CPUs are the ones vLLM reserves for its engine-core process, which is
busy while it waits for the worker's reply. Measured on 2 cores
(docs/skip-safety.md), a full reload was slower there more often than faster.
On a GPU host the worker is usually not bound: there is nothing to move.
"""

from __future__ import annotations

import contextlib
import os

# `spare` moves the read-ahead thread off the engine's cores; `inherit` (the default) keeps it there.
PLACEMENT_ENV = "LAYERWISE_READAHEAD_CPUS"


def spare_cpus() -> set[int]:
    """CPUs the calling thread's process may use that the calling (engine) thread is not bound to; may be empty.

    Empty unless `LAYERWISE_READAHEAD_CPUS=spare` is in the engine's environment.
    """
    if os.environ.get(PLACEMENT_ENV, "inherit") != "spare":
        return set()
    try:
        engine = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set()
    try:
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:
        allowed = engine
    return set(allowed) - set(engine)


def move_to(cpus: set[int]) -> list[int]:
    """Bind the calling thread to CPUS (Linux affinity is per thread); the CPUs it runs on after (kept on error)."""
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []
