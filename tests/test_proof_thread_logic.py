"""`ProofThread`: the proofs of a patch in place run in order beside the writes, and a failure stops the rest."""

from __future__ import annotations

import os
import threading

import pytest

from layerwise_cli.worker.reload.proof_thread import ProofThread


def test_without_a_spare_cpu_each_call_runs_at_once_in_the_calling_thread():
    ran = []
    with ProofThread(set()) as proofs:
        proofs.submit("a", lambda: ran.append(threading.get_ident()))
        assert ran == [threading.get_ident()]  # already done, before `results`
        assert proofs.results() == ["a"]


def test_calls_run_in_order_in_one_thread_bound_to_the_spare_cpus():
    spare = {min(os.sched_getaffinity(0))}
    seen = []
    with ProofThread(spare) as proofs:
        for key in "abc":
            proofs.submit(key, lambda key=key: seen.append((key, threading.get_ident(), os.sched_getaffinity(0))))
        assert proofs.results() == ["a", "b", "c"]
    assert [key for key, _, _ in seen] == ["a", "b", "c"]
    assert len({ident for _, ident, _ in seen}) == 1 and seen[0][1] != threading.get_ident()
    assert all(cpus == spare for _, _, cpus in seen)


def test_the_first_failure_raises_from_results_and_nothing_runs_after_the_block():
    gate, ran = threading.Event(), []

    def fail():
        gate.wait(5)
        raise ValueError("layer b does not hash to the step")

    with pytest.raises(ValueError, match="layer b"), ProofThread(set(), anywhere=True) as proofs:
        proofs.submit("a", lambda: ran.append("a"))
        proofs.submit("b", fail)
        for key in "cdefgh":
            proofs.submit(key, lambda key=key: ran.append(key))
        gate.set()
        proofs.results()
    assert ran[0] == "a"
    # The block waited for its thread: nothing of it runs on, nothing is appended later.
    assert not [t for t in threading.enumerate() if t.name.startswith("layerwise-patch-proof")]
    after = list(ran)
    threading.Event().wait(0.05)
    assert ran == after
