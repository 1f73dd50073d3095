"""Which CPU cores a new engine's workers are bound to on a CPU host: cores no other engine's worker holds.

vLLM's CPU backend binds each worker's OpenMP threads to the cores named by
`VLLM_CPU_OMP_THREADS_BIND`; with its default, `auto`, a single-worker engine
takes the first cores of the first NUMA node whatever else runs there, so
every such engine on a host computes on the same core. On a 2-core machine a
server restarted beside a busy one never came up: its worker got no CPU time
on CPU 0, where the busy server's worker ran at 100%
(docs/vllm-on-cpu.md). `choose_cores` reads which cores other engines'
workers hold (`VLLM::Worker...` processes bound to fewer than all CPUs) and
binds the new engine's workers to the others; when every core is taken, the
ones the fewest workers hold are shared, and the choice says so in one line.

A scan reads /proc; two engines started at the same instant see neither's
workers yet: start them one after the other, or choose their cores
(`layerwise serve --cpus`, `EngineOptions.cpus`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from layerwise_cli.engine_defaults import cpu_threads_binding
from layerwise_cli.errors import UsageError

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# "0": a single-rank engine's worker runs inside its engine core's process (or the caller's), where vLLM binds no core:
# it binds a worker's threads only as its multiprocessing executor spawns the worker.
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# The process title vLLM gives its worker processes (`VLLM::Worker`, `VLLM::Worker_TP1`, ...).
WORKER_TITLE = "VLLM::Worker"
_SYS_CPU = Path("/sys/devices/system/cpu")
_SYS_NODE = Path("/sys/devices/system/node")


@dataclass(frozen=True)
class CoreChoice:
    """Where a new engine's workers compute, and what its start line says about it.

    Attributes:
        binding: the `VLLM_CPU_OMP_THREADS_BIND` value to give the engine (one
            CPU list per local worker, `|` between them); None: leave the
            environment as it is (the user set it, or there is no CPU to choose).
        said: the start line's words, naming the cores ("CPU cores 1 (CPU 0 is
            held by another engine's worker)").
        warning: one line when every core was taken and the new engine shares some; else None.
        processes: the CPUs every process of the new engine may run on (its
            server, engine core and workers), when other engines' workers hold
            some cores and others are free: the free ones. A process that
            starts on a core a busy worker holds can wait there for minutes:
            importing torch, MKL pins the importing thread to each allowed CPU
            in turn to count cores, and on this 2-core VM a server restarted
            beside a busy one sat in that call for over 10 minutes. None: leave
            the processes' affinity as it is.
    """

    binding: str | None
    said: str
    warning: str | None = None
    processes: tuple[int, ...] | None = None


def worker_cpu_holders(exclude: int | None = None, pids: list[int] | None = None) -> dict[int, int]:
    """CPU -> how many vLLM worker processes on this host (`VLLM::Worker...`, other than EXCLUDE) are bound to it.

    A worker whose affinity is every CPU of the host is not bound and counts
    for nothing, and neither does a dead one (a zombie its parent has not
    reaped yet: a server killed and restarted at once leaves its worker so for
    a while, and counting it had the restart share the busy server's core).
    Processes that cannot be read (gone, another user's) are passed over.
    PIDS: only these processes (default: every one in /proc).
    """
    everything = set(range(os.cpu_count() or 1))
    holders: dict[int, int] = {}
    if pids is None:
        try:
            pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
        except OSError:
            return holders
    for pid in pids:
        if pid == exclude:
            continue
        try:
            with open(f"/proc/{pid}/comm") as handle:
                if not handle.read().startswith(WORKER_TITLE):
                    continue
            if _is_dead(pid):
                continue
            cpus = os.sched_getaffinity(pid)
        except OSError:
            continue
        if set(cpus) != everything:
            for cpu in cpus:
                holders[cpu] = holders.get(cpu, 0) + 1
    return holders


def _is_dead(pid: int) -> bool:
    """Whether process PID has exited (a zombie, or being torn down): its state in /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as handle:
        state = handle.read().rsplit(")", 1)[1].split()[0]
    return state in ("Z", "X")


def bound_worker_cpus(exclude: int | None = None, pids: list[int] | None = None) -> set[int]:
    """The CPUs vLLM worker processes on this host (`VLLM::Worker...`, other than EXCLUDE) are bound to.

    A worker whose affinity is every CPU of the host is not bound and counts
    for nothing. Processes that cannot be read (gone, another user's) are
    passed over. PIDS: only these processes (default: every one in /proc).
    """
    return set(worker_cpu_holders(exclude=exclude, pids=pids))


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6] (Linux's CPU list format, as vLLM reads it); UsageError on anything else."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus += list(range(int(first), int(last or first) + 1))
    except ValueError:
        raise UsageError(f"--cpus {text!r} is not a CPU list (such as 0-3,6, or 0|1 for one list per worker)",
                         where="CPU cores") from None
    return cpus


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> `0-3,6`."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def requested_binding(cpus: str, workers: int) -> str:
    """The binding for a `--cpus` value: as given when it has one list per worker, else its CPUs split evenly."""
    groups = cpus.split("|")
    if len(groups) == workers:
        for group in groups:
            parse_cpu_list(group)
        return cpus
    if len(groups) != 1:
        raise UsageError(f"--cpus {cpus!r} has {len(groups)} CPU lists for {workers} workers: give one list, or one "
                         "per worker", where="CPU cores")
    listed = parse_cpu_list(cpus)
    if len(listed) < workers:
        raise UsageError(f"--cpus {cpus!r} names {len(listed)} CPUs for {workers} workers", where="CPU cores")
    return _split(listed, workers)


def _split(cpus: list[int], workers: int) -> str:
    per = len(cpus) // workers
    return "|".join(format_cpu_list(cpus[r * per:(r + 1) * per]) for r in range(workers))


def _read_list(path: Path) -> list[int] | None:
    try:
        return parse_cpu_list(path.read_text().strip())
    except (OSError, UsageError):
        return None


def one_per_core(cpus: list[int]) -> list[int]:
    """One logical CPU per physical core (the last sibling, as vLLM's `auto` picks on x86), in CPU order."""
    chosen: dict[tuple[str, str], int] = {}
    for cpu in sorted(cpus):
        topology = _SYS_CPU / f"cpu{cpu}" / "topology"
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            key = ("", str(cpu))
        chosen[key] = cpu
    return sorted(chosen.values())


def first_node(cpus: list[int]) -> list[int]:
    """The CPUs of CPUS on the NUMA node of the first one (all of them when the host says nothing of nodes)."""
    for node in sorted(_SYS_NODE.glob("node[0-9]*")):
        listed = _read_list(node / "cpulist")
        if listed and cpus and cpus[0] in listed:
            return [cpu for cpu in cpus if cpu in listed]
    return cpus


def choose_cores(workers: int, *, requested: str | None = None, holders: dict[int, int] | None = None,
                 allowed: list[int] | None = None, environ: dict[str, str] | None = None) -> CoreChoice:
    """The cores a new engine's WORKERS local workers are bound to on a CPU host.

    Args:
        workers: the engine's workers on this host (tensor x pipeline parallel).
        requested: the user's choice (`--cpus`): a CPU list, split evenly
            between the workers, or one list per worker (`0|1`).
        holders: CPU -> workers of other engines bound to it (default: read
            from /proc, `worker_cpu_holders`).
        allowed: the CPUs this process may use (default: its affinity).
        environ: where a binding the user set is read (default: os.environ).

    Returns:
        The binding and the start line's words. With one worker and
        VLLM_ENABLE_V1_MULTIPROCESSING=0: none (vLLM binds no core then). Without a request or a
        binding in the environment: with no core held by another engine, what
        vLLM's `auto` picks for one worker (the first NUMA node's cores, one
        per physical core, less the last one, which vLLM leaves to the engine
        core), or the host's cores split evenly between several; else the
        cores no other engine's worker holds, split between the workers; when
        there are too few, the ones the fewest workers hold, with a warning.

    Raises:
        UsageError: REQUESTED is not a CPU list, or names too few CPUs.
    """
    environ = os.environ if environ is None else environ
    if workers == 1 and environ.get(MULTIPROCESSING_ENV) == "0":
        return _unbound(requested)
    if requested:
        binding = requested_binding(requested, workers)
        return CoreChoice(binding, f"CPU cores {binding} (--cpus)")
    if BIND_ENV in environ:
        return CoreChoice(None, f"CPU cores {environ[BIND_ENV]} ({BIND_ENV})")
    allowed = sorted(os.sched_getaffinity(0)) if allowed is None else sorted(allowed)
    holders = worker_cpu_holders() if holders is None else holders
    held = sorted(cpu for cpu in allowed if holders.get(cpu))
    if not held:
        return _unshared(workers, allowed)
    unheld = tuple(cpu for cpu in allowed if cpu not in holders)
    free = one_per_core(list(unheld))
    whose = f"CPU {format_cpu_list(held)} {'is' if len(held) == 1 else 'are'} held by other engines' workers"
    if len(free) >= workers:
        binding = _split(free, workers)
        return CoreChoice(binding, f"CPU cores {binding} ({whose})", processes=unheld)
    shared = sorted(sorted(allowed, key=lambda cpu: (holders.get(cpu, 0), cpu))[:workers])
    binding = _split(shared, workers) if len(shared) >= workers else "|".join(str(shared[0]) for _ in range(workers))
    load = ", ".join(f"CPU {cpu}: {holders.get(cpu, 0)}" for cpu in allowed)
    warning = (f"every CPU core here is held by another engine's worker ({load}); this engine shares {binding}, the "
               "least loaded: its start and answers will be slower (choose cores with --cpus)")
    return CoreChoice(binding, f"CPU cores {binding}, shared ({whose})", warning)


def _unbound(requested: str | None) -> CoreChoice:
    """A single worker that no process of its own will hold: vLLM binds no core, and the start line says so."""
    if requested:
        raise UsageError(f"--cpus binds a worker's process, and with {MULTIPROCESSING_ENV}=0 the worker runs in the "
                         "engine core's process, which vLLM binds to no core: unset the variable, or drop --cpus",
                         where="CPU cores")
    return CoreChoice(None, f"no CPU cores bound ({MULTIPROCESSING_ENV}=0: the worker runs in the engine core's "
                            "process, which vLLM binds to none)")


def _unshared(workers: int, allowed: list[int]) -> CoreChoice:
    if workers > 1:
        binding = cpu_threads_binding(workers)
        return CoreChoice(binding, f"CPU cores {binding} (no other engine's worker holds a core here)")
    cores = one_per_core(first_node(allowed))
    if len(cores) > 1:
        cores = cores[:-1]  # vLLM's `auto` leaves the last core to the engine-core process
    binding = format_cpu_list(cores)
    return CoreChoice(binding, f"CPU cores {binding} (no other engine's worker holds a core here)")
