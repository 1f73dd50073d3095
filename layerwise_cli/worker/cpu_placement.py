"""Run the read-ahead thread on CPUs the engine does not compute on, where vLLM bound the worker to some cores.

vLLM's CPU backend binds each worker's OpenMP threads, its main thread
included, to the cores it gives that rank (`VLLM_CPU_OMP_THREADS_BIND`,
`auto` by default) and leaves others to the scheduler process
(`reserved_cpus` in its log). A thread the worker starts inherits its
creator's binding, so the read-ahead thread would read, check and hash on the
very core that runs vLLM's loading and processing, and nothing would overlap.
The CPUs the worker's parent process may use (the user's own `taskset` or
cgroup, never wider) minus the engine's are where the reader can run beside
it. On a GPU host the worker is usually not bound: nothing moves.
"""

from __future__ import annotations

import contextlib
import os

# `inherit` keeps the read-ahead thread on the engine's cores (to measure what the move is worth).
PLACEMENT_ENV = "LAYERWISE_READAHEAD_CPUS"


def spare_cpus() -> set[int]:
    """CPUs the calling thread's process may use that the calling (engine) thread is not bound to; may be empty.

    Empty as well with `LAYERWISE_READAHEAD_CPUS=inherit` in the engine's environment.
    """
    if os.environ.get(PLACEMENT_ENV, "spare") == "inherit":
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
