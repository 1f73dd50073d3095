"""Plan the order in which to stream a checkpoint, and simulate what each order buffers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

from layerwise_cli.checkpoint.format.header import TensorEntry
from layerwise_cli.checkpoint.sources import Checkpoint, natural_key
from layerwise_cli.planning.completion_rule import HeldLayer, held_layers
from layerwise_cli.planning.parents import LayerMapping


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor and the parent layer it feeds (None: the engine skips it)."""

    entry: TensorEntry
    parent: str | None
    # False: vLLM's loader writes it straight into the engine's tensor (`LayerMapping.loaded_directly`): it is
    # buffered only while it is handed over, and its layer completes without it.
    buffered: bool = True


@dataclass(frozen=True)
class ParentLayerStats:
    """One parent layer of the plan."""

    name: str
    tensors: int
    bytes: int
    shards: list[str]
    # The most of this layer's bytes that sat buffered while tensors of other
    # layers were being read, in file order (0: read in one contiguous run).
    file_order_held_bytes: int = 0
    # Why vLLM holds this layer until the end of the stream (None: it completes).
    held_to_end: str | None = None


@dataclass(frozen=True)
class BufferSimulation:
    """What the layerwise reload buffers when tensors arrive in a given order."""

    order: str
    peak_buffer_bytes: int
    peak_index: int  # position in the stream where the peak happens (0-based)
    peak_tensor: str
    peak_open_layers: int
    # Buffered bytes after each delivered tensor, counting that tensor.
    curve: list[int] = field(repr=False)
    # The tensor-parallel rank simulated (None: the rule does not depend on it).
    rank: int | None = None


@dataclass(frozen=True)
class Plan:
    """The tensors of a checkpoint in file order and in layer order."""

    checkpoint: Checkpoint
    mapping: LayerMapping
    file_order: list[PlannedTensor]
    layer_order: list[PlannedTensor]
    layers: list[ParentLayerStats]  # in model order
    # Tensors vLLM's loader skips on purpose (`skip_rules`): never read, never buffered.
    skipped: list[TensorEntry]
    # Parent layers vLLM holds until the end of the stream (see `completion_rule`).
    held: dict[str, HeldLayer] = field(default_factory=dict)
    tensor_parallel_size: int = 1
    # Skipped tensor -> why vLLM skips it.
    skip_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.entry.nbytes for t in self.file_order)

    @property
    def loaded_bytes(self) -> int:
        """Bytes of the tensors vLLM loads (the skipped ones left out)."""
        return sum(t.entry.nbytes for t in self.file_order if t.parent is not None)

    @property
    def largest_layer_bytes(self) -> int:
        return max((layer.bytes for layer in self.layers), default=0)

    def held_on(self, rank: int) -> frozenset[str]:
        """The parent layers held to the end on one tensor-parallel rank."""
        return frozenset(name for name, hold in self.held.items() if rank in hold.ranks)

    def held_bytes(self, rank: int | None = None) -> int:
        """Bytes of the layers held to the end on RANK (None: the rank that holds the most)."""
        sizes = {layer.name: layer.bytes for layer in self.layers}
        ranks = range(self.tensor_parallel_size) if rank is None else [rank]
        return max((sum(sizes[name] for name in self.held_on(r)) for r in ranks), default=0)

    @property
    def least_peak_bytes(self) -> int:
        """The least any order can buffer: the largest layer, or every held layer at the end of the stream."""
        return max(self.largest_layer_bytes, self.held_bytes())

    def held_summary(self, rank: int | None = None) -> str | None:
        """One line: the layers held to the end on RANK (None: on any rank), why, and their bytes together."""
        names = [name for name, hold in self.held.items() if rank is None or rank in hold.ranks]
        if not names:
            return None
        reasons = "; ".join(dict.fromkeys(self.held[name].reason for name in names))
        return f"vLLM holds {', '.join(names)} to the end of the stream ({reasons}): " \
               f"{self.held_bytes(rank)} bytes together"

    def excess_reason(self, sim: BufferSimulation) -> str | None:
        """Why a simulated peak is above the largest layer (None when it is not)."""
        if sim.peak_buffer_bytes <= self.largest_layer_bytes:
            return None
        held = self.held_summary(sim.rank)
        if sim.order == "layer":
            return held or (f"the engine's modules do not match this plan's parent layers ({self.mapping.description}):"
                            " tensors of one engine module arrive apart, so layer order holds more than one open")
        parts = [f"{sim.order} order has {sim.peak_open_layers} layer(s) open at {sim.peak_tensor}"]
        return "; ".join(parts + ([held] if held else []))

    def simulate(self, order: str, rank: int | None = None) -> BufferSimulation:
        """Simulate buffering for `order` (`file` or `layer`) on RANK (None: the rank that peaks highest)."""
        stream = self.file_order if order == "file" else self.layer_order
        if rank is not None or not self.held:
            held = self.held_on(rank or 0)
            return simulate_buffering(stream, order, held, rank=rank if self.tensor_parallel_size > 1 else None)
        runs = [simulate_buffering(stream, order, self.held_on(r), rank=r if self.tensor_parallel_size > 1 else None)
                for r in range(self.tensor_parallel_size)]
        return max(runs, key=lambda sim: sim.peak_buffer_bytes)


def vllm_read_order(checkpoint: Checkpoint) -> list[TensorEntry]:
    """The order vLLM's default safetensors loader reads tensors in.

    Shards in natural sort order; inside a shard, the order
    `safe_open(...).keys()` lists, which is sorted by name.
    """
    return [t for shard in checkpoint.shards for t in sorted(shard.tensors, key=lambda t: t.name)]


def build_plan(checkpoint: Checkpoint, mapping: LayerMapping, tensor_parallel_size: int = 1, *,
               vocabulary_layers: Collection[str] | None = None) -> Plan:
    """Assign each tensor to its parent layer and order the layers.

    Layer order keeps every parent layer's tensors together, layers in model
    order (embeddings, decoder layers by index, final norm, head); inside one
    decoder layer, modules keep the order of their first tensor in the file.
    Layers vLLM holds until the end of the stream (a padded vocabulary, a
    fused layer the checkpoint covers partly) go last, in model order: held
    from their first tensor, they cost least there, and layer order's peak
    is the largest layer or the held layers together, whichever is larger.

    Tensors vLLM's loader skips on purpose (`LayerMapping.skip_reason`) stay
    in file order, with no parent layer, and are left out of layer order.

    Args:
        checkpoint: the checkpoint's headers.
        mapping: how tensor names map to parent layers.
        tensor_parallel_size: the engine's tensor-parallel ranks (vocabulary
            padding falls on some ranks only).
        vocabulary_layers: the parent layers the engine built vocabulary-parallel (padded); None: every
            embedding and output head, as vLLM's own model classes build them (a positional embedding on the
            Transformers backend is a plain one).

    Returns:
        The plan, with per-layer statistics in model order.
    """
    ordered = vllm_read_order(checkpoint)
    mapping = mapping.for_tensors(entry.name for entry in ordered)
    planned: list[PlannedTensor] = []
    skipped: list[TensorEntry] = []
    reasons: dict[str, str] = {}
    groups: dict[str, list[PlannedTensor]] = {}
    keys: dict[str, tuple[tuple[int, int], int]] = {}
    uncounted: dict[str, str] = {}
    for position, entry in enumerate(ordered):
        parent = mapping.parent_of(entry.name)
        if parent is None:
            skipped.append(entry)
            reasons[entry.name] = mapping.skip_reason(entry.name) or "vLLM does not load it"
            planned.append(PlannedTensor(entry, None))
            continue
        item = PlannedTensor(entry, parent.name, not mapping.loaded_directly(entry.name))
        planned.append(item)
        why = mapping.uncounted_reason(entry.name)
        if why is not None:
            uncounted[parent.name] = why
        if parent.name not in groups:
            groups[parent.name] = []
            keys[parent.name] = (parent.order_key, position)
        groups[parent.name].append(item)
    layer_names = sorted(groups, key=lambda name: keys[name])
    to_end = held_layers({name: [i.entry for i in groups[name]] for name in layer_names},
                         {name: keys[name][0] for name in layer_names}, mapping.packed, checkpoint.config,
                         generic=mapping.kind == "generic", tensor_parallel_size=tensor_parallel_size,
                         uncounted=uncounted, vocabulary_layers=vocabulary_layers)
    streamed = [name for name in layer_names if name not in to_end] + [name for name in layer_names if name in to_end]
    layer_order = [item for name in streamed for item in groups[name]]
    waiting = _held_while_waiting([t for t in planned if t.parent is not None], set(to_end))
    layers = []
    for name in layer_names:
        items = groups[name]
        shards = sorted({i.entry.shard for i in items}, key=natural_key)
        hold = to_end.get(name)
        layers.append(ParentLayerStats(name, len(items), sum(i.entry.nbytes for i in items), shards, waiting[name],
                                       hold.reason if hold else None))
    return Plan(checkpoint, mapping, planned, layer_order, layers, skipped, to_end, tensor_parallel_size, reasons)


def simulate_buffering(stream: list[PlannedTensor], order: str = "custom", held: Collection[str] = (),
                       rank: int | None = None) -> BufferSimulation:
    """Buffered bytes after each delivery: delivered tensors of incomplete layers.

    The tensor just delivered counts, even when it completes its layer; tensors
    with no parent layer are never buffered. Layers in `held` never complete:
    their tensors stay buffered to the end of the stream. A tensor vLLM loads
    directly (`PlannedTensor.buffered` False) counts while it is handed over,
    as a layer of its own, and its layer completes without it.
    """
    held = frozenset(held)
    remaining: dict = defaultdict(int)
    for item in stream:
        if item.parent is not None:
            remaining[_buffer_key(item)] += 1
    delivered: dict = defaultdict(int)
    buffered = 0
    curve: list[int] = []
    peak, peak_index, peak_open = 0, -1, 0
    for index, item in enumerate(stream):
        if item.parent is None:
            curve.append(buffered)
            continue
        key = _buffer_key(item)
        delivered[key] += item.entry.nbytes
        buffered += item.entry.nbytes
        remaining[key] -= 1
        curve.append(buffered)
        if buffered > peak:
            peak, peak_index = buffered, index
            peak_open = len(delivered)  # open layers, the one just completed included
        if remaining[key] == 0 and key not in held:
            buffered -= delivered.pop(key)
    peak_tensor = stream[peak_index].entry.name if peak_index >= 0 else ""
    return BufferSimulation(order, peak, peak_index, peak_tensor, peak_open, curve, rank)


def _buffer_key(item: PlannedTensor):
    """What vLLM buffers ITEM with: its parent layer, or (a tensor loaded directly) nothing but itself."""
    return item.parent if item.buffered else (item.parent, item.entry.name)


def _held_while_waiting(stream: list[PlannedTensor], to_end: set[str]) -> dict[str, int]:
    """Per layer, its bytes delivered before the last tensor of another layer that came between its own.

    A layer held to the end waits, whole, for every tensor read after its last one.
    """
    held: dict[str, int] = defaultdict(int)
    delivered: dict[str, int] = defaultdict(int)
    previous: str | None = None
    for item in stream:
        name = item.parent
        assert name is not None
        if previous is not None and previous != name:
            if delivered[name]:
                # Another layer's tensors were read while this one was partly delivered.
                held[name] = delivered[name]
            for waiting in to_end:
                if waiting != name and delivered[waiting]:
                    held[waiting] = delivered[waiting]
        delivered[name] += item.entry.nbytes
        previous = name
    return held
