"""A layer whose model writes one of its parameters outside vLLM's loaders, beside others loaded through them.

vLLM's layerwise reload counts what its wrapped loaders copy. A module some of
whose parameters are counted and one is written bare (`param.copy_` inside
`load_weights`, into the meta tensor the reload left there) reaches finalize
partly loaded: vLLM processes it as a padded layer, with whatever its
materialized tensor held, and logs nothing. Here a real NemotronH engine's
`load_weights` writes the Mamba2 mixer's `D` of layer 0 bare (its `A` and
`dt_bias` still go through their loaders). layerwise names the module and,
with its repairs off, refuses the reload, rolled back; with them, loads that
layer again with the model's own loader after vLLM's reload, and the engine is
byte-equal to a fresh one.
"""

from __future__ import annotations

import pytest

import layerwise_cli
from layerwise_cli.errors import LayerwiseError
from tests.support.engine_support import engine_state
from tests.support.in_process import start_here, stop_here
from tests.support.producers import Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

MIXER = "model.layers.0.mixer"


def _write_d_bare(worker) -> bool:
    """Make the model's `load_weights` write layer 0's mixer `D` with a bare copy, as some models write theirs."""
    model = worker.model_runner.get_model()
    load_weights = type(model).load_weights.__get__(model)

    def with_d_written_bare(weights):
        def others():
            for name, tensor in weights:
                if name.endswith("layers.0.mixer.D"):
                    model.get_parameter(f"{MIXER}.D").data.copy_(tensor)  # counted by no loader
                else:
                    yield name, tensor
        return load_weights(others())

    model.load_weights = with_d_written_bare
    return True


def _restore_load_weights(worker) -> bool:
    del worker.model_runner.get_model().load_weights
    return True


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    root = tmp_path_factory.mktemp("partly_loaded")
    producer = Producer("nemotron_h", max_shard_size="150KB")
    a = save_pretrained_checkpoint(root / "A", producer, seed=1)
    b = save_pretrained_checkpoint(root / "B", producer, seed=2)
    fresh = start_here(str(b))
    try:
        state_b = engine_state(fresh)["checksums"]
    finally:
        stop_here(fresh)
    llm = start_here(str(a))
    try:
        assert llm.collective_rpc(_write_d_bare) == [True]
        yield llm, a, b, state_b
    finally:
        llm.collective_rpc(_restore_load_weights)
        stop_here(llm)


def test_without_the_repair_a_partly_loaded_layer_fails_the_reload_rolled_back(nemotron, monkeypatch):
    llm, _, b, _ = nemotron
    before = engine_state(llm)["checksums"]
    monkeypatch.setenv("LAYERWISE_NO_REPAIRS", "1")
    with pytest.raises(LayerwiseError) as failed:
        layerwise_cli.reload(llm, str(b))
    message = str(failed.value)
    assert "vLLM could not load 1 layer(s) it was handed" in message and MIXER in message, message
    assert "rolled back" in message and "\n" not in message
    assert engine_state(llm)["checksums"] == before


def test_with_the_repair_every_reload_of_b_is_byte_equal_to_a_fresh_engine(nemotron):
    llm, a, b, state_b = nemotron
    for _ in range(2):
        report = layerwise_cli.reload(llm, str(b))
        notes = report.findings.notes
        assert any(MIXER in note and "vLLM's reload could not" in note for note in notes), notes
        state = engine_state(llm)["checksums"]
        assert sorted(name for name in state_b if state.get(name) != state_b[name]) == []
        layerwise_cli.reload(llm, str(a))
        assert engine_state(llm)["checksums"] != state_b
