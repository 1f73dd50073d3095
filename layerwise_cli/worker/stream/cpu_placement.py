"""Where the read-ahead thread runs when vLLM bound the worker to some cores: beside them (default), or on them.

vLLM's CPU backend binds each worker's OpenMP threads, its main thread
included, to the cores it gives that rank (`VLLM_CPU_OMP_THREADS_BIND`,
`auto` by default) and leaves the rest to the engine-core process
(`reserved_cpus` in its log). A thread the worker starts inherits its
creator's binding, so a read-ahead thread left there reads, checks and hashes
on the core that runs vLLM's loading and processing: its work adds to vLLM's
instead of overlapping it.

By default the read-ahead thread moves to the CPUs the worker's parent
process may use (the user's own `taskset` or cgroup, never wider) minus the
engine's and minus every CPU a vLLM worker on this host is bound to (the
engine's other ranks, other engines and servers, which busy-poll their queues
when idle). With `auto` binding on one engine that is the CPU vLLM reserves
for its engine-core process, which only polls (`sched_yield`) while the
worker reloads, so the reader gets the core; where servers split the cores
between them nothing is left, and the reader stays. Measured on 2 cores
(docs/performance.md). `LAYERWISE_READAHEAD_CPUS=inherit` in the engine's
environment keeps it on the engine's cores. On a GPU host the worker is
usually not bound: there is nothing to move.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from layerwise_cli.engine_cpus import bound_worker_cpus

# `spare` (the default) moves the read-ahead thread off the engine's cores; `inherit` keeps it there.
PLACEMENT_ENV = "LAYERWISE_READAHEAD_CPUS"
# Thread -> (when, spare CPUs): the scan of /proc takes about 1 ms; placements do not change from one call to the next.
_CACHE: dict[int, tuple[float, frozenset[int]]] = {}
_CACHE_S = 10.0


def spare_cpus() -> set[int]:
    """CPUs beside the engine's that no vLLM worker computes on: where the read-ahead thread may go; may be empty.

    The CPUs the worker's parent process may use, minus the calling (engine)
    thread's and minus every CPU a vLLM worker process on this host is bound
    to (this engine's other ranks, other engines and servers: their cores are
    theirs, and an idle vLLM worker busy-polls its queue). With `auto`
    binding on one engine that leaves the CPUs vLLM reserves for its
    engine-core process. Empty when `LAYERWISE_READAHEAD_CPUS=inherit` is in
    the engine's environment.
    """
    if os.environ.get(PLACEMENT_ENV, "spare") == "inherit":
        return set()
    now = time.monotonic()
    key = threading.get_ident()
    cached = _CACHE.get(key)
    if cached is not None and now - cached[0] < _CACHE_S:
        return set(cached[1])
    found = _spare_now()
    _CACHE[key] = (now, frozenset(found))
    return found


def _spare_now() -> set[int]:
    try:
        engine = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set()
    try:
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:
        allowed = engine
    spare = set(allowed) - set(engine)
    if spare:
        spare -= bound_worker_cpus(exclude=os.getpid())
    return spare


def move_to(cpus: set[int]) -> list[int]:
    """Bind the calling thread to CPUS (Linux affinity is per thread); the CPUs it runs on after (kept on error)."""
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []
