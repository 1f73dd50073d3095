"""What a reload did, layer by layer: built inside each worker, merged across workers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from layerwise_cli.report.verify_result import VerifyResult


@dataclass
class LayerReport:
    """One parent layer as the engine took it."""

    name: str
    tensors: int
    bytes: int
    # Seconds from handing over the layer's first tensor to handing over its last.
    load_s: float
    # Seconds vLLM spent on the handover that completed the layer: it
    # materializes the layer, runs the weight loaders on the buffered tensors,
    # processes (online quantization, repacking) and copies into place.
    process_s: float
    # Bytes held in vLLM's layer buffers when this layer completed, counting
    # the tensor that completed it.
    buffered_bytes_at_completion: int
    # False when vLLM processed it only in finalize (attention, padded layers).
    completed_during_stream: bool = True
    # Why the plan expected vLLM to hold it to the end (None: expected to complete).
    held_to_end: str | None = None

    @property
    def seconds(self) -> float:
        return self.load_s + self.process_s


@dataclass(frozen=True)
class RankSummary:
    """One worker of a merged report: where it sits and what it read and buffered."""

    rank: int | None
    pp_rank: int
    tp_rank: int
    dp_rank: int
    # The parent layers this rank held and loaded, in the order it loaded them.
    layers: list[str]
    bytes: int
    tensors: int
    # Bytes this rank's process caused to be read from storage during the reload (None: not measurable;
    # page-cache hits do not count).
    disk_read_bytes: int | None
    peak_buffer_bytes: int
    predicted_peak_buffer_bytes: int
    wall_s: float
    # Tensors of the source other ranks hold (another pipeline stage, other experts): not read here.
    elsewhere_tensors: int = 0

    @classmethod
    def of(cls, report: ReloadReport) -> RankSummary:
        position = report.position or {}
        return cls(rank=report.rank, pp_rank=position.get("pp_rank", 0), tp_rank=position.get("tp_rank", 0),
                   dp_rank=position.get("dp_rank", 0), layers=[layer.name for layer in report.layers],
                   bytes=report.bytes, tensors=report.tensors, disk_read_bytes=report.disk_read_bytes,
                   peak_buffer_bytes=report.peak_buffer_bytes,
                   predicted_peak_buffer_bytes=report.predicted_peak_buffer_bytes, wall_s=report.wall_s,
                   elsewhere_tensors=report.elsewhere_tensors)

    def label(self) -> str:
        """`rank 1 (pp 1, tp 0, dp 0)`."""
        return f"rank {self.rank} (pp {self.pp_rank}, tp {self.tp_rank}, dp {self.dp_rank})"


@dataclass
class ReloadReport:
    """One worker's reload (or several merged)."""

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
    layers: list[LayerReport] = field(default_factory=list)
    workers: int = 1
    rank: int | None = None
    # Tensors whose buffering differed from the plan (parent not where expected).
    unexpected: list[str] = field(default_factory=list)
    mapping: str = ""
    device: str = "cpu"
    finalize_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # `--verify` / `reload(..., verify=True)`: the engine checked against SOURCE after the reload.
    verify: VerifyResult | None = None
    # Bytes of the layers the plan expected vLLM to hold to the end of the stream.
    held_to_end_bytes: int = 0
    # Why the predicted peak is above the largest layer (None when it is not).
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

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    @property
    def peak_over_largest(self) -> float:
        return self.peak_buffer_bytes / self.largest_layer_bytes if self.largest_layer_bytes else 0.0

    @property
    def matches_prediction(self) -> bool:
        return self.peak_buffer_bytes == self.predicted_peak_buffer_bytes

    def to_dict(self) -> dict:
        """JSON-ready: bytes as integers, seconds as floats."""
        data = asdict(self)
        data["gb_per_s"] = self.gb_per_s
        data["peak_over_largest_layer"] = self.peak_over_largest
        data["matches_prediction"] = self.matches_prediction
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ReloadReport:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["layers"] = [LayerReport(**layer) for layer in data.get("layers", [])]
        if data.get("verify") is not None:
            fields["verify"] = VerifyResult.from_dict(data["verify"])
        fields["ranks"] = [RankSummary(**rank) for rank in data.get("ranks", [])]
        return cls(**fields)


def merge_reports(reports: list[ReloadReport]) -> ReloadReport:
    """Merge the reports of an engine's workers (and of a server's data-parallel engines) into one.

    Tensor-parallel workers each stream their stage's tensors and buffer in
    their own memory, so per-worker figures are maxima across workers, not
    sums. Pipeline stages hold different layers: the merged report lists each
    layer once (its figures the maxima over the ranks that hold it), and
    `bytes`/`tensors` add up the stages of one engine. `ranks` lists every
    worker: its rank, pp/tp/dp rank, the layers it held and what it read.
    """
    if not reports:
        raise ValueError("no worker reports to merge")
    ordered = sorted(reports, key=_rank_key)
    ranks = [RankSummary.of(r) for r in ordered]
    if len(reports) == 1:
        from dataclasses import replace

        return replace(reports[0], ranks=ranks)
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
        source=first.source,
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
        ranks=ranks,
        engines=len({rank.dp_rank for rank in ranks}),
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
