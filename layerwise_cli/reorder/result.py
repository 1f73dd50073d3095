"""What a rewrite reports: its progress as it runs and its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from layerwise_cli.checkpoint.format.finite import NonFinite
from layerwise_cli.planning.inspect import OrderReport
from layerwise_cli.reorder.output_shards import OutputShard


@dataclass
class ReorderProgress:
    """Where a rewrite stands; passed to the `progress` callback."""

    phase: str  # "fetch", "write" or "verify"
    bytes_done: int
    bytes_total: int
    shards_done: int
    shards_total: int
    file: str = ""


@dataclass
class ReorderResult:
    """What `reorder` wrote, and the file-order buffering before and after."""

    source: str
    revision: str | None
    destination: Path
    max_shard_size: int
    before: OrderReport
    after: OrderReport
    shards: list[OutputShard]
    bytes_written: int  # file bytes: headers and tensor data
    files_copied: list[str]
    files_skipped: list[str]
    verified: bool  # every tensor's bytes re-read from DST and matched against SRC (xxh3-128 tensor digests)
    replaced: bool  # an existing DST was replaced (--force)
    seconds: float
    metadata_conflicts: list[str] = field(default_factory=list)
    # With verify: tensors holding NaN or Inf (written only with allow_nonfinite).
    nonfinite: list[NonFinite] = field(default_factory=list)
    digests: bool = False  # every DST header carries `layerwise.digests`
    source_digests_checked: int = 0  # tensors whose SRC header digest matched the bytes copied

    def to_dict(self) -> dict:
        """JSON-ready data: integers for bytes, seconds as a float."""
        largest = self.after.plan.largest_layer_bytes

        def side(report: OrderReport) -> dict:
            return {
                "shards": len(report.plan.checkpoint.shards),
                "file_order_peak_buffer_bytes": report.file_order_buffering.peak_buffer_bytes,
                "peak_over_largest_layer": report.file_order_buffering.peak_buffer_bytes / largest if largest else 0.0,
                "open_layers_at_peak": report.file_order_buffering.peak_open_layers,
                "peak_tensor": report.file_order_buffering.peak_tensor,
            }

        return {
            "source": self.source,
            "revision": self.revision,
            "destination": str(self.destination),
            "mapping": {"kind": self.after.plan.mapping.kind, "architecture": self.after.plan.mapping.architecture},
            "max_shard_size": self.max_shard_size,
            "tensors": len(self.after.plan.file_order),
            "total_bytes": self.after.plan.total_bytes,
            "bytes_written": self.bytes_written,
            "largest_layer_bytes": largest,
            "before": side(self.before),
            "after": side(self.after),
            "shards": [
                {"name": s.name, "tensors": len(s.tensors), "parent_layers": len(s.parents), "bytes": s.nbytes}
                for s in self.shards
            ],
            "files_copied": self.files_copied,
            "files_skipped": self.files_skipped,
            "metadata_conflicts": self.metadata_conflicts,
            "verified": self.verified,
            "digests": self.digests,
            "source_digests_checked": self.source_digests_checked,
            "nonfinite": [found.to_dict() for found in self.nonfinite],
            "replaced": self.replaced,
            "seconds": self.seconds,
        }
