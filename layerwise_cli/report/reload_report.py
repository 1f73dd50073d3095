"""What a reload did, layer by layer: built inside each worker, merged across workers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from layerwise_cli.report.jsonable import jsonable
from layerwise_cli.report.verify_result import VerifyResult


@dataclass(frozen=True)
class LayerReport:
    """One parent layer as the engine took it (see the comments on each field)."""

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
        verify: with `--verify` / `reload(..., verify=True)`, the engine checked
            against SOURCE after the reload; None otherwise.
        held_to_end_bytes: bytes of the layers the plan expected vLLM to hold to the end of the stream.
        above_largest_layer_because: why the predicted peak is above the largest layer (None when it is not).
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

    def __post_init__(self) -> None:
        for name in ("layers", "unexpected", "notes"):
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
        return cls(**fields)


def merge_reports(reports: list[ReloadReport], *, source: str | None = None,
                  verify: VerifyResult | None = None) -> ReloadReport:
    """Merge the reports of tensor-parallel workers into the report of the reload.

    Every worker streams the whole checkpoint and buffers in its own memory,
    so per-worker figures are maxima across workers, not sums.

    Args:
        reports: one report per worker (at least one).
        source: the source as the user named it, when the workers read it
            under another name (a Hub repo id downloaded to a local folder);
            None keeps the workers' `source`.
        verify: the verification of the engine after the reload, if any.

    Returns:
        The merged report (a single worker's report, with SOURCE and VERIFY).

    Raises:
        ValueError: no reports.
    """
    if not reports:
        raise ValueError("no worker reports to merge")
    first = reports[0]
    if len(reports) == 1:
        return replace(first, source=first.source if source is None else source, verify=verify)
    worst = max(reports, key=lambda r: r.peak_buffer_bytes)
    layers = []
    for per_worker in zip(*(r.layers for r in reports)):
        base = per_worker[0]
        layers.append(LayerReport(
            name=base.name,
            tensors=base.tensors,
            bytes=base.bytes,
            load_s=max(layer.load_s for layer in per_worker),
            process_s=max(layer.process_s for layer in per_worker),
            buffered_bytes_at_completion=max(layer.buffered_bytes_at_completion for layer in per_worker),
            completed_during_stream=all(layer.completed_during_stream for layer in per_worker),
            held_to_end=next((layer.held_to_end for layer in per_worker if layer.held_to_end), None),
        ))
    # Ranks may hold different layers to the end (vocabulary padding falls on the last ranks).
    predicted = max(reports, key=lambda r: r.predicted_peak_buffer_bytes)
    return ReloadReport(
        order=first.order,
        source=first.source if source is None else source,
        wall_s=max(r.wall_s for r in reports),
        bytes=first.bytes,
        tensors=first.tensors,
        peak_buffer_bytes=worst.peak_buffer_bytes,
        peak_tensor=worst.peak_tensor,
        predicted_peak_buffer_bytes=predicted.predicted_peak_buffer_bytes,
        largest_layer_bytes=first.largest_layer_bytes,
        readahead_peak_bytes=max(r.readahead_peak_bytes for r in reports),
        layers=layers,
        workers=len(reports),
        unexpected=sorted({name for r in reports for name in r.unexpected}),
        mapping=first.mapping,
        device=first.device,
        finalize_s=max(r.finalize_s for r in reports),
        notes=sorted({note for r in reports for note in r.notes}),
        held_to_end_bytes=max(r.held_to_end_bytes for r in reports),
        above_largest_layer_because=predicted.above_largest_layer_because,
        verify=verify,
    )
