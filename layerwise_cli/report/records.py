"""The records a reload report is made of: one per parent layer, per refreshed tensor and per worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
    # Why it was not handed to vLLM at all (`unchanged`: the engine already holds these bytes); None: reloaded.
    skipped: str | None = None
    # vLLM loaded it into the engine's own tensors, not into fresh ones copied over (`worker/stream/in_place.py`).
    in_place: bool = False
    # A sparse delta's new values were written straight into its tensors; not handed to vLLM
    # (`worker/reload/delta_patch.py`).
    patched: bool = False

    @property
    def seconds(self) -> float:
        return self.load_s + self.process_s

    @classmethod
    def merged(cls, per_worker: Sequence[LayerReport]) -> LayerReport:
        """One layer as the ranks that hold it took it: the slowest and fullest rank's figures.

        Args:
            per_worker: the layer's report from each rank that holds it (at least one), in rank order.

        Returns:
            The first rank's name, tensors and bytes, the longest times and largest buffer, completed
            during the stream, loaded in place and patched only where every rank did, skipped only where every
            rank skipped it, held to the end where any rank held it.
        """
        base = per_worker[0]
        return cls(
            name=base.name,
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
            patched=all(layer.patched for layer in per_worker),
        )

    @classmethod
    def from_dict(cls, data: dict) -> LayerReport:
        """The layer `dataclasses.asdict` wrote (keys it does not know, from older or newer workers, are ignored)."""
        return cls(**{key: value for key, value in data.items() if key in cls.__dataclass_fields__})


def merge_layers(per_worker: Sequence[Sequence[LayerReport]]) -> list[LayerReport]:
    """Each layer once, in the order the workers (in rank order) first reached it, merged over the ranks holding it.

    Args:
        per_worker: each worker's `layers`, in (dp, pp, tp) order.

    Returns:
        One `LayerReport.merged` per layer name.
    """
    by_name: dict[str, list[LayerReport]] = {}
    for layers in per_worker:
        for layer in layers:
            by_name.setdefault(layer.name, []).append(layer)
    return [LayerReport.merged(layers) for layers in by_name.values()]


@dataclass(frozen=True)
class DerivedRefresh:
    """One tensor layerwise refreshed after vLLM's reload, because vLLM's reload leaves it stale.

    Attributes:
        module: the engine module that holds it (`model.layers.0.mixer`, `lm_head`).
        tensor: the tensor or kernel state (`conv_weights`, `w13_weight`, `cpu_linear`).
        reason: why vLLM's reload does not refresh it.
    """

    module: str
    tensor: str
    reason: str


def rank_label(position: dict) -> str:
    """Where a worker sits, from its position's JSON: `rank 1 (pp 1, tp 0, dp 0)`; with its node first when the
    engine spans several nodes: `rank 1 (node 1, pp 0, tp 1, dp 0)`."""
    node = f"node {position['node_rank']}, " if position.get("nnodes", 1) > 1 else ""
    return (f"rank {position.get('rank')} ({node}pp {position.get('pp_rank', 0)}, tp {position.get('tp_rank', 0)}, "
            f"dp {position.get('dp_rank', 0)})")


@dataclass(frozen=True)
class RankSummary:
    """One worker of a merged report: where it sits and what it read and buffered.

    Attributes:
        rank: the worker's global rank (None outside tensor or pipeline parallel).
        pp_rank, tp_rank, dp_rank: its pipeline stage, tensor-parallel rank and data-parallel engine.
        layers: the parent layers it held and loaded, in load order.
        bytes, tensors: what it streamed.
        disk_read_bytes: bytes its process read from storage (None: not measurable).
        peak_buffer_bytes, predicted_peak_buffer_bytes: its measured and predicted buffer peak.
        wall_s: its reload's wall time.
        elsewhere_tensors: tensors of the source that other ranks hold (not read here).
        engine_id: the id of the worker process's records (new in every engine process).
        skipped_layers: parent layers it skipped, unchanged since layerwise loaded them.
        node_rank: the node it ran on (0 unless the engine spans several nodes).
    """

    rank: int | None
    pp_rank: int
    tp_rank: int
    dp_rank: int
    # The parent layers this rank held and loaded, in the order it loaded them.
    layers: tuple[str, ...]
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
    engine_id: str | None = None
    skipped_layers: int = 0
    node_rank: int = 0

    @classmethod
    def of(cls, report) -> RankSummary:
        """The summary of one worker's `ReloadReport` (not imported here: that module imports this one)."""
        placement, volume, memory = report.placement, report.volume, report.memory
        position = placement.position or {}
        return cls(rank=placement.rank, pp_rank=position.get("pp_rank", 0), tp_rank=position.get("tp_rank", 0),
                   dp_rank=position.get("dp_rank", 0), layers=tuple(layer.name for layer in report.layers),
                   bytes=volume.bytes, tensors=volume.tensors, disk_read_bytes=volume.disk_read_bytes,
                   peak_buffer_bytes=memory.peak_buffer_bytes,
                   predicted_peak_buffer_bytes=memory.predicted_peak_buffer_bytes, wall_s=report.timings.wall_s,
                   elsewhere_tensors=volume.elsewhere_tensors, engine_id=placement.engine_id,
                   skipped_layers=report.unchanged.skipped_layers, node_rank=position.get("node_rank", 0))

    @classmethod
    def from_dict(cls, data: dict) -> RankSummary:
        """The summary `dataclasses.asdict` wrote (keys it does not know are ignored)."""
        known = {key: value for key, value in data.items() if key in cls.__dataclass_fields__}
        return cls(**{**known, "layers": tuple(data["layers"])})

    def label(self) -> str:
        """`rank 1 (pp 1, tp 0, dp 0)`."""
        return f"rank {self.rank} (pp {self.pp_rank}, tp {self.tp_rank}, dp {self.dp_rank})"

