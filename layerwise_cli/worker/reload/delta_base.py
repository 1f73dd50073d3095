"""Before a delta is loaded: the engine must hold the delta's base, by its records, its state and its base's files."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from layerwise_cli.checkpoint.delta_source import DeltaChain
from layerwise_cli.checkpoint.digests import layer_digest
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.state.layer_records import LayerRecords, SkipDecider
from layerwise_cli.worker.state.spot_check import spot_check


def check_delta_base(checkpoint: Checkpoint, engine_stream: list[PlannedTensor], records: LayerRecords | None,
                     fingerprints: Callable[[list[str]], Mapping[str, object]], held: str) -> None:
    """Refuse the delta CHECKPOINT unless this rank's engine holds its base in every layer it streams.

    A layer holds the base when all of these hold, as for a skip (`layer_records`): its record's digest is
    the base's layer digest (from the delta's base digests), its state now is the state recorded right after
    it was loaded (nothing wrote it since), and the sampled bytes of the base's files are those it loaded
    (`spot_check`). Changes nothing.

    Args:
        checkpoint: the delta opened as its full step (`Checkpoint.delta` set; its shards are the base's).
        engine_stream: this rank's tensors, parents in engine names.
        records: this worker's records (None: none kept: refused).
        fingerprints: the layers' states now (`UnchangedLayerPlan._fingerprints`).
        held: what the engine holds as far as layerwise knows (`loaded_from`), for the message.

    Raises:
        LayerwiseError: one line naming the delta, its base, the first layer that does not hold it and what
            the engine holds.
    """
    delta: DeltaChain = checkpoint.delta
    needs = f"needs the engine to hold its base {delta.base_location}"
    if records is None:
        raise LayerwiseError(f"{needs}, and this reload keeps no records to prove it", where=checkpoint.source)
    groups: dict[str, list[PlannedTensor]] = {}
    for item in engine_stream:
        if item.parent is not None:
            groups.setdefault(item.parent, []).append(item)
    base = {name: layer_digest({item.entry.name: delta.base_digests[item.entry.name] for item in items})
            for name, items in groups.items()}
    decider = SkipDecider(records, base, fingerprints, checks_finite=False)
    proved = decider.skip_before_reading()
    for name in sorted(groups):
        if name not in proved:
            raise LayerwiseError(f"{needs}, but layer {name} {_what_it_holds(records, name, base[name])}; the engine "
                                 f"holds {held}", where=checkpoint.source)
    # The base's bytes: its files, or (a chain) rebuilt through every link but this delta's.
    links = delta.links[:-1]
    base_step = replace(checkpoint, delta=DeltaChain(links) if links else None)
    spot = spot_check(proved, {name: [item.entry for item in items] for name, items in groups.items()}, records,
                      base_step)
    for name in sorted(proved - spot.confirmed):
        raise LayerwiseError(f"{needs}, but the base's files are not what layer {name} was loaded from (sampled bytes "
                             f"differ); the engine holds {held}", where=checkpoint.source)


def _what_it_holds(records: LayerRecords, name: str, base_digest: str) -> str:
    record = records.get(name)
    if record is None or record.digest is None:
        return ("has no layerwise record (the engine holds what it started with, or a failed reload touched it: "
                "reload the base with layerwise once)")
    if record.digest != base_digest:
        return f"holds other weights (layer digest {record.digest[:12]}, the base's {base_digest[:12]})"
    return "was changed since layerwise loaded it (its state differs from its record)"

