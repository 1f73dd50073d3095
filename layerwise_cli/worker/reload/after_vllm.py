"""The phases after vLLM's reload: load what it could not, then repair what it left stale.

Both read SOURCE's tensors again (a `ShardReader` the caller opens and
closes) and run the model's own loaders under the engine's config.
"""

from __future__ import annotations

import torch

from layerwise_cli.engine_defaults import repairs_disabled
from layerwise_cli.worker.reload.engine_context import engine_config
from layerwise_cli.worker.reload.prove import prove_fresh, prove_loaded
from layerwise_cli.worker.reload.reload_run import ReloadRun
from layerwise_cli.worker.repairs.after_reload import apply_repairs
from layerwise_cli.worker.repairs.derived_state import aliases_left_stale
from layerwise_cli.worker.repairs.put_back_layers import holding_parents, load_put_back_layers
from layerwise_cli.worker.stream.shard_reader import ShardReader


def load_what_vllm_could_not(run: ReloadRun, reader: ShardReader, *, restore_partial: bool = False) -> None:
    """Load the modules vLLM could not with the model's own loader; those left fail the reload unless accepted.

    With the repairs on, every module vLLM could not load is loaded again: those it put back as they were, and
    those it processed partly loaded. With them off, none, unless RESTORE_PARTIAL (a rollback): then the partly
    loaded ones, which vLLM overwrote, unlike the layers it put back unloaded.
    """
    unloaded, timings = run.unloaded, run.probe.timings
    put_back_unloaded = [name for name in unloaded.modules if name not in unloaded.partial]
    run.never_buffered = holding_parents(put_back_unloaded, timings)
    repairing = run.options.repairs and not repairs_disabled()
    load_again = unloaded.modules if repairing else unloaded.partial if restore_partial else []
    if load_again:
        # Their model's own loader now writes them in place: those vLLM put back as they were, and
        # those it processed partly loaded.
        put_back = holding_parents(load_again, timings)
        with engine_config(run.worker):
            handed = load_put_back_layers(run.model, put_back, run.engine_stream, reader.read)
        run.loaded_by_model = list(load_again)
        run.notes.append(f"loaded {len(put_back)} layer(s) vLLM's reload could not ({', '.join(load_again)}: "
                         f"their model writes them outside what the reload sees) with the model's own "
                         f"loader after the reload ({handed} tensor(s))")
    left = [name for name in unloaded.modules if name not in load_again]
    prove_loaded(run, left)
    unloaded.modules = left


def repair(run: ReloadRun, reader: ShardReader) -> None:
    """Refresh what vLLM's reload leaves stale (`after_reload`); a derived buffer left stale fails unless accepted.

    Each repair is found by its rule and does nothing where it does not apply (on a GPU: nothing).
    """
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    timings, model = run.probe.timings, run.model
    with engine_config(run.worker):
        run.repair_notes, run.refreshed = apply_repairs(
            # A layer vLLM put back unloaded holds what it held: repacking it again would corrupt it.
            model, set(timings) - set(holding_parents(run.unloaded.modules, timings)),
            derived=run.derived, enabled=run.options.repairs, loaded_outside=set(run.loaded_by_model),
            tensors_of=lambda parent: [(item.entry.name, reader.read(item)) for item in run.engine_stream
                                       if item.parent == parent])
    prove_fresh(run, aliases_left_stale(model, run.derived, set(timings), run.refreshed))
