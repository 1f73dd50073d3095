"""Inspect a checkpoint's tensor order: the core of `layerwise inspect-order`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.checkpoint.format.digests import FORMAT, METADATA_KEY, header_digests, layer_digest
from layerwise_cli.planning.delta_view import DeltaView, describe_delta
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.planning.plan import BufferSimulation, Plan, build_plan


@dataclass(frozen=True)
class OrderReport:
    """A plan and what each order would buffer (the JSON's `file_order` and `layer_order`)."""

    plan: Plan
    # What vLLM's own read order (`Plan.file_order`) buffers.
    file_order_buffering: BufferSimulation
    # What layer order (`Plan.layer_order`) buffers.
    layer_order_buffering: BufferSimulation
    # Tensor digests from the shard headers' `layerwise.digests` (only shards that carry them).
    tensor_digests: dict[str, str] = field(default_factory=dict)
    digest_shards: int = 0
    # For a guessed mapping: the layer-order peak if vLLM fused nothing, and if
    # it fused whole decoder layers (the truth lies between them).
    guess_range: tuple[int, int] | None = None
    # For a sparse delta (opened as the step it rebuilds, in its base's layout): what it changes, per layer.
    delta: DeltaView | None = None

    def layer_digests(self) -> dict[str, str]:
        """Parent layer -> digest, for the layers whose every tensor has a header digest."""
        groups: dict[str, dict[str, str]] = {}
        missing: set[str] = set()
        for item in self.plan.layer_order:
            if item.parent is None:
                continue
            digest = self.tensor_digests.get(item.entry.name)
            if digest is None:
                missing.add(item.parent)
            else:
                groups.setdefault(item.parent, {})[item.entry.name] = digest
        return {name: layer_digest(group) for name, group in groups.items() if name not in missing}

    def layers_worst_first(self) -> list:
        return sorted(self.plan.layers, key=lambda layer: (-layer.file_order_held_bytes, -layer.bytes, layer.name))

    def to_dict(self, top: int | None = None) -> dict:
        """JSON-ready data: integers for bytes, layers worst first."""
        plan = self.plan
        layers = self.layers_worst_first()
        if top:
            layers = layers[:top]
        largest = plan.largest_layer_bytes
        sizes = {layer.name: layer.bytes for layer in plan.layers}
        digests = self.layer_digests()
        return {
            "source": plan.checkpoint.source,
            "revision": plan.checkpoint.revision,
            "commit": plan.checkpoint.commit,
            "kind": plan.checkpoint.kind,
            "mapping": {
                "kind": plan.mapping.kind,
                "architecture": plan.mapping.architecture,
                "description": plan.mapping.description,
                "guess": self.guess_dict(),
            },
            "shards": len(plan.checkpoint.shards),
            "tensors": len(plan.file_order),
            "total_bytes": plan.total_bytes,
            "header_bytes_read": plan.checkpoint.header_bytes_read,
            "parent_layers": len(plan.layers),
            "largest_layer_bytes": largest,
            "tensor_parallel_size": plan.tensor_parallel_size,
            "held_to_end": [
                {"name": name, "reason": hold.reason, "bytes": sizes[name], "ranks": list(hold.ranks)}
                for name, hold in plan.held.items()
            ],
            "held_to_end_bytes": plan.held_bytes(),
            "skipped_tensors": [t.name for t in plan.skipped],
            "skipped_as_vllm_does": [{"name": t.name, "reason": plan.skip_reasons.get(t.name), "bytes": t.nbytes}
                                     for t in plan.skipped],
            "held_to_end_reason": plan.held_summary(),
            "file_order": {**_simulation_dict(self.file_order_buffering, largest),
                           "above_largest_layer_because": plan.excess_reason(self.file_order_buffering)},
            "layer_order": {**_simulation_dict(self.layer_order_buffering, largest),
                            "above_largest_layer_because": self.layer_order_excess_reason()},
            "delta": self.delta.to_dict() if self.delta is not None else None,
            "header_digests": {
                "key": METADATA_KEY,
                "format": FORMAT,
                "shards_with_digests": self.digest_shards,
                "tensors": dict(self.tensor_digests),
            },
            "layers": [
                {
                    "name": layer.name,
                    "tensors": layer.tensors,
                    "bytes": layer.bytes,
                    "shards": layer.shards,
                    "file_order_held_bytes": layer.file_order_held_bytes,
                    "held_to_end": layer.held_to_end,
                    "digest": digests.get(layer.name),
                }
                for layer in layers
            ],
        }


    def guess_dict(self) -> dict | None:
        """How far a guessed plan's layer-order peak can be off (None unless the mapping is a guess)."""
        if self.guess_range is None:
            return None
        low, high = self.guess_range
        guessed = self.layer_order_buffering.peak_buffer_bytes
        return {
            "layer_order_peak_without_fusions": low,
            "layer_order_peak_with_whole_layers_fused": high,
            "text": (f"a guess: {self.plan.mapping.architecture} is in no table; vLLM's real modules put the "
                     f"layer-order peak between {low} B (it fuses nothing) and {high} B (it fuses whole decoder "
                     f"layers); the guess of {guessed} B is {guessed / low if low else 0:.2f}x the first and "
                     f"{guessed / high if high else 0:.2f}x the second"),
        }

    def layer_order_excess_reason(self) -> str | None:
        """Why layer order buffers more than the largest layer (None when it does not)."""
        return self.plan.excess_reason(self.layer_order_buffering)


def _simulation_dict(sim: BufferSimulation, largest: int) -> dict:
    return {
        "peak_buffer_bytes": sim.peak_buffer_bytes,
        "peak_over_largest_layer": sim.peak_buffer_bytes / largest if largest else 0.0,
        "peak_index": sim.peak_index,
        "peak_tensor": sim.peak_tensor,
        "open_layers_at_peak": sim.peak_open_layers,
        "rank": sim.rank,
    }


def inspect_order(source: str, revision: str | None = None, mapping: str = "auto",
                  tensor_parallel_size: int = 1) -> OrderReport:
    """Plan SOURCE from its headers and simulate file order and layer order.

    Args:
        source: a `.safetensors` file, a directory, or a Hub repo id.
        revision: Hub revision (Hub sources only).
        mapping: `auto`, `table`, `vllm` or `generic` (see `mapping_for_config`).
        tensor_parallel_size: the engine's tensor-parallel ranks; peaks are
            the highest rank's (a padded vocabulary is held on some ranks only).

    Returns:
        The plan, both simulations, and the tensor digests the shard headers
        carry (`layerwise.digests`, see `checkpoint.digests`).

    Raises:
        LayerwiseError: the source is missing, a header is invalid, or the
            mapping asked for cannot be used.
    """
    checkpoint = open_step(source, revision)
    chosen = mapping_for_config(checkpoint.config, mapping)
    plan = build_plan(checkpoint, chosen, tensor_parallel_size)
    guess_range = None
    if chosen.kind == "guess":
        bounds = [build_plan(checkpoint, replace(chosen, kind=kind, packed=packed), tensor_parallel_size)
                  .simulate("layer").peak_buffer_bytes for kind, packed in (("guess", {}), ("generic", {}))]
        guess_range = (bounds[0], bounds[1])
    tensor_digests: dict[str, str] = {}
    digest_shards = 0
    for shard in checkpoint.shards:
        found = header_digests(shard, where=_shard_where(checkpoint, shard.name))
        if found is not None:
            digest_shards += 1
            tensor_digests.update(found)
    return OrderReport(plan, plan.simulate("file"), plan.simulate("layer"), tensor_digests, digest_shards,
                       guess_range, describe_delta(plan))


def _shard_where(checkpoint, name: str) -> str:
    if checkpoint.local_dir is not None:
        return str(checkpoint.local_dir / name)
    return f"{checkpoint.source}/{name}"
