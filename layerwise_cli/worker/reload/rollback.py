"""Putting back what a worker held when a reload failed on it or on another rank."""

from __future__ import annotations

import torch

from layerwise_cli import vllm_compat
from layerwise_cli.checkpoint.hub.pin import is_commit
from layerwise_cli.checkpoint.sources import looks_like_repo_id
from layerwise_cli.errors import LayerwiseError, describe_exception
from layerwise_cli.worker.proof.consensus import PeerFailed
from layerwise_cli.worker.reload.reload_plan import loaded_from
from layerwise_cli.worker.reload.stream_reload import stream_reload
from layerwise_cli.worker.rpc import ReloadOptions
from layerwise_cli.worker.state.layer_records import records_of


def roll_back(worker, touched: dict, failure: BaseException):
    """After a reload failed on this rank or another, reload what this rank had before, then raise."""
    error = describe_exception(failure)
    source, revision = loaded_from(worker)

    records = records_of(worker)
    discard_partial_reload(worker.model_runner.get_model())
    # The weights it had are put back as they were, whatever they hold: every layer (the failed reload dropped
    # the records of the layers it touched; the others are on vLLM's meta device until a reload completes).
    # What the rollback loads is recorded as loaded without the NaN/Inf check.
    try:
        # A layer vLLM could not load now was not changed by the failed reload either (vLLM put it back).
        # One vLLM processed partly loaded was changed: the model's own loader writes it back, repairs on or off.
        # Nor is its completion proved (`allow_unchecked`): the weights it had are what it holds.
        # A step held through a delta is rebuilt from its base whatever the engine holds now.
        back = ReloadOptions(revision=revision, allow_partial=True, allow_nonfinite=True, all_layers=True,
                             allow_unchecked=True, delta_base_check=False)
        stream_reload(worker, source, back, records=records, restore_partial=True)
    except BaseException:
        records.clear()  # the engine's state is unknown: no layer may be skipped until reloaded
        raise
    touched["rolled_back"] = True
    cls = PeerFailed if isinstance(failure, PeerFailed) else LayerwiseError
    # A Hub source is named at the commit it was read at, which is what was loaded back.
    held = f"{source}@{revision}" if is_commit(revision) and looks_like_repo_id(source) else source
    raise cls(f"{error}; the engine was rolled back to the weights of {held}") from None


def discard_partial_reload(model: torch.nn.Module) -> None:
    """Drop what a failed reload left in vLLM's layer buffers, so that the next reload starts clean.

    Layers the failed reload never completed stay on the meta device with
    their loaders wrapped; `initialize_layerwise_reload` reuses them as they
    are, so only their buffered tensors and counts must go.
    """
    infos = vllm_compat.layerwise_info()
    for module in model.modules():
        info = infos.get(module)
        if info is not None and info.can_load():
            info.loaded_weights = []
            info.load_numel = 0
