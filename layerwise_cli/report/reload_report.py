"""What a reload did, layer by layer: built inside each worker, merged across workers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from layerwise_cli.report.jsonable import jsonable
from layerwise_cli.report.records import DerivedRefresh, LayerReport, RankSummary, merge_layers, rank_label
from layerwise_cli.report.sections import Findings, Memory, Placement, Timings, UnchangedLayers, Volume
from layerwise_cli.report.verify_result import VerifyResult


@dataclass(frozen=True)
class ReloadReport:
    """What a reload did: one worker's report, or the workers' reports merged; built once, never changed.

    The report is made of sections by meaning (`layerwise_cli.report.sections`),
    each merged across workers by its own rule: merged across tensor-parallel
    workers, per-worker figures are maxima (each worker streams the whole
    checkpoint). Lists given for `layers` and within the sections are stored
    as tuples; `to_dict` gives lists, in one flat object (each section's
    fields as top-level keys, as before the report had sections).

    Attributes:
        placement: which reload this was and where it ran (`Placement`: source, order, mapping,
            device, the worker's rank and position, engine id, reader CPUs, workers, engines, ranks).
        volume: what it moved (`Volume`: bytes and tensors loaded, bytes read from SOURCE and from
            storage, what other ranks hold).
        memory: what it held at once (`Memory`: the measured and predicted buffer peak, the largest
            layer, layers held to the end, the read-ahead peak, layers loaded in place).
        timings: where its seconds went (`Timings`: wall, handover, vLLM, finalize, and the reading
            thread's read, check, hash and sample; fingerprints, spot check, hash wait).
        unchanged: the layers not handed over because the engine already held their bytes
            (`UnchangedLayers`: skipped layers and bytes, where the digests came from, stale layers,
            the spot check, layers hashed after their handover).
        findings: what it found and did beyond loading (`Findings`: notes, unexpected tensors,
            refreshed tensors, the verification).
        layers: one `LayerReport` per parent layer, in the order the stream reached them.
        wall_s, bytes, peak_buffer_bytes, largest_layer_bytes, verify: the headline figures,
            as properties (`timings.wall_s`, `volume.bytes`, `memory.peak_buffer_bytes`,
            `memory.largest_layer_bytes`, `findings.verify`).
        gb_per_s: `bytes` over `wall_s`, in GB/s (a property).
        peak_over_largest: `peak_buffer_bytes` over `largest_layer_bytes` (a property).
        matches_prediction: whether the measured peak equals the predicted one (a property).
    """

    placement: Placement
    volume: Volume
    memory: Memory
    timings: Timings
    unchanged: UnchangedLayers = field(default_factory=UnchangedLayers)
    findings: Findings = field(default_factory=Findings)
    layers: tuple[LayerReport, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))

    @property
    def wall_s(self) -> float:
        """Seconds from the first tensor handed over to the end of vLLM's processing (`timings.wall_s`)."""
        return self.timings.wall_s

    @property
    def bytes(self) -> int:
        """Bytes of the tensors the engine loaded (`volume.bytes`)."""
        return self.volume.bytes

    @property
    def peak_buffer_bytes(self) -> int:
        """The most bytes vLLM's layer buffers held at once, measured (`memory.peak_buffer_bytes`)."""
        return self.memory.peak_buffer_bytes

    @property
    def largest_layer_bytes(self) -> int:
        """Bytes of the largest parent layer, the least any order can buffer (`memory.largest_layer_bytes`)."""
        return self.memory.largest_layer_bytes

    @property
    def verify(self) -> VerifyResult | None:
        """The engine checked against SOURCE after the reload, with `--verify`; None otherwise (`findings.verify`)."""
        return self.findings.verify

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
        return self.peak_buffer_bytes == self.memory.predicted_peak_buffer_bytes

    def to_dict(self) -> dict:
        """JSON-ready, one flat object: bytes as integers, seconds as floats, lists for sequences."""
        data: dict = {}
        for name in SECTIONS:
            data.update(asdict(getattr(self, name)))
        data["layers"] = [asdict(layer) for layer in self.layers]
        data = jsonable(data)
        data["gb_per_s"] = self.gb_per_s
        data["peak_over_largest_layer"] = self.peak_over_largest
        data["matches_prediction"] = self.matches_prediction
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ReloadReport:
        """The report `to_dict` wrote (keys it does not know, such as an older worker's, are ignored)."""
        verify = data.get("verify")
        return cls(
            placement=_section(Placement, data, ranks=[RankSummary.from_dict(r) for r in data.get("ranks", [])]),
            volume=_section(Volume, data),
            memory=_section(Memory, data),
            timings=_section(Timings, data),
            unchanged=_section(UnchangedLayers, data),
            findings=_section(Findings, data, verify=None if verify is None else VerifyResult.from_dict(verify),
                              refreshed=[DerivedRefresh(**entry) for entry in data.get("refreshed", [])]),
            layers=[LayerReport.from_dict(layer) for layer in data.get("layers", [])],
        )


# The report's sections (every field but `layers`), in the order `to_dict` writes their keys.
SECTIONS = tuple(f.name for f in fields(ReloadReport) if f.name != "layers")


def _section(cls: type, data: dict, **converted: object):
    """The section CLS from the flat keys of DATA that are its fields, with CONVERTED in place of their JSON."""
    return cls(**{**{f.name: data[f.name] for f in fields(cls) if f.name in data}, **converted})


def merge_reports(reports: list[ReloadReport], *, source: str | None = None,
                  verify: VerifyResult | None = None) -> ReloadReport:
    """Merge the reports of an engine's workers (and of a server's data-parallel engines) into one.

    Tensor-parallel workers each stream their stage's tensors and buffer in
    their own memory, so per-worker figures are maxima across workers, not
    sums. Pipeline stages hold different layers: the merged report lists each
    layer once (its figures the maxima over the ranks that hold it), and
    `bytes`/`tensors` add up the stages of one engine. `ranks` lists every
    worker: its rank, pp/tp/dp rank, the layers it held and what it read.
    Each section merges by its own rule (`Placement.merged`, `Volume.merged`, ...).

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
        named = only.placement.source if source is None else source
        return replace(only, placement=replace(only.placement, ranks=ranks, source=named),
                       findings=replace(only.findings, verify=verify))
    layers = merge_layers([r.layers for r in ordered])
    return ReloadReport(
        placement=Placement.merged([r.placement for r in ordered], ranks, source),
        volume=Volume.merged([r.volume for r in ordered], [r.volume for r in _one_engine_stages(ordered)]),
        memory=Memory.merged([r.memory for r in ordered]),
        timings=Timings.merged([r.timings for r in ordered]),
        unchanged=UnchangedLayers.merged([r.unchanged for r in ordered], layers),
        findings=Findings.merged([r.findings for r in ordered], verify),
        layers=layers,
    )


def _one_engine_stages(ordered: list[ReloadReport]) -> list[ReloadReport]:
    """One report per pipeline stage of the first engine: each stage streams its own part (DP engines match)."""
    first = ordered[0].placement.position or {}
    stages: dict[int, ReloadReport] = {}
    for report in ordered:
        position = report.placement.position or {}
        if position.get("dp_rank", 0) == first.get("dp_rank", 0):
            stages.setdefault(position.get("pp_rank", 0), report)
    return list(stages.values())


def _rank_key(report: ReloadReport) -> tuple[int, int, int, int]:
    position = report.placement.position or {}
    rank = report.placement.rank
    return (position.get("dp_rank", 0), position.get("pp_rank", 0), position.get("tp_rank", 0),
            rank if rank is not None else 0)


def first_failure(results: list) -> str | None:
    """The error of the worker that failed first-hand (not one that only followed another rank), or None.

    Named by its place when the engine has several ranks: `rank 1 (pp 1, tp 0, dp 0): ...`, with its node
    first when the engine spans several (`rank 1 (node 1, pp 0, tp 1, dp 0): ...`).
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
        return f"{rank_label(position)}: {error}"
    return error
