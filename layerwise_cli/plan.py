"""Plan the order in which to stream a checkpoint, and simulate what each order buffers."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .parents import LayerMapping
from .safetensors_header import TensorEntry
from .sources import Checkpoint, natural_key


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor and the parent layer it feeds (None: the engine skips it)."""

    entry: TensorEntry
    parent: str | None


@dataclass
class ParentLayerStats:
    """One parent layer of the plan."""

    name: str
    tensors: int
    bytes: int
    shards: list[str]
    # The most of this layer's bytes that sat buffered while tensors of other
    # layers were being read, in file order (0: read in one contiguous run).
    file_order_held_bytes: int = 0


@dataclass
class BufferSimulation:
    """What the layerwise reload buffers when tensors arrive in a given order."""

    order: str
    peak_buffer_bytes: int
    peak_index: int  # position in the stream where the peak happens (0-based)
    peak_tensor: str
    peak_open_layers: int
    # Buffered bytes after each delivered tensor, counting that tensor.
    curve: list[int] = field(repr=False)


@dataclass
class Plan:
    """The tensors of a checkpoint in file order and in layer order."""

    checkpoint: Checkpoint
    mapping: LayerMapping
    file_order: list[PlannedTensor]
    layer_order: list[PlannedTensor]
    layers: list[ParentLayerStats]  # in model order
    skipped: list[TensorEntry]

    @property
    def total_bytes(self) -> int:
        return sum(t.entry.nbytes for t in self.file_order)

    @property
    def largest_layer_bytes(self) -> int:
        return max((layer.bytes for layer in self.layers), default=0)

    def simulate(self, order: str) -> BufferSimulation:
        """Simulate buffering for `order` (`file` or `layer`)."""
        stream = self.file_order if order == "file" else self.layer_order
        return simulate_buffering(stream, order)


def file_order(checkpoint: Checkpoint) -> list[TensorEntry]:
    """The order vLLM's default safetensors loader reads tensors in.

    Shards in natural sort order; inside a shard, the order
    `safe_open(...).keys()` lists, which is sorted by name.
    """
    return [t for shard in checkpoint.shards for t in sorted(shard.tensors, key=lambda t: t.name)]


def build_plan(checkpoint: Checkpoint, mapping: LayerMapping) -> Plan:
    """Assign each tensor to its parent layer and order the layers.

    Layer order keeps every parent layer's tensors together, layers in model
    order (embeddings, decoder layers by index, final norm, head); inside one
    decoder layer, modules keep the order of their first tensor in the file.

    Args:
        checkpoint: the checkpoint's headers.
        mapping: how tensor names map to parent layers.

    Returns:
        The plan, with per-layer statistics in model order.
    """
    ordered = file_order(checkpoint)
    planned: list[PlannedTensor] = []
    skipped: list[TensorEntry] = []
    groups: dict[str, list[PlannedTensor]] = {}
    keys: dict[str, tuple[tuple[int, int], int]] = {}
    for position, entry in enumerate(ordered):
        parent = mapping.parent_of(entry.name)
        if parent is None:
            skipped.append(entry)
            planned.append(PlannedTensor(entry, None))
            continue
        item = PlannedTensor(entry, parent.name)
        planned.append(item)
        if parent.name not in groups:
            groups[parent.name] = []
            keys[parent.name] = (parent.order_key, position)
        groups[parent.name].append(item)
    layer_names = sorted(groups, key=lambda name: keys[name])
    layer_order = [item for name in layer_names for item in groups[name]]
    held = _held_while_waiting([t for t in planned if t.parent is not None])
    layers = []
    for name in layer_names:
        items = groups[name]
        shards = sorted({i.entry.shard for i in items}, key=natural_key)
        layers.append(ParentLayerStats(name, len(items), sum(i.entry.nbytes for i in items), shards, held[name]))
    return Plan(checkpoint, mapping, planned, layer_order, layers, skipped)


def simulate_buffering(stream: list[PlannedTensor], order: str = "custom") -> BufferSimulation:
    """Buffered bytes after each delivery: delivered tensors of incomplete layers.

    The tensor just delivered counts, even when it completes its layer; tensors
    with no parent layer are never buffered.
    """
    remaining: dict[str, int] = defaultdict(int)
    for item in stream:
        if item.parent is not None:
            remaining[item.parent] += 1
    delivered: dict[str, int] = defaultdict(int)
    buffered = 0
    curve: list[int] = []
    peak, peak_index, peak_open = 0, -1, 0
    for index, item in enumerate(stream):
        if item.parent is None:
            curve.append(buffered)
            continue
        delivered[item.parent] += item.entry.nbytes
        buffered += item.entry.nbytes
        remaining[item.parent] -= 1
        curve.append(buffered)
        if buffered > peak:
            peak, peak_index = buffered, index
            peak_open = len(delivered)  # open layers, the one just completed included
        if remaining[item.parent] == 0:
            buffered -= delivered.pop(item.parent)
    peak_tensor = stream[peak_index].entry.name if peak_index >= 0 else ""
    return BufferSimulation(order, peak, peak_index, peak_tensor, peak_open, curve)


def _held_while_waiting(stream: list[PlannedTensor]) -> dict[str, int]:
    """Per layer, its bytes delivered before the last tensor of another layer that came between its own."""
    held: dict[str, int] = defaultdict(int)
    delivered: dict[str, int] = defaultdict(int)
    previous: str | None = None
    for item in stream:
        name = item.parent
        assert name is not None
        if previous is not None and previous != name and delivered[name]:
            # Another layer's tensors were read while this one was partly delivered.
            held[name] = delivered[name]
        delivered[name] += item.entry.nbytes
        previous = name
    return held
