"""Sparse deltas across the architectures of the equivalence matrix: MoE, a hybrid, MLA.

Per architecture: A from `save_pretrained` (`tests/support/producers.py`), rewritten by `save_checkpoint`
(header digests); B an RL-like step from A (1% of every floating tensor's values one unit in the last place
off: `tests/support/deltas.py`), in full and as delta(A->B); delta(B->A) by `layerwise delta`. An engine
started on A reloads A (its records), then delta(A->B): every tensor and the answers equal an engine started
fresh on B; then delta(B->A): equal to A as the engine started.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from layerwise_cli.client.engine.in_process import EngineOptions, reload
from layerwise_cli.writer.delta_step import write_delta
from tests.support.cpu_flags import cpu_flags
from tests.support.deltas import rl_step, save_step
from tests.support.engine_support import (
    assert_matches_fresh,
    engine_state,
    fresh_state,
    load_tensors,
    remember_fresh,
)
from tests.support.in_process import start_here, stop_here
from tests.support.producers import Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

PROMPTS = [f"{a} {b} = " for a, b in [(1, 2), (3, 4), (15, 7), (99, 0), (42, 42), (8, 13), (5, 55), (60, 6),
                                      (21, 12), (7, 70)]]
# MoE, a Mamba2 hybrid, MLA with MoE (the matrix's configurations of the same names).
ARCHS = ("qwen3_moe", "nemotron_h", "deepseek_v3")
AMX = "amx_tile" in cpu_flags()
MLA_KV_B_PROJ = ["model.layers.0.self_attn.kv_b_proj", "model.layers.1.self_attn.kv_b_proj"]


def _steps(arch: str, root: Path) -> dict[str, Path]:
    produced = save_pretrained_checkpoint(root / "produced", Producer(arch, max_shard_size="96KB"), seed=1)
    a = load_tensors(produced)
    b = {name: rl_step(t, 0.01, i) if t.is_floating_point() else t for i, (name, t) in enumerate(sorted(a.items()))}
    save_step(a, root / "step_1", produced)
    save_step(b, root / "b_full", produced)
    assert save_step(b, root / "step_2", produced, base=root / "step_1").delta is not None
    assert write_delta(root / "b_full", root / "step_1", root / "step_3", marker=None).delta is not None
    return {"A": root / "step_1", "B": root / "b_full", "AB": root / "step_2", "BA": root / "step_3"}


@pytest.mark.parametrize("arch", ARCHS)
def test_deltas_both_ways_equal_fresh_engines(arch, tmp_path):
    steps = _steps(arch, tmp_path)
    options = EngineOptions(max_model_len=64)
    fresh_state(steps["B"], PROMPTS, options)  # the reference first: one in-process engine at a time
    llm = start_here(str(steps["A"]), options)
    try:
        remember_fresh(llm, steps["A"], PROMPTS, options)
        fresh_a = engine_state(llm)["checksums"]
        reload(llm, str(steps["A"]), all_layers=True)
        reload(llm, str(steps["AB"]))
        assert engine_state(llm)["checksums"] == fresh_state(steps["B"], PROMPTS, options)
        assert_matches_fresh(llm, steps["B"], PROMPTS, options=options)
        # The records survive a reload that changed the layers: B in full now loads nothing (a Mamba2 mixer's
        # record covers its conv1d and projections, layers of their own reloaded inside it), and the next delta
        # finds its base.
        # On an AMX CPU vLLM's MLA backend empties each `kv_b_proj.weight` after loading: those layers are loaded
        # by every reload (`worker/repairs/amx_mla.py`), and only those.
        again = reload(llm, str(steps["B"]))
        loaded = sorted(layer.name for layer in again.layers if layer.skipped is None)
        assert again.unchanged.stale_layers == 0, again.findings.notes
        assert loaded == (MLA_KV_B_PROJ if arch == "deepseek_v3" and AMX else []), again.findings.notes
        reload(llm, str(steps["BA"]))
        assert engine_state(llm)["checksums"] == fresh_a
        assert_matches_fresh(llm, steps["A"], PROMPTS, options=options)
    finally:
        stop_here(llm)
