"""Inspect a checkpoint's tensor order: the core of `layerwise inspect-order`."""

from __future__ import annotations

from dataclasses import dataclass

from .parents import mapping_for_config
from .plan import BufferSimulation, Plan, build_plan
from .sources import open_checkpoint


@dataclass
class OrderReport:
    """A plan and what each order would buffer."""

    plan: Plan
    file_order: BufferSimulation
    layer_order: BufferSimulation

    def layers_worst_first(self) -> list:
        return sorted(self.plan.layers, key=lambda layer: (-layer.file_order_held_bytes, -layer.bytes, layer.name))

    def to_dict(self, top: int | None = None) -> dict:
        """JSON-ready data: integers for bytes, layers worst first."""
        plan = self.plan
        layers = self.layers_worst_first()
        if top:
            layers = layers[:top]
        largest = plan.largest_layer_bytes
        return {
            "source": plan.checkpoint.source,
            "revision": plan.checkpoint.revision,
            "kind": plan.checkpoint.kind,
            "mapping": {
                "kind": plan.mapping.kind,
                "architecture": plan.mapping.architecture,
                "description": plan.mapping.description,
            },
            "shards": len(plan.checkpoint.shards),
            "tensors": len(plan.file_order),
            "total_bytes": plan.total_bytes,
            "header_bytes_read": plan.checkpoint.header_bytes_read,
            "parent_layers": len(plan.layers),
            "largest_layer_bytes": largest,
            "skipped_tensors": [t.name for t in plan.skipped],
            "file_order": _simulation_dict(self.file_order, largest),
            "layer_order": _simulation_dict(self.layer_order, largest),
            "layers": [
                {
                    "name": layer.name,
                    "tensors": layer.tensors,
                    "bytes": layer.bytes,
                    "shards": layer.shards,
                    "file_order_held_bytes": layer.file_order_held_bytes,
                }
                for layer in layers
            ],
        }


def _simulation_dict(sim: BufferSimulation, largest: int) -> dict:
    return {
        "peak_buffer_bytes": sim.peak_buffer_bytes,
        "peak_over_largest_layer": sim.peak_buffer_bytes / largest if largest else 0.0,
        "peak_index": sim.peak_index,
        "peak_tensor": sim.peak_tensor,
        "open_layers_at_peak": sim.peak_open_layers,
    }


def inspect_order(source: str, revision: str | None = None, mapping: str = "auto") -> OrderReport:
    """Plan SOURCE from its headers and simulate file order and layer order.

    Args:
        source: a `.safetensors` file, a directory, or a Hub repo id.
        revision: Hub revision (Hub sources only).
        mapping: `auto`, `table`, `vllm` or `generic` (see `mapping_for_config`).

    Returns:
        The plan and both simulations.
    """
    checkpoint = open_checkpoint(source, revision)
    plan = build_plan(checkpoint, mapping_for_config(checkpoint.config, mapping))
    return OrderReport(plan, plan.simulate("file"), plan.simulate("layer"))
