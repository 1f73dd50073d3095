"""Tied embeddings, for real: a reload ends where a fresh engine starts, and `--verify` sees the tied head.

Checkpoints come from `transformers`' own `save_pretrained` (tests/producers.py):
a Qwen3 with `tie_word_embeddings: true` writes no `lm_head` tensor. On CPU,
vLLM packs the head's GEMM weight when it processes the head; a reload does
not process it again (it is not in the checkpoint), so the head kept serving
the old weights until layerwise rebuilt it (`worker/repairs/after_reload.py`).

Engines start one at a time: a fresh B, then A. `--verify` with the repair off and on runs in the
equivalence matrix (in process, padded vocabulary: `test_verify_names_what_the_repairs_fix_and_passes_with_them`)
and against a server (`tests/test_repairs_server.py`, the CLI with `--url`), which replace the two CLI runs
(one engine each) this module had.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerwise_cli.client.engine.in_process import EngineOptions, reload, verify_engine
from tests.support.cpu_kernels import left_stale_by_vllm, linear_kernels_are_read_back, on_cpu
from tests.support.engine_support import (
    assert_matches_fresh,
    engine_state,
    fresh_answers,
    greedy_with_logprobs,
    remember_fresh,
)
from tests.support.in_process import start_here, stop_here
from tests.support.producers import Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

TIED = Producer("qwen3", tied=True, vocab_size=192)
PROMPTS = ["3 4 = ", "12 7 9 ", "5 5 = ", "1 2 3 4 ", "9 = 8 ", "0 0 0 ", "7 ", "42 = 6 7 ", "8 8 = 1", "2 = = "]
REPAIR_NOTE = "rebuilt the CPU kernel of lm_head"


@pytest.fixture(scope="module")
def tied_ab(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tied")
    checkpoints = {name: save_pretrained_checkpoint(root / name, TIED, seed=seed)
                   for name, seed in (("A", 1), ("B", 2))}
    for path in checkpoints.values():
        names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    return checkpoints


@pytest.fixture(scope="module")
def engine_a(tied_ab):
    """An engine started on A, its answers at start recorded as A's fresh answers (`remember_fresh`).

    B's fresh answers come from the shared fresh-engine cache first (an engine
    on B only on a miss, stopped before A's starts: never two at once).
    """
    fresh_answers(tied_ab["B"], PROMPTS)
    llm = start_here(str(tied_ab["A"]), EngineOptions(max_model_len=64))
    remember_fresh(llm, tied_ab["A"], PROMPTS)
    yield llm
    stop_here(llm)


@pytest.mark.parametrize("order", ["layer", "file"])
def test_reload_b_matches_a_fresh_b_then_a_comes_back(engine_a, tied_ab, order):
    # A and B answer differently: the comparison can fail.
    assert fresh_answers(tied_ab["A"], PROMPTS) != fresh_answers(tied_ab["B"], PROMPTS)
    before = engine_state(engine_a)
    report = reload(engine_a, str(tied_ab["B"]), order=order)
    assert "lm_head" not in [layer.name for layer in report.layers]  # not in the checkpoint
    if order == "layer":
        assert report.peak_buffer_bytes == report.largest_layer_bytes == report.memory.predicted_peak_buffer_bytes
    assert_matches_fresh(engine_a, tied_ab["B"], PROMPTS)
    if on_cpu():
        notes = report.findings.notes
        assert any(REPAIR_NOTE in note and "model.embed_tokens" in note for note in notes), notes
    # In place: every tensor keeps its storage (the head's weight is still the embedding's).
    after = engine_state(engine_a)
    assert after["pointers"] == before["pointers"] and after["checksums"] != before["checksums"]
    assert after["pointers"]["lm_head.weight"] == after["pointers"]["model.embed_tokens.weight"]

    reload(engine_a, str(tied_ab["A"]))
    assert_matches_fresh(engine_a, tied_ab["A"], PROMPTS, exact=True)


def test_python_api_verify_checks_the_tied_head_through_the_embedding(engine_a, tied_ab):
    report = reload(engine_a, str(tied_ab["B"]), verify=True)
    verify = report.verify
    assert verify is not None and verify.ok and not verify.mismatched and not verify.errors
    assert verify.derived == {"lm_head": "model.embed_tokens"}
    assert verify.checked == verify.matched == len(report.layers) + 1  # every SOURCE layer, and the head
    assert (verify.kernels_compared > 0) == linear_kernels_are_read_back()
    assert report.to_dict()["verify"]["derived"] == {"lm_head": "model.embed_tokens"}
    assert_matches_fresh(engine_a, tied_ab["B"], PROMPTS)
    reload(engine_a, str(tied_ab["A"]))


def test_vllm_own_reload_leaves_the_head_stale_and_verify_catches_it(engine_a, tied_ab):
    """vLLM's `reload_weights(weights_path=B)` serves the old head on a CPU whose head kernel packs a copy;
    `verify_engine` names it.

    The figure for the README: how many of the prompts answer differently from
    a fresh B engine after vLLM's own reload (tokens or top-5 logprobs).
    """
    engine_a.collective_rpc("reload_weights", kwargs={"weights_path": str(tied_ab["B"])})
    engine_a.reset_prefix_cache()
    got = greedy_with_logprobs(engine_a, PROMPTS)
    differ = sum(1 for ours, theirs in zip(got, fresh_answers(tied_ab["B"], PROMPTS)) if ours != theirs)
    print(f"vLLM's own reload: {differ} of {len(PROMPTS)} prompts differ from a fresh B engine")
    verify = verify_engine(engine_a, str(tied_ab["B"]))
    # Stale where vLLM's CPU kernel of the head holds a packed copy (AMX, AVX-512); on AVX2 it computes
    # with the weight itself, and on a GPU nothing is packed: there vLLM's reload is right.
    if left_stale_by_vllm(("lm_head",), tied_ab["B"]):
        assert differ > 0
        assert not verify.ok and verify.mismatched == ("lm_head",)
        assert "#kernel" in verify.details["lm_head"] and "model.embed_tokens" in verify.details["lm_head"]
    else:
        assert differ == 0 and verify.ok
    # A layerwise reload rebuilds the head vLLM left stale.
    reload(engine_a, str(tied_ab["B"]))
    assert_matches_fresh(engine_a, tied_ab["B"], PROMPTS)
    assert verify_engine(engine_a, str(tied_ab["B"])).ok
    reload(engine_a, str(tied_ab["A"]))
    assert_matches_fresh(engine_a, tied_ab["A"], PROMPTS, exact=True)
