"""Which CPU cores a new engine's workers get: cores no other engine's worker holds, the user's choice, or the least
loaded with a warning (`layerwise_cli.engine_cpus`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from layerwise_cli.client.engine.in_process import thread_confined
from layerwise_cli.engine_cpus import (
    BIND_ENV,
    MULTIPROCESSING_ENV,
    choose_cores,
    format_cpu_list,
    parse_cpu_list,
    worker_cpu_holders,
)
from layerwise_cli.errors import UsageError


def _choose(workers: int, holders: dict[int, int], allowed: list[int], **kwargs):
    return choose_cores(workers, holders=holders, allowed=allowed, environ=kwargs.pop("environ", {}), **kwargs)


def test_a_single_worker_takes_a_core_no_other_engine_holds():
    # The case: a busy server's worker holds CPU 0; the restarted server's worker goes to CPU 1.
    choice = _choose(1, {0: 1}, [0, 1])
    assert choice.binding == "1" and choice.warning is None
    assert choice.said == "CPU cores 1 (CPU 0 is held by other engines' workers)"
    assert _choose(1, {1: 1}, [0, 1]).binding == "0"
    # On a larger host it takes every free core; several workers split them.
    assert _choose(1, {0: 1, 1: 1}, list(range(2, 8)) + [0, 1]).binding == "2-7"
    assert _choose(2, {0: 1, 1: 1}, list(range(6))).binding == "2-3|4-5"
    # The new engine's processes (its server, engine core, workers) stay off the held cores too.
    assert choice.processes == (1,)
    assert _choose(1, {0: 1, 1: 1}, list(range(8))).processes == (2, 3, 4, 5, 6, 7)


def test_with_no_core_held_a_single_worker_gets_what_vllm_auto_would_pick():
    # vLLM's `auto` leaves the last core to the engine-core process; on 2 cores the worker gets CPU 0.
    cpus = sorted(os.sched_getaffinity(0))
    choice = _choose(1, {}, cpus)
    if len(cpus) > 1:
        assert parse_cpu_list(choice.binding)[-1] < cpus[-1]
    assert choice.said.startswith(f"CPU cores {choice.binding} (no other engine's worker holds a core here)")
    assert choice.processes is None  # nothing to keep off


def test_with_no_core_held_several_workers_split_the_host(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert _choose(2, {}, list(range(8))).binding == "0-3|4-7"


def test_every_core_taken_shares_the_least_loaded_and_says_so_in_one_line():
    choice = _choose(1, {0: 2, 1: 1}, [0, 1])
    assert choice.binding == "1"
    assert choice.warning is not None and "\n" not in choice.warning
    assert "CPU 0: 2, CPU 1: 1" in choice.warning and "--cpus" in choice.warning
    assert choice.processes is None  # no core is free: the processes may run anywhere, as the workers share
    # A tie goes to the lower CPU; two workers on two taken cores get one each.
    assert _choose(1, {0: 1, 1: 1}, [0, 1]).binding == "0"
    assert _choose(2, {0: 1, 1: 1}, [0, 1]).binding == "0|1"
    # Only CPUs this process may use count.
    assert _choose(1, {0: 1, 1: 5}, [1]).binding == "1"


def test_the_users_choice_wins_and_a_binding_in_the_environment_is_kept():
    assert _choose(1, {0: 3}, [0, 1], requested="0").binding == "0"
    assert _choose(2, {}, [0, 1, 2, 3], requested="0-3").binding == "0-1|2-3"
    assert _choose(2, {}, [0, 1], requested="1|0").binding == "1|0"
    kept = _choose(1, {0: 1}, [0, 1], environ={BIND_ENV: "0"})
    assert kept.binding is None and kept.said == f"CPU cores 0 ({BIND_ENV})"
    # The user's cores are the workers'; the processes' affinity is left as the user set it.
    assert _choose(1, {0: 3}, [0, 1], requested="1").processes is None and kept.processes is None


def test_a_worker_inside_the_engine_core_is_bound_to_no_core_and_the_start_line_says_so():
    """vLLM binds a worker's threads as its multiprocessing executor spawns it: a single worker run inside the engine
    core's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) is bound to none, whatever the environment names."""
    inside = {MULTIPROCESSING_ENV: "0", BIND_ENV: "1"}
    choice = _choose(1, {0: 1}, [0, 1], environ=inside)
    assert choice.binding is None and choice.processes is None
    assert choice.said.startswith(f"no CPU cores bound ({MULTIPROCESSING_ENV}=0")
    with pytest.raises(UsageError, match="--cpus binds a worker's process"):
        _choose(1, {}, [0, 1], environ=inside, requested="1")
    # Several ranks always have processes of their own; "1" is vLLM's default.
    assert _choose(2, {0: 1}, [0, 1, 2, 3], environ={MULTIPROCESSING_ENV: "0"}).binding == "1|2"
    assert _choose(1, {0: 1}, [0, 1], environ={MULTIPROCESSING_ENV: "1"}).binding == "1"


@pytest.mark.parametrize("bad", ["x", "0-", "0|1|2", "1-a"])
def test_a_cpu_list_that_is_not_one_is_a_usage_error(bad):
    with pytest.raises(UsageError, match="--cpus"):
        _choose(2, {}, [0, 1], requested=bad)


def test_a_request_with_too_few_cpus_for_its_workers_is_refused():
    with pytest.raises(UsageError, match="names 1 CPUs for 2 workers"):
        _choose(2, {}, [0, 1], requested="0")


def test_cpu_lists_read_and_write_as_linux_writes_them():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert format_cpu_list([6, 0, 1, 2, 3]) == "0-3,6"
    assert format_cpu_list([1]) == "1"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_holders_count_each_bound_worker_per_cpu():
    # Two processes titled as vLLM titles its workers, bound to one CPU; a third, unbound, counts for nothing.
    cpu = max(os.sched_getaffinity(0))
    script = ("import ctypes, os, sys, time; ctypes.CDLL(None).prctl(15, b'VLLM::Worker', 0, 0, 0); "
              "os.sched_setaffinity(0, eval(sys.argv[1])); print('ready', flush=True); time.sleep(60)")
    everything = set(range(os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, "-c", script, repr(cpus)], stdout=subprocess.PIPE, text=True)
             for cpus in ({cpu}, {cpu}, everything)]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        pids = [proc.pid for proc in procs]
        assert worker_cpu_holders(pids=pids) == {cpu: 2}
        assert worker_cpu_holders(exclude=pids[0], pids=pids) == {cpu: 1}
        # So a new engine's worker goes elsewhere.
        assert cpu not in parse_cpu_list(choose_cores(1, holders=worker_cpu_holders(pids=pids), environ={}).binding)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_an_engine_started_while_its_thread_is_confined_inherits_the_cpus_and_the_thread_gets_its_own_back():
    # As `start_engine` starts an engine beside a busy one: vLLM's engine-core and worker processes are started
    # from the calling thread and inherit its CPUs; the caller's own thread is given its CPUs back after.
    before = os.sched_getaffinity(0)
    cpu = max(before)
    show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with thread_confined((cpu,)):
        child = subprocess.run(show, capture_output=True, text=True, check=True, timeout=60)
    assert child.stdout.strip() == f"[{cpu}]"
    assert os.sched_getaffinity(0) == before
    with thread_confined(None):
        assert os.sched_getaffinity(0) == before
