"""What a reload did, layer by layer: built inside each worker, merged across workers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from layerwise_cli.report.jsonable import jsonable
from layerwise_cli.report.report_parts import DerivedRefresh, LayerReport, RankSummary
from layerwise_cli.report.verify_result import VerifyResult


@dataclass(frozen=True)
class ReloadReport:
    """What a reload did: one worker's report, or the workers' reports merged; built once, never changed.

    Merged across tensor-parallel workers, per-worker figures are maxima (each
    worker streams the whole checkpoint). Lists given for `layers`,
    `unexpected` and `notes` are stored as tuples; `to_dict` gives lists.

    Attributes:
        order: `layer` or `file`, the order the tensors were handed over in.
        source: the checkpoint, as the user named it.
        wall_s: seconds from the first tensor handed over to the end of vLLM's processing.
        bytes: bytes of the tensors the engine loaded.
        tensors: tensors streamed.
        peak_buffer_bytes: the most bytes vLLM's layer buffers held at once, measured.
        peak_tensor: the tensor being handed over at that peak.
        predicted_peak_buffer_bytes: the plan's prediction of that peak.
        largest_layer_bytes: bytes of the largest parent layer (the least any order can buffer).
        readahead_peak_bytes: the most bytes read ahead but not yet handed over.
        layers: one `LayerReport` per parent layer, in the order the stream reached them.
        workers: workers merged into this report.
        rank: the worker's rank (None once merged, or outside tensor parallel).
        unexpected: tensors whose buffering differed from the plan (parent not where expected).
        mapping: how tensors were mapped to parent layers (`LayerMapping.description`).
        device: where the engine holds its weights (`cpu`, `cuda:0`).
        finalize_s: seconds vLLM spent after the last tensor (layers it processes only then).
        notes: things the user should know (repairs made after vLLM's reload, missing reference).
        refreshed: every tensor layerwise refreshed beyond vLLM's reload (`DerivedRefresh`: a buffer
            derived at load, a tied head's packed kernel, re-packed MoE experts), one per tensor.
        verify: with `--verify` / `reload(..., verify=True)`, the engine checked
            against SOURCE after the reload; None otherwise.
        held_to_end_bytes: bytes of the layers the plan expected vLLM to hold to the end of the stream.
        above_largest_layer_because: why the predicted peak is above the largest layer (None when it is not).
        position: one worker's place: rank, tp/pp/dp rank and size (empty in a merged report: see `ranks`).
        elsewhere_tensors: tensors of the source that other ranks hold (another pipeline stage, other
            experts), not read by this worker.
        elsewhere_bytes: their bytes.
        disk_read_bytes: bytes read from storage by the worker's process during the reload (None: not
            measurable; page-cache hits do not count).
        ranks: in a merged report, every worker (`RankSummary`), in (dp, pp, tp) order.
        engines: data-parallel engines merged into this report.
        skipped_layers: parent layers not handed to vLLM because the engine already held their bytes
            (`layers[].skipped`); vLLM kept them as they were.
        skipped_bytes: their bytes in the source (never read when the headers carry digests).
        read_bytes: bytes of tensor data this worker read from SOURCE (merged: the most one worker read;
            None: not measured).
        engine_id: the id of the worker's records, made once per worker process (a restarted engine has a
            new one and no records); in a merged report the first worker's (every worker's in `ranks`).
        all_layers: every layer was handed over whatever the records said (`--all`).
        digests: where the layer digests came from: `header` (the shards' `layerwise.digests`, no read
            needed), `read` (hashed as read), `mixed`, or `none` (no records kept).
        stale_layers: layers whose source digest matched the record but whose state in the engine had
            changed since (another reload, a rollback): reloaded.
        hash_s: seconds the reading thread spent hashing bytes in full to decide a skip (no header digests).
        fingerprint_s: seconds spent taking the layers' fingerprints (before deciding, and after loading; on
            the CPU the reading thread takes most of the latter while the engine loads later layers).
        read_s: seconds the reading thread spent getting tensors from the shards (CPU: mapping them, the
            bytes come in with the check or the engine's copy; CUDA: also staging in pinned memory).
        sample_s: seconds the reading thread spent taking each tensor's spot sample for the records.
        check_s: seconds the reading thread spent in the NaN/Inf check.
        handover_s: seconds the engine's thread spent in the stream between tensors (waiting for the
            reading thread, bookkeeping): the part of `wall_s` that is layerwise's.
        vllm_s: `wall_s` less `handover_s`: vLLM loading, processing and finalizing (and the CPU repairs).
        hashed_after_handover: layers handed over before any hash (their samples showed them changed, or no
            hash could skip them now), hashed afterwards while the reading thread waited, for the next reload.
        unhashed_layers: such layers streamed without read-ahead (never hashed): recorded by their samples
            alone, so they are not skipped on the next reload.
        hash_wait_s: seconds waited after vLLM's reload (outside `wall_s`) for the reading thread to finish
            hashing those layers.
        reader_cpus: the CPUs the read-ahead thread ran on (None: no read-ahead; merged: rank 0's).
        spot_checked_layers: layers the header digests would skip whose sampled bytes were read and
            compared with what the engine loaded (`checkpoint.samples`).
        spot_check_bytes: bytes that spot check read from the files (not in `read_bytes`).
        spot_check_s: its seconds (before the engine is touched).
        stale_header_digests: per layer whose header digest claimed the engine's bytes while its sampled
            bytes differ: `{"layer", "tensor", "file"}`; each was reloaded.
        in_place_layers: layers vLLM loaded into the engine's own tensors instead of fresh ones it copies
            over (their processing keeps the loaded layout: `layers[].in_place`); merged: the most on one rank.
        in_place_bytes: the bytes of engine tensors those layers did not allocate afresh.
        gb_per_s: `bytes` over `wall_s`, in GB/s (a property).
        peak_over_largest: `peak_buffer_bytes` over `largest_layer_bytes` (a property).
        matches_prediction: whether the measured peak equals the predicted one (a property).
    """

    order: str
    source: str
    wall_s: float
    bytes: int
    tensors: int
    peak_buffer_bytes: int
    peak_tensor: str
    predicted_peak_buffer_bytes: int
    largest_layer_bytes: int
    readahead_peak_bytes: int = 0
    layers: tuple[LayerReport, ...] = ()
    workers: int = 1
    rank: int | None = None
    unexpected: tuple[str, ...] = ()
    mapping: str = ""
    device: str = "cpu"
    finalize_s: float = 0.0
    notes: tuple[str, ...] = ()
    verify: VerifyResult | None = None
    held_to_end_bytes: int = 0
    above_largest_layer_because: str | None = None
    # One worker's place: rank, tp/pp/dp rank and size (empty in a merged report: see `ranks`).
    position: dict = field(default_factory=dict)
    # Tensors (and their bytes) of the source that other ranks hold: not read by this worker.
    elsewhere_tensors: int = 0
    elsewhere_bytes: int = 0
    # Bytes read from storage by the worker's process during the reload (None: not measurable).
    disk_read_bytes: int | None = None
    # A merged report: every worker, in (dp, pp, tp) order; the data-parallel engines merged.
    ranks: list[RankSummary] = field(default_factory=list)
    engines: int = 1
    skipped_layers: int = 0
    skipped_bytes: int = 0
    read_bytes: int | None = None
    engine_id: str | None = None
    all_layers: bool = False
    digests: str = "none"
    stale_layers: int = 0
    hash_s: float = 0.0
    fingerprint_s: float = 0.0
    read_s: float = 0.0
    sample_s: float = 0.0
    check_s: float = 0.0
    handover_s: float = 0.0
    vllm_s: float = 0.0
    hashed_after_handover: int = 0
    unhashed_layers: int = 0
    hash_wait_s: float = 0.0
    reader_cpus: list[int] | None = None
    spot_checked_layers: int = 0
    spot_check_bytes: int = 0
    spot_check_s: float = 0.0
    stale_header_digests: tuple[dict, ...] = ()
    refreshed: tuple[DerivedRefresh, ...] = ()
    in_place_layers: int = 0
    in_place_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "unexpected", "notes", "ranks", "stale_header_digests", "refreshed"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def gb_per_s(self) -> float:
        """Bytes loaded per second of wall time, in GB/s."""
        return self.bytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    @property
    def peak_over_largest(self) -> float:
        """The measured peak as a multiple of the largest layer (1.0 is the least possible)."""
        return self.peak_buffer_bytes / self.largest_layer_bytes if self.largest_layer_bytes else 0.0

    @property
    def matches_prediction(self) -> bool:
        """Whether the measured peak equals the plan's prediction, byte for byte."""
        return self.peak_buffer_bytes == self.predicted_peak_buffer_bytes

    def to_dict(self) -> dict:
        """JSON-ready: bytes as integers, seconds as floats, lists for sequences."""
        data = jsonable(asdict(self))
        data["gb_per_s"] = self.gb_per_s
        data["peak_over_largest_layer"] = self.peak_over_largest
        data["matches_prediction"] = self.matches_prediction
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ReloadReport:
        """The report `to_dict` wrote (keys it does not know are ignored)."""
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["layers"] = [LayerReport(**layer) for layer in data.get("layers", [])]
        if data.get("verify") is not None:
            fields["verify"] = VerifyResult.from_dict(data["verify"])
        fields["refreshed"] = [DerivedRefresh(**entry) for entry in data.get("refreshed", [])]
        fields["ranks"] = [RankSummary(**{**rank, "layers": tuple(rank["layers"])}) for rank in data.get("ranks", [])]
        return cls(**fields)


def merge_reports(reports: list[ReloadReport], *, source: str | None = None,
                  verify: VerifyResult | None = None) -> ReloadReport:
    """Merge the reports of an engine's workers (and of a server's data-parallel engines) into one.

    Tensor-parallel workers each stream their stage's tensors and buffer in
    their own memory, so per-worker figures are maxima across workers, not
    sums. Pipeline stages hold different layers: the merged report lists each
    layer once (its figures the maxima over the ranks that hold it), and
    `bytes`/`tensors` add up the stages of one engine. `ranks` lists every
    worker: its rank, pp/tp/dp rank, the layers it held and what it read.

    Args:
        reports: one report per worker (at least one).
        source: the source as the user named it, when the workers read it
            under another name (a Hub repo id downloaded to a local folder);
            None keeps the workers' `source`.
        verify: the verification of the engine after the reload, if any.

    Returns:
        The merged report.

    Raises:
        ValueError: no reports.
    """
    if not reports:
        raise ValueError("no worker reports to merge")
    ordered = sorted(reports, key=_rank_key)
    ranks = [RankSummary.of(r) for r in ordered]
    if len(reports) == 1:
        only = reports[0]
        return replace(only, ranks=ranks, source=only.source if source is None else source, verify=verify)
    first = ordered[0]
    worst = max(ordered, key=lambda r: r.peak_buffer_bytes)
    by_name: dict[str, list[LayerReport]] = {}
    for report in ordered:
        for layer in report.layers:
            by_name.setdefault(layer.name, []).append(layer)
    layers = []
    for name, per_worker in by_name.items():
        base = per_worker[0]
        layers.append(LayerReport(
            name=name,
            tensors=base.tensors,
            bytes=base.bytes,
            load_s=max(layer.load_s for layer in per_worker),
            process_s=max(layer.process_s for layer in per_worker),
            buffered_bytes_at_completion=max(layer.buffered_bytes_at_completion for layer in per_worker),
            completed_during_stream=all(layer.completed_during_stream for layer in per_worker),
            held_to_end=next((layer.held_to_end for layer in per_worker if layer.held_to_end), None),
            # Skipped only where every rank holding it skipped it.
            skipped=base.skipped if all(layer.skipped for layer in per_worker) else None,
            in_place=all(layer.in_place for layer in per_worker),
        ))
    # Ranks may hold different layers to the end (vocabulary padding falls on the last ranks).
    predicted = max(ordered, key=lambda r: r.predicted_peak_buffer_bytes)
    # One engine's stages each stream their own part: add the stages up (the first engine; DP engines match).
    stages: dict[int, ReloadReport] = {}
    for report in ordered:
        if (report.position or {}).get("dp_rank", 0) == (first.position or {}).get("dp_rank", 0):
            stages.setdefault((report.position or {}).get("pp_rank", 0), report)
    return ReloadReport(
        order=first.order,
        source=first.source if source is None else source,
        wall_s=max(r.wall_s for r in ordered),
        bytes=sum(r.bytes for r in stages.values()),
        tensors=sum(r.tensors for r in stages.values()),
        peak_buffer_bytes=worst.peak_buffer_bytes,
        peak_tensor=worst.peak_tensor,
        predicted_peak_buffer_bytes=predicted.predicted_peak_buffer_bytes,
        largest_layer_bytes=max(r.largest_layer_bytes for r in ordered),
        readahead_peak_bytes=max(r.readahead_peak_bytes for r in ordered),
        layers=layers,
        workers=len(ordered),
        unexpected=sorted({name for r in ordered for name in r.unexpected}),
        mapping=first.mapping,
        device=first.device,
        finalize_s=max(r.finalize_s for r in ordered),
        notes=sorted({note for r in ordered for note in r.notes}),
        held_to_end_bytes=max(r.held_to_end_bytes for r in ordered),
        above_largest_layer_because=predicted.above_largest_layer_because,
        verify=verify,
        ranks=ranks,
        engines=len({rank.dp_rank for rank in ranks}),
        skipped_layers=sum(1 for layer in layers if layer.skipped),
        skipped_bytes=sum(layer.bytes for layer in layers if layer.skipped),
        read_bytes=None if any(r.read_bytes is None for r in ordered) else max(r.read_bytes for r in ordered),
        engine_id=first.engine_id,
        all_layers=first.all_layers,
        digests=first.digests if len({r.digests for r in ordered}) == 1 else "mixed",
        stale_layers=max(r.stale_layers for r in ordered),
        hash_s=max(r.hash_s for r in ordered),
        fingerprint_s=max(r.fingerprint_s for r in ordered),
        read_s=max(r.read_s for r in ordered),
        sample_s=max(r.sample_s for r in ordered),
        check_s=max(r.check_s for r in ordered),
        handover_s=max(r.handover_s for r in ordered),
        vllm_s=max(r.vllm_s for r in ordered),
        hashed_after_handover=max(r.hashed_after_handover for r in ordered),
        unhashed_layers=max(r.unhashed_layers for r in ordered),
        hash_wait_s=max(r.hash_wait_s for r in ordered),
        reader_cpus=first.reader_cpus,
        spot_checked_layers=max(r.spot_checked_layers for r in ordered),
        spot_check_bytes=max(r.spot_check_bytes for r in ordered),
        spot_check_s=max(r.spot_check_s for r in ordered),
        stale_header_digests=sorted({(d["layer"], d["tensor"], d["file"]): d for r in ordered
                                     for d in r.stale_header_digests}.values(),
                                    key=lambda d: (d["file"], d["layer"])),
        # Each rank refreshes its own shard of a tensor: one entry per tensor.
        refreshed=list({(e.module, e.tensor): e for r in ordered for e in r.refreshed}.values()),
        in_place_layers=max(r.in_place_layers for r in ordered),
        in_place_bytes=max(r.in_place_bytes for r in ordered),
    )


def _rank_key(report: ReloadReport) -> tuple[int, int, int, int]:
    position = report.position or {}
    return (position.get("dp_rank", 0), position.get("pp_rank", 0), position.get("tp_rank", 0),
            report.rank if report.rank is not None else 0)


def first_failure(results: list) -> str | None:
    """The error of the worker that failed first-hand (not one that only followed another rank), or None.

    Named by its place when the engine has several ranks: `rank 1 (pp 1, tp 0, dp 0): ...`.
    """
    failures = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
    if not failures and results:
        return None
    if not failures:
        return "no workers answered"
    own = [r for r in failures if isinstance(r, dict) and not r.get("followed_another_rank")]
    failure = (own or failures)[0]
    if not isinstance(failure, dict):
        return str(failure)
    error = failure.get("error") or "a worker failed without saying why"
    position = failure.get("position") or {}
    several = len(results) > 1 or position.get("dp_size", 1) > 1
    if several and position:
        where = (f"rank {position.get('rank')} (pp {position.get('pp_rank', 0)}, tp {position.get('tp_rank', 0)}, "
                 f"dp {position.get('dp_rank', 0)})")
        return f"{where}: {error}"
    return error
