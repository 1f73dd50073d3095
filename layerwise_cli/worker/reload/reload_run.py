"""One reload on one worker: the state its phases share (`ReloadRun`), and the plan phase that builds it.

The phases, in the order `stream_reload` runs them, each reading and filling
this run: plan (`plan_run`, here), pre-flight and the rank vote
(`stream_reload.plan_and_vote`), open the stream and hand over
(`handover.py`), load what vLLM could not and repair (`after_vllm.py`),
prove (`prove.py`), report (`run_report.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from layerwise_cli.checkpoint.hub.pin import HubPin
from layerwise_cli.checkpoint.store.objects import StoreSource
from layerwise_cli.engine_defaults import delta_patch_disabled
from layerwise_cli.planning.plan import BufferSimulation, Plan, PlannedTensor
from layerwise_cli.report.progress import ProgressWriter
from layerwise_cli.worker.proof.early_fingerprints import EarlyFingerprints
from layerwise_cli.worker.reload.completion_check import Unloaded
from layerwise_cli.worker.reload.delta_base import (
    check_delta_base,
    held_steps,
    layers_holding_a_base,
    off_chain_note,
)
from layerwise_cli.worker.reload.delta_patch import DeltaPatch
from layerwise_cli.worker.reload.probe import BufferProbe
from layerwise_cli.worker.reload.reload_plan import PlannedReload, loaded_from, plan_reload
from layerwise_cli.worker.reload.unchanged_layers import LayerSkip
from layerwise_cli.worker.repairs.amx_mla import must_hand_over
from layerwise_cli.worker.repairs.derived_state import derived_state_of
from layerwise_cli.worker.rpc import ReloadOptions
from layerwise_cli.worker.state.layer_records import LayerRecords
from layerwise_cli.worker.stream.in_place import InPlaceLayers
from layerwise_cli.worker.stream.read_order import pipelined_order
from layerwise_cli.worker.stream.remote_stream import RemoteStream, SampledWindows
from layerwise_cli.worker.stream.stats import ReadAheadStats


@dataclass
class Handover:
    """The engine's thread inside the weights iterator (waiting for the reader, bookkeeping).

    Everything else of the reload's wall time is vLLM's.

    Attributes:
        seconds: the time the engine spent in the iterator.
        asked: vLLM began its reload (it asked for the first tensor): `initialize_layerwise_reload` put the
            layers on meta.
        stream_done: when the iterator gave its last tensor (None: it never did).
    """

    seconds: float = 0.0
    asked: bool = False
    stream_done: float | None = None


@dataclass
class ReloadRun:
    """What the phases of one reload on one worker share.

    Built by the plan phase (`plan_run`) before anything of the engine changes;
    the fields below the line are filled by the later phases, each by one.

    Attributes:
        worker: the vLLM worker (`self` of the worker extension).
        source: a directory or file on this machine, or a Hub repo id.
        options: how to reload (`ReloadOptions`, as the client sent it).
        records: this worker's records (`layer_records.records_of`), or None: no skip, no record.
        planned: SOURCE opened, planned for this rank and pre-flighted (`reload_plan.plan_reload`).
        model: the engine's model.
        engine_stream: the tensors to hand over in order, each with its parent layer (engine module names).
        held_here: layer -> why vLLM holds it on this rank until the end of the stream (padded vocabulary,
            partial fused layers).
        folder: the folder of SOURCE's shards on this machine.
        device: where the engine's weights are.
        derived: the derived state of the engine (tied heads, views), found once per engine.
        skip: which layers are handed over, which skipped, and what is recorded after (`LayerSkip`).
        stats: what the reading thread measured.
        progress: the progress file's writer (rank 0 only).
        early: on the CPU the reading thread fingerprints each layer vLLM finished, for the records, while
            the engine loads the next ones (`early_fingerprints`); None elsewhere or without records.
        probe: vLLM's layer buffers, measured at every handover (`BufferProbe`).
        remote: for a Hub commit or a store's objects not on this machine, the fetch of the tensors handed over
            (`remote_stream`).
        patch: for a sparse delta, the layers patched in place instead of handed over (`delta_patch`).
    """

    worker: object
    source: str
    options: ReloadOptions
    records: LayerRecords | None
    planned: PlannedReload
    model: torch.nn.Module
    engine_stream: list[PlannedTensor]
    held_here: dict[str, str]
    folder: Path
    device: torch.device
    derived: object
    skip: LayerSkip
    stats: ReadAheadStats
    progress: ProgressWriter
    early: EarlyFingerprints | None
    # A Hub source not on this machine: its tensors fetched by byte range as the stream reads them (None: local).
    remote: RemoteStream | None = None
    # A sparse delta: the layers patched straight into the engine's tensors, not handed to vLLM (`delta_patch`).
    patch: DeltaPatch | None = None
    probe: BufferProbe = field(init=False)
    # ---- filled by the later phases ----
    # `handover.py`: the engine's time in the iterator; the layers vLLM loaded into the engine's own tensors.
    handover: Handover = field(default_factory=Handover)
    loaded_in_place: InPlaceLayers | None = None
    # `handover.py` and `after_vllm.py`: modules vLLM could not load (it put their tensors back, or processed
    # them partly loaded); those it put back are left in `modules` once loaded again, if not.
    unloaded: Unloaded = field(default_factory=Unloaded)
    # `after_vllm.py`: the modules loaded after vLLM's reload by the model's own loader (processed by none).
    loaded_by_model: list[str] = field(default_factory=list)
    # `after_vllm.py`: the parent layers of the modules vLLM put back (it buffered none of their tensors).
    never_buffered: list[str] = field(default_factory=list)
    # `after_vllm.py`: the repairs' notes and what they refreshed (`after_reload`).
    repair_notes: list[str] = field(default_factory=list)
    refreshed: list[dict] = field(default_factory=list)
    # `stream_reload`: the plan phase's seconds, the clock and the disk counter around the engine's change.
    plan_s: float = 0.0
    start: float = 0.0
    end: float = 0.0
    disk_read_before: int | None = None
    disk_read_after: int | None = None
    hash_wait_s: float = 0.0
    # `prove.py`: the buffer peak the plan predicts for what was handed over.
    predicted: BufferSimulation | None = None

    def __post_init__(self) -> None:
        self.probe = BufferProbe(self.model, on_layer_done=self.layer_done)

    @property
    def plan(self) -> Plan:
        return self.planned.mine.plan

    @property
    def notes(self) -> list[str]:
        """The report's notes: pre-flight's first, then each phase's."""
        return self.planned.notes

    def layer_done(self, name: str, timing) -> None:
        """vLLM finished layer NAME (`BufferProbe`): one line of progress, and its early fingerprint."""
        self.progress.write({"event": "layer", "name": name, "tensors": timing.tensors, "bytes": timing.bytes})
        if self.early is not None:
            self.early.layer_done(name)

    def layer_patched(self, name: str) -> None:
        """A sparse delta's layer NAME was patched in place (`delta_patch`): one line of progress."""
        self.progress.write({"event": "layer", "name": name, "patched": True})

    def skip_after_read(self, parent: str, digest: str) -> bool:
        """Whether the layer PARENT, read and hashed to DIGEST, is one the engine holds (then it counts as done)."""
        skipped = self.skip.skip_layer(parent, digest)
        if skipped:
            self.progress.write({"event": "layer", "name": parent, "skipped": True})
        return skipped

    def held_to_end(self) -> dict[str, str]:
        """What vLLM holds on this rank until the end of the stream (padded vocabulary), unless not handed over."""
        kept = self.skip.not_handed
        return {name: why for name, why in self.held_here.items() if name not in kept}

    def delivered(self) -> list[PlannedTensor]:
        """The tensors handed over: the stream without the layers skipped or patched in place."""
        kept = self.skip.not_handed
        return [item for item in self.engine_stream if item.parent not in kept]


def plan_run(worker, source: str, options: ReloadOptions, records: LayerRecords | None) -> ReloadRun:
    """The plan phase: SOURCE planned and pre-flighted for this rank, what to skip, the measures set up.

    Changes nothing in the engine. A sparse delta (`Checkpoint.delta`) is refused unless the engine holds its
    base (`delta_base.check_delta_base`), unless `options.delta_base_check` is off (`watch`, a rollback, a fleet
    going back: the step is rebuilt whatever the engine holds, every tensor proved by the delta's digests as
    read, and only the layers proved to hold a step of its chain are patched in place).

    Raises:
        LayerwiseError: SOURCE cannot be read, or cannot be loaded cleanly into this engine.
    """
    planned = plan_reload(worker, source, revision=options.revision, allow_partial=options.allow_partial,
                          stream=True)
    model = worker.model_runner.get_model()
    mine, plan, tp_rank = planned.mine, planned.mine.plan, planned.position.tp_rank
    # The probe and the prediction both speak engine module names. Tensors vLLM's loader skips on
    # purpose (no parent layer) are not read: vLLM would drop them unread too.
    engine_stream = [item for item in mine.engine_stream(options.order) if item.parent is not None]
    draft = getattr(getattr(worker, "vllm_config", None), "speculative_config", None)
    if draft is not None:
        planned.notes.append("the engine runs a draft model (speculative decoding): layerwise reloads the target "
                             "model only, so the draft keeps its weights")
    engine_name = mine.parent_engine_names()
    # vLLM holds these on this rank until the end of the stream (padded vocabulary, partial fused layers).
    held_here = {engine_name.get(name, name): plan.held[name].reason for name in plan.held_on(tp_rank)}
    if options.order == "layer":
        # A large first or last layer moved inward: the engine does not wait for it (`read_order`).
        engine_stream = pipelined_order(engine_stream, held_here)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    # Found before the first reload changes anything, once per engine (vLLM's record and tensors hold).
    derived = derived_state_of(worker)
    skip = LayerSkip.build(model, planned.checkpoint, engine_stream, options.order, records,
                                    all_layers=options.all_layers, checks_finite=not options.allow_nonfinite,
                                    on_host=device.type == "cpu",
                                    fetch_windows=sample_fetch(planned, options) if planned.streamed else None)
    delta = planned.checkpoint.delta
    if delta is not None:
        # Read before anything changes: every position (a corrupt delta is refused here), every new value.
        delta.validate()
        if not options.allow_nonfinite:
            delta.refuse_nonfinite()
    # Layers every reload loads whole from the files, whatever the engine holds (vLLM's AMX MLA backend).
    hand_over = must_hand_over(model) if delta is not None else set()
    patch = None
    if delta is not None and records is not None and options.patch_in_place and not delta_patch_disabled():
        patch = DeltaPatch.plan(model, delta, skip.stream, held_steps(delta, engine_stream, records), records,
                                skip.covers, derived, never=skip.rerun.hand_over | hand_over,
                                check_finite=not options.allow_nonfinite)
    settle_base(worker, planned, options, records, engine_stream, skip, patch, hand_over)
    if patch is not None:
        take_out_patched(skip, patch)
    rank = getattr(worker, "rank", 0) or 0
    run = ReloadRun(
        worker=worker, source=source, options=options, records=records, planned=planned, model=model,
        engine_stream=engine_stream, held_here=held_here, folder=_folder(planned),
        device=device, derived=derived, skip=skip, stats=ReadAheadStats(),
        progress=ProgressWriter(options.progress_path if rank == 0 else None, len(plan.layers), plan.loaded_bytes),
        early=EarlyFingerprints(skip.modules, skip.covers) if records is not None and device.type == "cpu" else None,
        patch=patch)
    if planned.streamed:
        # Fetching starts now, in hand-over order, a window ahead: during the vote and vLLM's preparation.
        run.remote = start_fetch(planned, skip.stream, options)
    # A skipped layer counts as done for the progress bar, as soon as it is known to be skipped.
    for name in sorted(skip.skipped):
        run.progress.write({"event": "layer", "name": name, "skipped": True})
    return run


def settle_base(worker, planned: PlannedReload, options: ReloadOptions, records: LayerRecords | None,
                engine_stream: list[PlannedTensor], skip: LayerSkip, patch: DeltaPatch | None,
                hand_over: set[str]) -> None:
    """A delta's base: refused unless the engine holds it (`check_delta_base`); or, without the check (`watch`, a
    rollback, a fleet going back), the patch kept to the layers proved to hold a step of the chain, and a note
    when the engine held no step of it (`off_chain_note`: it is given the chain's full step and links).
    HAND_OVER: the layers every reload loads whole from the files (`amx_mla.must_hand_over`)."""
    delta = planned.checkpoint.delta
    if delta is None:
        return
    if options.delta_base_check:
        held, _ = loaded_from(worker)
        check_delta_base(planned.checkpoint, engine_stream, records, skip._fingerprints, held,
                         proved_after=patch.proved_after if patch is not None else (),
                         rewritten=hand_over)
        return
    if records is not None and (note := off_chain_note(delta, engine_stream, records)) is not None:
        planned.notes.append(note)
    if patch is not None:
        # A layer is patched only where it is proved to hold a step of the chain, as the check proves every
        # layer; the others are rebuilt from the base's files.
        patch.keep_only(layers_holding_a_base(planned.checkpoint, engine_stream, records, skip._fingerprints,
                                              patch.layers, proved_after=patch.proved_after))


def take_out_patched(skip: LayerSkip, patch: DeltaPatch) -> None:
    """The layers a delta patches in place (`delta_patch`) taken out of the stream handed to vLLM."""
    layers = patch.layers
    skip.patched = layers
    skip.stream = [item for item in skip.stream if item.parent not in layers]
    skip.hash_layers -= layers


def start_fetch(planned: PlannedReload, stream: list[PlannedTensor], options: ReloadOptions) -> RemoteStream:
    """Start fetching the tensors of STREAM this rank hands over from the pinned source (`remote_stream`).

    A Hub commit's are kept in the Hub cache unless `bounded_disk`, a store's in layerwise's store cache; then
    also the shards' headers and the tensors vLLM skips, so that a shard fetched whole is kept whole (a Hub
    shard verified and linked).
    """
    checkpoint = planned.checkpoint
    handed = [item.entry for item in stream if item.parent is not None]
    wanted = {entry.name for entry in handed}
    extra = [item.entry for item in planned.mine.plan.file_order
             if item.parent is None and item.entry.name not in wanted]
    return RemoteStream(fetch_source(planned), checkpoint, handed, keep=keeps(planned, options), extra=extra).start()


def sample_fetch(planned: PlannedReload, options: ReloadOptions):
    """What fetches the spot check's sample windows from the pinned source (`spot_check`'s `fetch_windows`)."""
    source, keep = fetch_source(planned), keeps(planned, options)
    return lambda windows: SampledWindows(source, planned.checkpoint, windows, keep=keep)


def fetch_source(planned: PlannedReload) -> HubPin | StoreSource:
    """Where a streamed SOURCE's bytes come from: the Hub at the pinned commit, or the store at the pinned ETags."""
    checkpoint = planned.checkpoint
    if checkpoint.kind == "store":
        return StoreSource(checkpoint.source, pinned=checkpoint.pinned)
    return HubPin(checkpoint.source, planned.commit, checkpoint.revision)


def keeps(planned: PlannedReload, options: ReloadOptions) -> bool:
    """Whether the fetch keeps what arrives: in the Hub cache, or a store's in layerwise's store cache (keyed by
    each object's pinned ETag), unless `bounded_disk`."""
    return planned.checkpoint.kind in ("hub", "store") and not options.bounded_disk


def _folder(planned: PlannedReload) -> Path:
    """Where SOURCE's shards are read: its folder, or a delta's base's (`Checkpoint.delta`)."""
    if planned.checkpoint.delta is not None:
        return planned.checkpoint.local_dir
    return planned.folder if planned.folder.is_dir() else planned.folder.parent
