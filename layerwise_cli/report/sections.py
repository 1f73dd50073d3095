"""The sections a reload report is made of, each with the rule that merges the workers' sections into one.

A worker builds one of each; `merge_reports` merges each section by its own
rule (`merged`), so a new figure is a field in its section and, where the
section's rule does not already fit it, a line in that rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from layerwise_cli.report.records import DerivedRefresh, LayerReport, RankSummary
from layerwise_cli.report.verify_result import VerifyResult


def _as_tuples(value: object, *names: str) -> None:
    """Store the sequences given for NAMES on the frozen VALUE as tuples."""
    for name in names:
        object.__setattr__(value, name, tuple(getattr(value, name)))


@dataclass(frozen=True)
class Placement:
    """Which reload this was and where it ran: the source, the order, the worker or workers.

    Merged: the first worker's (in (dp, pp, tp) order), with `workers`,
    `engines` and `ranks` counting and listing them all.

    Attributes:
        source: the checkpoint, as the user named it.
        commit: the Hub commit the source was read at, one for the whole operation (None: a local path).
        order: `layer` or `file`, the order the tensors were handed over in.
        mapping: how tensors were mapped to parent layers (`LayerMapping.description`).
        device: where the engine holds its weights (`cpu`, `cuda:0`).
        rank: the worker's rank (None once merged, or outside tensor parallel).
        position: one worker's place: rank, tp/pp/dp rank and size (empty in a merged report: see `ranks`).
        engine_id: the id of the worker's records, made once per worker process (a restarted engine has a
            new one and no records); in a merged report the first worker's (every worker's in `ranks`).
        reader_cpus: the CPUs the read-ahead thread ran on (None: no read-ahead; merged: rank 0's).
        workers: workers merged into this report.
        engines: data-parallel engines merged into this report.
        ranks: in a merged report, every worker (`RankSummary`), in (dp, pp, tp) order.
    """

    source: str
    order: str
    mapping: str = ""
    commit: str | None = None
    device: str = "cpu"
    rank: int | None = None
    position: dict = field(default_factory=dict)
    engine_id: str | None = None
    reader_cpus: list[int] | None = None
    workers: int = 1
    engines: int = 1
    ranks: tuple[RankSummary, ...] = ()

    def __post_init__(self) -> None:
        _as_tuples(self, "ranks")

    @classmethod
    def merged(cls, parts: Sequence[Placement], ranks: Sequence[RankSummary], source: str | None) -> Placement:
        """The first worker's placement, with every worker counted and listed (SOURCE, if given, renames it)."""
        first = parts[0]
        return cls(source=first.source if source is None else source, commit=first.commit, order=first.order,
                   mapping=first.mapping,
                   device=first.device, engine_id=first.engine_id, reader_cpus=first.reader_cpus,
                   workers=len(parts), engines=len({rank.dp_rank for rank in ranks}), ranks=tuple(ranks))


@dataclass(frozen=True)
class Volume:
    """What the reload moved: tensors and bytes handed to the engine, bytes read, and what other ranks hold.

    Merged: `bytes` and `tensors` add up the stages of one engine (pipeline
    stages hold different layers; data-parallel engines match), `read_bytes`
    is the most one worker read; the per-worker figures below it are listed
    in `Placement.ranks` and left empty.

    Attributes:
        bytes: bytes of the tensors the engine loaded.
        tensors: tensors streamed.
        read_bytes: bytes of tensor data this worker read from SOURCE, for a delta its base's and its
            patches' (merged: the most one worker read; None: not measured).
        disk_read_bytes: bytes read from storage by the worker's process during the reload (None: not
            measurable; page-cache hits do not count).
        elsewhere_tensors: tensors of the source that other ranks hold (another pipeline stage, other
            experts), not read by this worker.
        elsewhere_bytes: their bytes.
        fetched_bytes: bytes this worker fetched from the Hub for the reload (merged: every worker's added up;
            None: the source was on this machine).
        patched_layers: layers a sparse delta patched straight into the engine's tensors, not handed to vLLM
            (`layers[].patched`; merged: added up over the stages, as `bytes`).
        patched_bytes: the delta's bytes read for them (positions and values; in `read_bytes` too).
        rebuilt_layers: a delta's changed layers that could not be patched in place: rebuilt from the base's
            files and the patch, then loaded as a full step's layers are (handed to vLLM, its kernels rebuilt);
            such a layer costs about what it does in the full step's reload, plus the rebuild.
        rebuilt_reason: why the first of them could not be patched in place (None: none was rebuilt, or the
            patch in place was off).
    """

    bytes: int
    tensors: int
    read_bytes: int | None = None
    disk_read_bytes: int | None = None
    elsewhere_tensors: int = 0
    elsewhere_bytes: int = 0
    fetched_bytes: int | None = None
    patched_layers: int = 0
    patched_bytes: int = 0
    rebuilt_layers: int = 0
    rebuilt_reason: str | None = None

    @classmethod
    def merged(cls, parts: Sequence[Volume], stages: Sequence[Volume]) -> Volume:
        """STAGES (one engine's, one per pipeline stage) added up; the most any of PARTS read."""
        unmeasured = any(part.read_bytes is None for part in parts)
        fetched = [part.fetched_bytes for part in parts if part.fetched_bytes is not None]
        return cls(bytes=sum(stage.bytes for stage in stages), tensors=sum(stage.tensors for stage in stages),
                   read_bytes=None if unmeasured else max(part.read_bytes for part in parts),
                   fetched_bytes=sum(fetched) if fetched else None,
                   patched_layers=sum(stage.patched_layers for stage in stages),
                   patched_bytes=sum(stage.patched_bytes for stage in stages),
                   rebuilt_layers=sum(stage.rebuilt_layers for stage in stages),
                   rebuilt_reason=next((p.rebuilt_reason for p in parts if p.rebuilt_reason), None))


@dataclass(frozen=True)
class Memory:
    """What the reload held in memory at once: vLLM's layer buffers, measured and predicted, and the read-ahead.

    Merged: each worker buffers in its own memory, so every figure is the
    largest one worker had (the peak with its tensor, the prediction with
    its reason), never a sum.

    Attributes:
        peak_buffer_bytes: the most bytes vLLM's layer buffers held at once, measured.
        peak_tensor: the tensor being handed over at that peak.
        predicted_peak_buffer_bytes: the plan's prediction of that peak.
        largest_layer_bytes: bytes of the largest parent layer (the least any order can buffer).
        held_to_end_bytes: bytes of the layers the plan expected vLLM to hold to the end of the stream.
        above_largest_layer_because: why the predicted peak is above the largest layer (None when it is not).
        readahead_peak_bytes: the most bytes read ahead but not yet handed over.
        in_place_layers: layers vLLM loaded into the engine's own tensors instead of fresh ones it copies
            over (their processing keeps the loaded layout: `layers[].in_place`); merged: the most on one rank.
        in_place_bytes: the bytes of engine tensors those layers did not allocate afresh.
    """

    peak_buffer_bytes: int
    peak_tensor: str
    predicted_peak_buffer_bytes: int
    largest_layer_bytes: int
    held_to_end_bytes: int = 0
    above_largest_layer_because: str | None = None
    readahead_peak_bytes: int = 0
    in_place_layers: int = 0
    in_place_bytes: int = 0

    @classmethod
    def merged(cls, parts: Sequence[Memory]) -> Memory:
        """The worst worker's peak and the largest prediction, each with what explains it; else maxima."""
        worst = max(parts, key=lambda part: part.peak_buffer_bytes)
        # Ranks may hold different layers to the end (vocabulary padding falls on the last ranks).
        predicted = max(parts, key=lambda part: part.predicted_peak_buffer_bytes)
        return cls(peak_buffer_bytes=worst.peak_buffer_bytes, peak_tensor=worst.peak_tensor,
                   predicted_peak_buffer_bytes=predicted.predicted_peak_buffer_bytes,
                   largest_layer_bytes=max(part.largest_layer_bytes for part in parts),
                   held_to_end_bytes=max(part.held_to_end_bytes for part in parts),
                   above_largest_layer_because=predicted.above_largest_layer_because,
                   readahead_peak_bytes=max(part.readahead_peak_bytes for part in parts),
                   in_place_layers=max(part.in_place_layers for part in parts),
                   in_place_bytes=max(part.in_place_bytes for part in parts))


@dataclass(frozen=True)
class Timings:
    """Where the reload's seconds went: on the engine's thread, on the reading thread, and around the stream.

    Merged: the workers run at once, so each figure is the longest one
    worker took (every field: a new timer needs no line in the rule).

    Attributes:
        wall_s: seconds from the first tensor handed over to the end of vLLM's processing.
        finalize_s: seconds vLLM spent after the last tensor (layers it processes only then).
        handover_s: seconds the engine's thread spent in the stream between tensors (waiting for the
            reading thread, bookkeeping): the part of `wall_s` that is layerwise's.
        vllm_s: `wall_s` less `handover_s` and `patch_s`: vLLM loading, processing and finalizing (and the CPU
            repairs).
        read_s: seconds the reading thread spent getting tensors from the shards (CPU: mapping them, the
            bytes come in with the check or the engine's copy; CUDA: also staging in pinned memory).
        check_s: seconds the reading thread spent in the NaN/Inf check.
        hash_s: seconds the reading thread spent hashing bytes in full to decide a skip (no header digests).
        sample_s: seconds the reading thread spent taking each tensor's spot sample for the records.
        fingerprint_s: seconds spent taking the layers' fingerprints (before deciding, and after loading; on
            the CPU the reading thread takes most of the latter while the engine loads later layers).
        spot_check_s: seconds the spot check of header digests took (before the engine is touched).
        hash_wait_s: seconds waited after vLLM's reload (outside `wall_s`) for the reading thread to finish
            hashing the layers handed over before any hash (`UnchangedLayers.hashed_after_handover`).
        patch_s: seconds a sparse delta took to patch its layers in place and prove them against the step's
            digests (`Volume.patched_layers`), before the first tensor is handed to vLLM (inside `wall_s`).
        plan_s: seconds of the plan phase before it (outside `wall_s`, the engine not yet touched): SOURCE
            opened, planned for the rank, pre-flighted, what to skip decided, a delta checked, the ranks' vote.
            Inside a server's pause unless the pre-flight before it prepared it (`worker/state/prepared.py`).
    """

    wall_s: float
    finalize_s: float = 0.0
    handover_s: float = 0.0
    vllm_s: float = 0.0
    read_s: float = 0.0
    check_s: float = 0.0
    hash_s: float = 0.0
    sample_s: float = 0.0
    fingerprint_s: float = 0.0
    spot_check_s: float = 0.0
    hash_wait_s: float = 0.0
    patch_s: float = 0.0
    plan_s: float = 0.0

    @classmethod
    def merged(cls, parts: Sequence[Timings]) -> Timings:
        """Every timer's longest across PARTS."""
        return cls(**{timer.name: max(getattr(part, timer.name) for part in parts) for timer in fields(cls)})


@dataclass(frozen=True)
class UnchangedLayers:
    """The layers not handed to vLLM because the engine already held their bytes, and how that was decided.

    Merged: skipped layers are counted from the merged `layers` (a layer is
    skipped only where every rank holding it skipped it); the digests'
    origin is the workers' common one, else `mixed`; stale header digests
    are listed once each; every count is the most on one worker.

    Attributes:
        all_layers: every layer was handed over whatever the records said (`--all`).
        digests: where the layer digests came from: `header` (the shards' `layerwise.digests`, no read
            needed), `read` (hashed as read), `mixed`, or `none` (no records kept).
        skipped_layers: parent layers not handed to vLLM because the engine already held their bytes
            (`layers[].skipped`); vLLM kept them as they were.
        skipped_bytes: their bytes in the source (never read when the headers carry digests).
        stale_layers: layers whose source digest matched the record but whose state in the engine had
            changed since (another reload, a rollback): reloaded.
        spot_checked_layers: layers the header digests would skip whose sampled bytes were read and
            compared with what the engine loaded (`checkpoint.samples`).
        spot_check_bytes: bytes that spot check read from the files (not in `Volume.read_bytes`).
        stale_header_digests: per layer whose header digest claimed the engine's bytes while its sampled
            bytes differ: `{"layer", "tensor", "file"}`; each was reloaded.
        hashed_after_handover: layers handed over before any hash (their samples showed them changed, or no
            hash could skip them now), hashed afterwards while the reading thread waited, for the next reload.
        unhashed_layers: such layers streamed without read-ahead (never hashed): recorded by their samples
            alone, so they are not skipped on the next reload.
    """

    all_layers: bool = False
    digests: str = "none"
    skipped_layers: int = 0
    skipped_bytes: int = 0
    stale_layers: int = 0
    spot_checked_layers: int = 0
    spot_check_bytes: int = 0
    stale_header_digests: tuple[dict, ...] = ()
    hashed_after_handover: int = 0
    unhashed_layers: int = 0

    def __post_init__(self) -> None:
        _as_tuples(self, "stale_header_digests")

    @classmethod
    def merged(cls, parts: Sequence[UnchangedLayers], layers: Sequence[LayerReport]) -> UnchangedLayers:
        """The skips as the merged LAYERS show them, and the most any of PARTS counted of the rest."""
        found = {(d["layer"], d["tensor"], d["file"]): d for part in parts for d in part.stale_header_digests}
        return cls(all_layers=parts[0].all_layers,
                   digests=parts[0].digests if len({part.digests for part in parts}) == 1 else "mixed",
                   skipped_layers=sum(1 for layer in layers if layer.skipped),
                   skipped_bytes=sum(layer.bytes for layer in layers if layer.skipped),
                   stale_layers=max(part.stale_layers for part in parts),
                   spot_checked_layers=max(part.spot_checked_layers for part in parts),
                   spot_check_bytes=max(part.spot_check_bytes for part in parts),
                   stale_header_digests=sorted(found.values(), key=lambda d: (d["file"], d["layer"])),
                   hashed_after_handover=max(part.hashed_after_handover for part in parts),
                   unhashed_layers=max(part.unhashed_layers for part in parts))


@dataclass(frozen=True)
class Findings:
    """What the reload found and did beyond loading: notes, refreshed tensors, surprises, the verification.

    Merged: notes and unexpected tensors are the workers' together, once
    each and sorted; a tensor refreshed on several ranks (each its own
    shard) is listed once; the verification is the caller's, of the whole
    engine.

    Attributes:
        notes: things the user should know (repairs made after vLLM's reload, missing reference).
        unexpected: tensors whose buffering differed from the plan (parent not where expected).
        refreshed: every tensor layerwise refreshed beyond vLLM's reload (`DerivedRefresh`: a buffer
            derived at load, a tied head's packed kernel, re-packed MoE experts), one per tensor.
        verify: with `--verify` / `reload(..., verify=True)`, the engine checked
            against SOURCE after the reload; None otherwise.
    """

    notes: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    refreshed: tuple[DerivedRefresh, ...] = ()
    verify: VerifyResult | None = None

    def __post_init__(self) -> None:
        _as_tuples(self, "notes", "unexpected", "refreshed")

    @classmethod
    def merged(cls, parts: Sequence[Findings], verify: VerifyResult | None) -> Findings:
        """PARTS' notes, surprises and refreshed tensors once each, with the engine's VERIFY."""
        return cls(notes=sorted({note for part in parts for note in part.notes}),
                   unexpected=sorted({name for part in parts for name in part.unexpected}),
                   # Each rank refreshes its own shard of a tensor: one entry per tensor.
                   refreshed=list({(e.module, e.tensor): e for part in parts for e in part.refreshed}.values()),
                   verify=verify)
