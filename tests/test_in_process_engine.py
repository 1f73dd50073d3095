"""In-process engines (`tests/support/in_process.py`) answer as engines started the default way, and leave nothing.

Most engine tests start their engines in the test's own process. That is
sound only if such an engine answers exactly as one started the way users
start it (an engine-core process and a worker process), after a reload too,
and if stopping it leaves nothing the next engine would inherit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from layerwise_cli.client.engine.in_process import EngineOptions, reload
from tests.support.engine_support import differing_prompts, greedy_with_logprobs
from tests.support.in_process import MULTIPROCESSING_ENV, start_here, stop_here
from tests.support.producers import PADDED_VOCAB, Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

PROMPTS = [f"{a} {b} = " for a, b in [(1, 2), (3, 4), (15, 7), (99, 0), (42, 42), (8, 13), (5, 55), (60, 6)]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("in-process")
    # A vocabulary vLLM pads and a tied head: the engine derives state from the checkpoint.
    producer = Producer("qwen3", tied=True, vocab_size=PADDED_VOCAB, max_shard_size="40KB")
    return {name: save_pretrained_checkpoint(root / name, producer, seed=seed) for name, seed in (("a", 1), ("b", 2))}


def options():
    return EngineOptions(max_model_len=64)


@pytest.fixture(scope="module")
def answers(checkpoints: dict[str, Path]) -> dict[str, object]:
    """In process on A; meanwhile a second engine fresh on B (started the default way); B reloaded into A's;
    after it stopped, a second in-process engine fresh on B."""
    from vllm import envs  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    got: dict[str, object] = {}
    affinity = os.sched_getaffinity(0)
    environ = dict(os.environ)
    llm = start_here(str(checkpoints["a"]), options())
    try:
        got["here core"] = type(llm.llm_engine.engine_core).__name__
        got["variable left set"] = MULTIPROCESSING_ENV in os.environ
        got["here fresh a"] = greedy_with_logprobs(llm, PROMPTS)
        # One in-process engine at a time: this one starts in processes of its own, and its stop
        # must leave the running engine whole.
        got["other core"], got["default fresh b"] = _core_and_answers(checkpoints["b"])
        got["here a after the other stopped"] = greedy_with_logprobs(llm, PROMPTS)
        reload(llm, str(checkpoints["b"]))
        got["here reloaded b"] = greedy_with_logprobs(llm, PROMPTS)
    finally:
        stop_here(llm)
    got["variables left"] = [key for key in ("VLLM_DIST_IDENT", "LOCAL_WORLD_SIZE", "LD_PRELOAD")
                             if os.environ.get(key) != environ.get(key)]
    got["cache after stop"] = envs._is_envs_cache_enabled()
    got["affinity restored"] = os.sched_getaffinity(0) == affinity
    import torch.distributed  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    got["distributed after stop"] = torch.distributed.is_initialized()
    got["second here core"], got["here fresh b"] = _core_and_answers(checkpoints["b"])
    return got


def _core_and_answers(model: Path) -> tuple[str, list]:
    """Start an engine with `start_here`, ask it PROMPTS, stop it: its engine-core client's class and answers."""
    llm = start_here(str(model), options())
    try:
        return type(llm.llm_engine.engine_core).__name__, greedy_with_logprobs(llm, PROMPTS)
    finally:
        stop_here(llm)


def test_one_in_process_engine_at_a_time(answers: dict[str, object]):
    # The engine core runs here (no engine-core process between this one and the worker) ...
    assert answers["here core"] == answers["second here core"] == "InprocClient"
    assert answers["variable left set"] is False, "start_here left the variable set for child processes"
    # ... and an engine started while it runs has processes of its own, whose stop leaves it serving.
    assert answers["other core"] == "SyncMPClient"
    assert not differing_prompts(answers["here a after the other stopped"], answers["here fresh a"], exact=True)


def test_in_process_fresh_engine_answers_as_the_default_one_bit_for_bit(answers: dict[str, list]):
    assert not differing_prompts(answers["here fresh b"], answers["default fresh b"], exact=True)


def test_in_process_reload_ends_where_the_default_fresh_engine_starts(answers: dict[str, list]):
    # A and B really differ, so the reload had something to change.
    assert differing_prompts(answers["here fresh a"], answers["default fresh b"])
    assert not differing_prompts(answers["here reloaded b"], answers["default fresh b"], exact=True)


def test_stopping_an_in_process_engine_leaves_nothing_behind(answers: dict[str, list]):
    assert answers["cache after stop"] is False, "vLLM's environment cache stayed on: later variables are ignored"
    assert answers["affinity restored"], "this thread stayed bound to the engine's core"
    assert answers["distributed after stop"] is False, "torch.distributed stayed initialized"
    # vLLM's worker wrote these into this process's environment: a server started later would inherit them.
    assert answers["variables left"] == [], answers["variables left"]
