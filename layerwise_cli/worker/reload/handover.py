"""The reload's middle phases: open the stream of SOURCE's tensors, and hand it to vLLM's `reload_weights`.

vLLM's reload runs under three watches: the layers skipped kept quiet
(`unchanged_layers.quiet_skipped_layers`), the layers that qualify loaded into the
engine's own tensors (`in_place`), and the modules vLLM could not load listed
before its finalize puts them back (`completion_check.unloaded_layer_watch`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from layerwise_cli.errors import LayerwiseError, describe_exception
from layerwise_cli.worker.reload.completion_check import unloaded_layer_watch
from layerwise_cli.worker.reload.reload_run import ReloadRun
from layerwise_cli.worker.reload.unchanged_layers import quiet_skipped_layers
from layerwise_cli.worker.repairs.amx_mla import give_back_weights
from layerwise_cli.worker.stream.in_place import in_place_materialization
from layerwise_cli.worker.stream.open_stream import OpenStream
from layerwise_cli.worker.stream.read_ahead import open_stream


def open_source(run: ReloadRun) -> OpenStream | None:
    """Start the reading thread on the tensors to hand over; None when every layer was skipped from the headers.

    The first layers are read while vLLM prepares its reload.
    """
    skip, early = run.skip, run.early
    if not any(item.parent is not None for item in skip.stream):
        return None
    opened = open_stream(skip.stream, run.folder, device=run.device, readahead=run.options.readahead,
                         stats=run.stats, check_finite=not run.options.allow_nonfinite, hash_layers=skip.hash_layers,
                         digests=skip.read_digests, skip_layer=run.skip_after_read if skip.skip_layer else None,
                         skipped=skip.skipped, samples=skip.read_samples, may_skip=skip.samples_match,
                         idle=early.step if early is not None else None, remote=run.remote,
                         delta=run.planned.checkpoint.delta)
    if early is not None:
        early.wake = opened.wake
    return opened


def hand_over(run: ReloadRun, opened: OpenStream) -> None:
    """vLLM's own `reload_weights` over OPENED, under the watches; fills `run.loaded_in_place` and `run.unloaded`.

    Raises:
        EngineUnchanged: vLLM refused before it changed any weight.
    """
    model = run.model
    with quiet_skipped_layers(run.skip, model), \
            in_place_materialization(model, run.options.in_place) as run.loaded_in_place, \
            unloaded_layer_watch(model, lambda: run.probe.timings.keys(),
                                 {item.parent for item in run.engine_stream}) as run.unloaded:
        try:
            give_back_weights(model)  # what vLLM's AMX MLA backend emptied (a no-op elsewhere)
            run.worker.reload_weights(weights_iterator=weights(run, opened), is_checkpoint_format=True)
        except Exception as exc:
            if not run.handover.asked and not on_meta_device(model):
                raise EngineUnchanged(f"vLLM refused the reload before changing any weight: "
                                      f"{describe_exception(exc)}") from exc
            raise


def weights(run: ReloadRun, opened: OpenStream) -> Iterator[tuple[str, torch.Tensor]]:
    """The iterator vLLM reloads from: each tensor of OPENED, measured as it is handed over (`run.handover`).

    The handover time is the engine's thread inside this generator (waiting for the reader, bookkeeping);
    everything else of the reload's wall time is vLLM's.
    """
    timer = run.handover
    asked = time.perf_counter()
    timer.asked = True  # vLLM began its reload: `initialize_layerwise_reload` put the layers on meta
    for item, tensor in opened:
        run.skip.handing_over(item.parent)
        if run.early is not None:
            run.early.handing_over(item.parent)
        run.probe.before_handover(item.entry.name, item.parent, item.entry.nbytes)
        timer.seconds += time.perf_counter() - asked
        yield item.entry.name, tensor
        asked = time.perf_counter()
    run.probe.finish()
    timer.stream_done = time.perf_counter()
    timer.seconds += timer.stream_done - asked


class EngineUnchanged(LayerwiseError):
    """vLLM's `reload_weights` failed before it changed any weight of this rank (nothing to roll back here).

    vLLM 0.34 checks for free device memory first with its extensible KV cache (the CUDA default)."""


def on_meta_device(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of MODEL is on the meta device (a reload vLLM began and did not finish)."""
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
