"""A sparse delta patched straight into a real engine's tensors, where its layers keep the checkpoint's layout.

vLLM's CPU dispatch is made to take its `F.linear` fallback (as on an AVX2 CPU,
and as a GPU computes), so the linear layers keep their loaded layout and every
layer of the model can be patched in place (`worker/reload/delta_patch.py`).
Each reload is proven against an engine started fresh on the full step under the
same dispatch: every tensor's checksum and the answers, over A, B, A, B. The
module shares the steps, the two fresh engines' state and one engine under test;
each test first loads A into it itself (every layer), so no test depends on another.
"""

from __future__ import annotations

import json
import struct

import pytest

from layerwise_cli.checkpoint.delta.read import read_delta
from layerwise_cli.client.engine.in_process import EngineOptions, reload
from layerwise_cli.engine_defaults import NO_DELTA_PATCH_ENV
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.writer.delta_step import write_delta
from tests.support.cpu_kernels import take_linear_fallback
from tests.support.deltas import save_step
from tests.support.engine_support import engine_state, greedy_with_logprobs, load_tensors
from tests.support.in_process import start_here, stop_here
from tests.support.producers import Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

PROMPTS = [f"{a} {b} = " for a, b in [(1, 2), (3, 4), (15, 7), (99, 0), (42, 42), (8, 13), (5, 55), (60, 6),
                                      (21, 12), (7, 70)]]
LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The fraction of every tensor's values the step moves (issue 49's figure).
FRACTION = 0.03


def _options():
    return EngineOptions(max_model_len=64)


def _steps(root):
    """A (a `save_pretrained` qwen3, rewritten with digests), B (3% of every tensor's values from another seed's
    model), delta(A->B) by `save_checkpoint` and delta(B->A) by `write_delta`."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    producer = Producer("qwen3", max_shard_size="96KB")
    made = save_pretrained_checkpoint(root / "made_a", producer, seed=1)
    other = load_tensors(save_pretrained_checkpoint(root / "made_b", producer, seed=2))
    a = load_tensors(made)
    gen = torch.Generator().manual_seed(7)
    b = {name: torch.where(torch.rand(t.shape, generator=gen) < FRACTION, other[name], t) for name, t in a.items()}
    steps = {"A": root / "A", "B": root / "B", "AB": root / "AB", "BA": root / "BA"}
    save_step(a, steps["A"], made)
    save_step(b, steps["B"], made)
    assert save_step(b, steps["AB"], made, base=steps["A"]).delta is not None
    assert write_delta(steps["B"], steps["A"], steps["BA"], marker=None).delta is not None
    return steps


def _fresh(checkpoint) -> tuple[dict, list]:
    """The checksums and answers of an engine started fresh on CHECKPOINT (under the test's dispatch)."""
    llm = start_here(str(checkpoint), _options())
    try:
        answers = greedy_with_logprobs(llm, PROMPTS)
        return engine_state(llm)["checksums"], answers
    finally:
        stop_here(llm)


@pytest.fixture(scope="module")
def linear_fallback():
    """vLLM's CPU dispatch on its `F.linear` fallback for the whole module: the engines start and reload under it."""
    with pytest.MonkeyPatch.context() as patch:
        take_linear_fallback(patch.setattr)
        yield


@pytest.fixture(scope="module")
def steps(linear_fallback, tmp_path_factory) -> dict:
    return _steps(tmp_path_factory.mktemp("delta-patch"))


@pytest.fixture(scope="module")
def fresh(steps) -> dict[str, tuple[dict, list]]:
    """The state and answers of engines started fresh on A and on B (before the engine under test starts)."""
    fresh = {"A": _fresh(steps["A"]), "B": _fresh(steps["B"])}
    assert fresh["A"][0] != fresh["B"][0] and fresh["A"][1] != fresh["B"][1], "B must differ from A in both"
    return fresh


@pytest.fixture(scope="module")
def engine(steps, fresh):
    """The engine under test, started on A; each test reloads A into it first (every layer, so its records say A)."""
    llm = start_here(str(steps["A"]), _options())
    yield llm
    stop_here(llm)


def _holds(llm, fresh: tuple[dict, list]) -> None:
    checksums, answers = fresh
    assert engine_state(llm)["checksums"] == checksums
    assert greedy_with_logprobs(llm, PROMPTS) == answers


def _patched(report) -> set[str]:
    return {layer.name for layer in report.layers if layer.patched}


def _handed(report) -> set[str]:
    return {layer.name for layer in report.layers if not layer.skipped and not layer.patched}


def test_a_delta_patched_in_place_equals_fresh_engines_a_b_a_b(engine, steps, fresh, monkeypatch):
    llm, fresh_a, fresh_b = engine, fresh["A"], fresh["B"]
    reload(llm, str(steps["A"]), all_layers=True)  # the records now say A
    _holds(llm, fresh_a)
    to_b = reload(llm, str(steps["AB"]))
    _holds(llm, fresh_b)
    # Every layer patched in place, the linear ones included: nothing handed to vLLM, only the delta read.
    patched = _patched(to_b)
    assert {name for name in patched if name.endswith(LINEAR)} and not _handed(to_b), _handed(to_b)
    assert patched == {layer.name for layer in to_b.layers if not layer.skipped}
    delta = read_delta(steps["AB"])
    patch_bytes = sum(delta.patch_nbytes(name) for name in delta.patches)
    assert to_b.volume.patched_layers == len(patched) and to_b.volume.patched_bytes == patch_bytes
    assert to_b.volume.read_bytes == patch_bytes and to_b.volume.bytes == 0
    assert to_b.matches_prediction
    # The patch's time is its own timer, a part of wall_s that vllm_s no longer counts.
    timings = to_b.timings
    assert 0 < timings.patch_s <= timings.wall_s
    assert abs(timings.patch_s + timings.handover_s + timings.vllm_s - timings.wall_s) < 1e-6, timings

    to_a = reload(llm, str(steps["BA"]))
    _holds(llm, fresh_a)
    assert _patched(to_a) and not _handed(to_a)
    # --verify proves the engine against the full step, and the records say the full step afterwards.
    verified = reload(llm, str(steps["AB"]), verify=True)
    assert verified.verify is not None and verified.verify.ok, verified.verify
    assert _patched(verified)
    _holds(llm, fresh_b)
    again = reload(llm, str(steps["B"]))
    assert again.unchanged.skipped_layers == len(again.layers) and again.volume.read_bytes == 0

    # The switch off: the same delta rebuilt from its base and handed to vLLM, to the same state.
    monkeypatch.setenv(NO_DELTA_PATCH_ENV, "1")
    through_vllm = reload(llm, str(steps["BA"]))
    assert not _patched(through_vllm) and through_vllm.volume.patched_layers == 0 and _handed(through_vllm)
    assert through_vllm.timings.patch_s == 0
    _holds(llm, fresh_a)


def _corrupt_values(steps, out):
    """delta(A->B) in format v1 (raw new values: a v2 stream's checksum would refuse a changed byte as it is
    decoded), its first sparse patch's first new value changed (digests left as they were)."""
    write_delta(steps["A"], steps["B"], out, marker=None, delta_format=1)
    path = out / "delta.safetensors"
    blob = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = json.loads(header["__metadata__"]["layerwise.delta"])
    name = next(name for name, spec in sorted(meta["tensors"].items())
                if spec["kind"] != "whole" and name.endswith("down_proj.weight"))
    begin = 8 + n + header[name + "::values"]["data_offsets"][0]
    blob[begin] ^= 0x40
    path.write_bytes(bytes(blob))
    return name


def test_a_patch_that_does_not_give_the_step_fails_and_the_engine_is_rolled_back(engine, steps, fresh, tmp_path):
    llm, fresh_a, fresh_b = engine, fresh["A"], fresh["B"]
    bad = tmp_path / "bad"
    tensor = _corrupt_values(steps, bad)
    reload(llm, str(steps["A"]), all_layers=True)  # the records now say A
    _holds(llm, fresh_a)
    with pytest.raises(LayerwiseError) as info:
        reload(llm, str(bad))
    message = str(info.value)
    assert f"tensor {tensor}: patched in place" in message and "do not hash to the step's digest" in message
    assert "rolled back" in message and "\n" not in message
    _holds(llm, fresh_a)
    # The rollback recorded A again: the next delta loads, patched in place.
    to_b = reload(llm, str(steps["AB"]))
    assert _patched(to_b)
    # vLLM's own reload of A since: the records still say B, the engine's bytes are A's. The samples of the
    # engine's bytes refute the base before anything is written: refused at pre-flight, nothing changed.
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(steps["A"])})
    with pytest.raises(LayerwiseError) as info:
        reload(llm, str(steps["BA"]))
    message = str(info.value)
    assert "was changed since layerwise loaded it" in message and "rolled back" not in message
    _holds(llm, fresh_a)

    # Without the base check (`watch`): not refused. No layer is proved to hold B, so none is patched;
    # each is rebuilt from B's files and the patch, and handed to vLLM.
    unchecked = reload(llm, str(steps["BA"]), delta_base_check=False)
    assert not _patched(unchecked) and _handed(unchecked)
    _holds(llm, fresh_a)
    # Now the records say A, proved by the state: the next delta is patched in place without the check too.
    to_b = reload(llm, str(steps["AB"]), delta_base_check=False)
    assert _patched(to_b) and not _handed(to_b), _handed(to_b)
    _holds(llm, fresh_b)
