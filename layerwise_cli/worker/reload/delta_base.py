"""Before a delta is loaded: the engine must hold the delta's base, by its records, its state and its base's files."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

from layerwise_cli.checkpoint.delta.source import DeltaChain
from layerwise_cli.checkpoint.format.digests import layer_digest
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.state.layer_records import LayerRecords, SkipDecider
from layerwise_cli.worker.state.spot_check import spot_check


def check_delta_base(checkpoint: Checkpoint, engine_stream: list[PlannedTensor], records: LayerRecords | None,
                     fingerprints: Callable[[list[str]], Mapping[str, object]], held: str,
                     proved_after: Collection[str] = (), rewritten: Collection[str] = ()) -> None:
    """Refuse the delta CHECKPOINT unless this rank's engine holds its base, or an earlier step of its chain, in
    every layer it streams.

    A layer holds a step when all of these hold, as for a skip (`layer_records`): its record's digest is the
    step's layer digest (from the base digests of the chain's link that applies to that step), its state now
    is the state recorded right after it was loaded (nothing wrote it since), and the sampled bytes of that
    step's files are those it loaded (`spot_check`). Changes nothing.

    An engine that missed steps (it holds step 118; the delta is step 120's against 119, itself a delta
    against 118) is brought to the newest step through the chain: the reload rebuilds every tensor from the
    chain's full step and every link's patch, whatever link the engine holds, so any step of the chain is a
    base it can start from.

    Args:
        checkpoint: the delta opened as its full step (`Checkpoint.delta` set; its shards are the base's).
        engine_stream: this rank's tensors, parents in engine names.
        records: this worker's records (None: none kept: refused).
        fingerprints: the layers' states now (`LayerSkip._fingerprints`).
        held: what the engine holds as far as layerwise knows (`loaded_from`), for the message.
        proved_after: layers a patch in place proves whole once it has written them (`DeltaPatch.prove_state`): their
            state is not read now; their record's digest and the samples of the engine's bytes the patch writes
            (`DeltaPatch.plan`) are their check here, and a state that differs from the record after all fails
            the reload, which is rolled back.
        rewritten: layers every reload loads whole from the step's files, whatever the engine holds, and whose
            state never equals their record (`amx_mla.must_hand_over`: vLLM's AMX MLA backend empties
            `kv_b_proj.weight` after loading). The engine's values take no part in what they end as: their
            record's digest and the samples of the step's files are their check here.

    Raises:
        LayerwiseError: one line naming the delta, its base, the first layer that does not hold it and what
            the engine holds.
    """
    delta: DeltaChain = checkpoint.delta
    needs = f"needs the engine to hold its base {delta.base_location}"
    if len(delta.links) > 1:
        needs += " (or an earlier step of its chain)"
    if records is None:
        raise LayerwiseError(f"{needs}, and this reload keeps no records to prove it", where=checkpoint.source)
    failure = _prove_base(checkpoint, engine_stream, records, fingerprints, {*proved_after, *rewritten},
                          first_only=True)[1]
    if failure is not None:
        raise LayerwiseError(f"{needs}, but {failure}; the engine holds {held}", where=checkpoint.source)


def layers_holding_a_base(checkpoint: Checkpoint, engine_stream: list[PlannedTensor], records: LayerRecords,
                          fingerprints: Callable[[list[str]], Mapping[str, object]], layers: Collection[str],
                          proved_after: Collection[str] = ()) -> set[str]:
    """Of LAYERS, those proved to hold the delta's base or an earlier step of its chain, as `check_delta_base`
    proves every layer; the others are left out, not refused (a reload that does not check the base: `watch`).

    Args:
        layers: the layers to prove (those a patch in place would write).
        proved_after: as for `check_delta_base`.
    """
    chosen = set(layers)
    stream = [item for item in engine_stream if item.parent in chosen]
    return _prove_base(checkpoint, stream, records, fingerprints, proved_after, first_only=False)[0]


def _prove_base(checkpoint: Checkpoint, engine_stream: list[PlannedTensor], records: LayerRecords,
                fingerprints: Callable[[list[str]], Mapping[str, object]], deferred: Collection[str],
                first_only: bool) -> tuple[set[str], str | None]:
    """The layers of ENGINE_STREAM that hold a step of the chain (records, state, spot check of that step's
    files), and why the first that does not fails (None: all hold one); FIRST_ONLY stops there. The state of
    the DEFERRED layers is not read (`proved_after`, `rewritten`)."""
    delta: DeltaChain = checkpoint.delta
    groups = _groups(engine_stream)
    steps = held_steps(delta, engine_stream, records)
    deferred = set(deferred)

    def state_now(names: list[str]) -> dict[str, object]:
        # A layer proved after its patch, or rewritten whole from the files, passes here on its record's state.
        found = dict(fingerprints([name for name in names if name not in deferred]))
        found.update({name: records.get(name).fingerprint for name in names if name in deferred})
        return found

    holding: set[str] = set()
    failure: str | None = None
    for link in sorted(set(steps.values()), reverse=True):
        layers = {name for name, held_link in steps.items() if held_link == link}
        base = {name: _step_digest(delta, link, groups[name]) for name in layers}
        proved = SkipDecider(records, base, state_now, checks_finite=False).skip_before_reading()
        unproved = sorted(layers - proved)
        if unproved and failure is None:
            failure = f"layer {unproved[0]} {_what_it_holds(records, unproved[0], base[unproved[0]])}"
        if failure is not None and first_only:
            return holding, failure
        if not proved:
            continue
        # That step's bytes: its files, or (a chain) rebuilt through the links before it.
        links = delta.links[:link]
        step = replace(checkpoint, delta=DeltaChain(links) if links else None)
        spot = spot_check(proved, {name: [item.entry for item in groups[name]] for name in proved}, records, step)
        differ = sorted(proved - spot.confirmed)
        if differ and failure is None:
            failure = (f"the files of the step it holds are not what layer {differ[0]} was loaded from (sampled "
                       "bytes differ)")
        if failure is not None and first_only:
            return holding, failure
        holding |= spot.confirmed
    return holding, failure


def held_steps(delta: DeltaChain, engine_stream: list[PlannedTensor], records: LayerRecords) -> dict[str, int]:
    """Per layer of the stream, the index of the chain's link whose base its record names (the newest link's when
    none does: `check_delta_base` refuses it). From the records alone: what `check_delta_base` then proves."""
    return {name: _held_step(delta, items, records.get(name)) for name, items in _groups(engine_stream).items()}


# How a reload that does not check the base (`watch`) says the engine held no step of the delta's chain.
OFF_CHAIN_NOTE = "the engine held no step of the delta's chain"


def off_chain_note(delta: DeltaChain, engine_stream: list[PlannedTensor], records: LayerRecords) -> str | None:
    """The note for an engine some of whose layers' records name no step of DELTA's chain (its full step, a
    link's base, or the step itself): the server's weights are not on the chain, and it is given the chain's
    full step and every link, rebuilt from their files; None when every layer holds a step of it."""
    groups = _groups(engine_stream)
    off = []
    for name, items in groups.items():
        record = records.get(name)
        held = {_step_digest(delta, link, items) for link in range(len(delta.links))}
        held.add(layer_digest({item.entry.name: delta.last.step_digests[item.entry.name] for item in items}))
        if record is None or record.digest not in held:
            off.append(name)
    if not off:
        return None
    return (f"{OFF_CHAIN_NOTE} in {len(off)} of {len(groups)} layers (first {sorted(off)[0]}): given its full step "
            f"({delta.links[0].base_location}, read from this host's copy) and its {len(delta.links)} link(s), every "
            "tensor proved by the step's digests")


def _groups(engine_stream: list[PlannedTensor]) -> dict[str, list[PlannedTensor]]:
    groups: dict[str, list[PlannedTensor]] = {}
    for item in engine_stream:
        if item.parent is not None:
            groups.setdefault(item.parent, []).append(item)
    return groups


def _step_digest(delta: DeltaChain, link: int, items: list[PlannedTensor]) -> str:
    """The layer digest of ITEMS at the step link LINK of DELTA applies to (its base digests)."""
    digests = delta.links[link].base_digests
    return layer_digest({item.entry.name: digests[item.entry.name] for item in items})


def _held_step(delta: DeltaChain, items: list[PlannedTensor], record) -> int:
    """The link whose base the layer's RECORD names, newest first; the last link's (the delta's own base) if none."""
    newest = len(delta.links) - 1
    if record is None or record.digest is None:
        return newest
    for link in range(newest, -1, -1):
        if _step_digest(delta, link, items) == record.digest:
            return link
    return newest


def _what_it_holds(records: LayerRecords, name: str, base_digest: str) -> str:
    record = records.get(name)
    if record is None or record.digest is None:
        return ("has no layerwise record (the engine holds what it started with, or a failed reload touched it: "
                "reload the base with layerwise once)")
    if record.digest != base_digest:
        return f"holds other weights (layer digest {record.digest[:12]}, the base's {base_digest[:12]})"
    return "was changed since layerwise loaded it (its state differs from its record)"

