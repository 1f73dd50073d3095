"""Split a rewritten checkpoint into shards so that vLLM's loader reads complete parent layers one after another.

vLLM's default loader reads shard files in natural sort order and, inside a
shard, tensors sorted by name (`safe_open(...).keys()`), whatever the order
of the data. Names sort lexicographically: `layers.10` < `layers.2`, and in
one decoder layer `k_proj` < `o_proj` < `q_norm` < `q_proj` < `v_proj`.

"Complete parent layers one after another" is taken strictly: in that read
order, every parent layer's tensors form one contiguous run, so at most one
layer is ever partly delivered and the file-order peak equals the largest
parent layer exactly (reached when its last tensor arrives).

Inside one shard, a parent layer is contiguous in sorted order iff no tensor
of another parent in the same shard sorts between its first and last name.
So a shard is valid iff the name intervals [first, last] of its parent
layers are pairwise disjoint. Sorted name sets with a common prefix form an
interval, so whole decoder layers (`...layers.7.`) and fused experts
(`...mlp.experts.`) never collide with each other; what collides is the
attention block: `o_proj` and `q_norm` sort inside `qkv_proj`'s interval
[`k_proj`, `v_proj`] and must live in another shard than that `qkv_proj`.

Packing (`split_shards`): parent layers in model order go into a window of
two open shards. A layer goes into the current shard if it fits and its
interval is free there; if it fits but collides, into the next shard (so
`o_proj`/`q_norm` ride one shard later, next to later layers, which they do
not collide with); if it does not fit, the current shard is closed and the
next one becomes current. A layer larger than `max_shard_size` gets shards
of its own, consecutive, split between tensors in name order, so it is still
read as one run. A dense model thus needs about one shard more than
size alone would ask for. Tensors the engine does not load (no parent
layer) are never buffered and are packed by size only.

Before anything is put in place, the written headers are re-read and
re-planned (`reorder.commit.check_written`): a layer read in two pieces, or a file-order
peak other than the largest layer, stops the rewrite as an internal error.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from layerwise_cli.checkpoint.format.header import DTYPE_SIZES, TensorEntry
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import Plan

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # the Hub's convention: 5GB


@dataclass
class OutputShard:
    """One shard of the rewritten checkpoint: its tensors, in the order of its data section."""

    name: str
    tensors: list[TensorEntry]
    parents: list[str]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class _Unit:
    parent: str | None  # None: a tensor the engine does not load
    entries: list[TensorEntry]  # sorted by name
    nbytes: int


class _ShardBuilder:
    """An open shard: its tensors and the disjoint name intervals of its parent layers."""

    def __init__(self) -> None:
        self.entries: list[TensorEntry] = []
        self.parents: list[str] = []
        self.nbytes = 0
        self._lows: list[str] = []
        self._highs: list[str] = []

    def fits(self, unit: _Unit, limit: int) -> bool:
        return not self.entries or self.nbytes + unit.nbytes <= limit

    def collides(self, unit: _Unit) -> bool:
        if unit.parent is None:
            return False
        low, high = unit.entries[0].name, unit.entries[-1].name
        i = bisect.bisect_left(self._lows, low)
        # Intervals here are disjoint and sorted, so only the neighbours can overlap.
        return (i < len(self._lows) and self._lows[i] <= high) or (i > 0 and self._highs[i - 1] >= low)

    def add(self, unit: _Unit) -> None:
        self.entries += unit.entries
        self.nbytes += unit.nbytes
        if unit.parent is not None:
            self.parents.append(unit.parent)
            low = unit.entries[0].name
            i = bisect.bisect_left(self._lows, low)
            self._lows.insert(i, low)
            self._highs.insert(i, unit.entries[-1].name)


def split_shards(plan: Plan, max_shard_size: int) -> list[OutputShard]:
    """Split a checkpoint's tensors into shards that vLLM's loader reads in layer order.

    See the shard-boundary rule in this module's docstring. No parent layer
    spans two shards unless it alone exceeds `max_shard_size`; no shard holds
    more than `max_shard_size` tensor bytes unless it holds a single tensor
    larger than that.

    Args:
        plan: the source checkpoint's plan (parent layers in model order).
        max_shard_size: the most tensor bytes per shard.

    Returns:
        The shards in read order, named `model-0000i-of-0000N.safetensors`,
        each with its tensors in data-section order (wider dtypes first, then
        by name, which keeps every tensor aligned to its element size).
    """
    if max_shard_size <= 0:
        raise LayerwiseError(f"--max-shard-size must be positive, not {max_shard_size}")
    units: list[_Unit] = []
    groups: dict[str, list[TensorEntry]] = {}
    for item in plan.layer_order:
        groups.setdefault(item.parent or "", []).append(item.entry)
    # Parent layers in stream order: the layers vLLM holds to the end come last.
    for name in dict.fromkeys(item.parent for item in plan.layer_order):
        entries = sorted(groups[name], key=lambda t: t.name)
        units.append(_Unit(name, entries, sum(t.nbytes for t in entries)))
    for entry in sorted(plan.skipped, key=lambda t: t.name):
        units.append(_Unit(None, [entry], entry.nbytes))

    closed: list[_ShardBuilder] = []
    window = [_ShardBuilder(), _ShardBuilder()]

    def flush() -> None:
        closed.extend(s for s in window if s.entries)
        window[:] = [_ShardBuilder(), _ShardBuilder()]

    first_held = next((unit for unit in units if unit.parent in plan.held), None)
    for unit in units:
        if unit is first_held:
            # Held layers get shards of their own, after every other layer: in a
            # shared shard, a layer sorting after one of them would be read
            # while it is held.
            flush()
        if unit.nbytes > max_shard_size:
            flush()
            for chunk in _split_by_size(unit.entries, max_shard_size):
                builder = _ShardBuilder()
                builder.add(_Unit(unit.parent, chunk, sum(t.nbytes for t in chunk)))
                closed.append(builder)
            continue
        while True:
            current, following = window
            if current.fits(unit, max_shard_size):
                if not current.collides(unit):
                    current.add(unit)
                    break
                if following.fits(unit, max_shard_size) and not following.collides(unit):
                    following.add(unit)
                    break
            # Close the current shard; an empty shard always takes the unit, so this ends.
            if current.entries:
                closed.append(current)
            window[:] = [following, _ShardBuilder()]
    flush()

    total = len(closed)
    shards = []
    for i, builder in enumerate(closed, start=1):
        data_order = sorted(builder.entries, key=lambda t: (-DTYPE_SIZES.get(t.dtype, 1), t.name))
        shards.append(OutputShard(f"model-{i:05d}-of-{total:05d}.safetensors", data_order, builder.parents))
    return shards


def _split_by_size(entries: list[TensorEntry], limit: int) -> list[list[TensorEntry]]:
    chunks: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if chunks[-1] and size + entry.nbytes > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(entry)
        size += entry.nbytes
    return chunks
