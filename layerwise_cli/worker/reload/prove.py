"""The prove phase: the reload is kept only if its completion is shown, or `allow_unchecked` accepts it noted.

Three checks, each run as soon as what it checks is known: every layer handed
over was loaded (`prove_loaded`, after the layers vLLM could not load were
loaded again), no buffer derived at load was left stale (`prove_fresh`, after
the repairs), and vLLM buffered exactly what the plan predicts
(`prove_peak`, at the end). A check that fails raises `LayerwiseError`, and
the caller rolls the reload back.
"""

from __future__ import annotations

from dataclasses import replace

from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import simulate_buffering
from layerwise_cli.worker.reload.completion_check import (
    peak_message,
    stale_message,
    unloaded_description,
    unloaded_message,
)
from layerwise_cli.worker.reload.reload_run import ReloadRun


def prove_loaded(run: ReloadRun, left: list[str]) -> None:
    """LEFT, the modules vLLM could not load and nothing loaded after it, fail the reload, unless accepted."""
    if left:
        _refuse_or_note(run, unloaded_message(left), f"{unloaded_description(left)}: they keep their previous "
                                                     "weights (accepted by --allow-unchecked)")


def prove_fresh(run: ReloadRun, stale: list[str]) -> None:
    """STALE, the buffers derived at load that no repair refreshed, fail the reload, unless accepted."""
    if stale:
        _refuse_or_note(run, stale_message(stale), stale_message(stale, accepted=True))


def prove_peak(run: ReloadRun) -> None:
    """vLLM's measured buffer peak must be the plan's prediction for what was handed over (`run.predicted`)."""
    # A layer vLLM could not load (its model writes it outside the reload's loaders) was never buffered: each of
    # its tensors counts only while it is handed over, as a layer of its own.
    buffered = [replace(item, parent=f"{item.parent}:{item.entry.name}") if item.parent in run.never_buffered
                else item for item in run.delivered()]
    position = run.planned.position
    run.predicted = simulate_buffering(buffered, run.options.order, run.held_to_end(),
                                       rank=position.tp_rank if position.tp_size > 1 else None)
    probe = run.probe
    if probe.peak == run.predicted.peak_buffer_bytes:
        return
    # vLLM buffered otherwise than the plan says it must: a layer completed later, or never, than planned.
    message = peak_message(probe.peak, run.predicted.peak_buffer_bytes, probe.peak_tensor)
    if run.unloaded.partial:
        # Explained: the layers vLLM processed partly loaded were found, and loaded again after it.
        run.notes.append(f"{message}: explained by the partly loaded layer(s) {', '.join(run.unloaded.partial)}, "
                         "loaded again after vLLM's reload")
    else:
        _refuse_or_note(run, message, f"{message} (accepted by --allow-unchecked)")


def _refuse_or_note(run: ReloadRun, message: str, accepted: str) -> None:
    """Raise MESSAGE; with `allow_unchecked`, note ACCEPTED in the report instead."""
    if not run.options.allow_unchecked:
        raise LayerwiseError(message)
    run.notes.append(accepted)
