"""What `inspect-order` says about a sparse delta: its base, the changed fraction per layer, what a reload reads."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from layerwise_cli.planning.plan import Plan


@dataclass(frozen=True)
class DeltaLayer:
    """One parent layer of the step a delta rebuilds.

    Attributes:
        name: the parent layer.
        bytes: its bytes in the full step (the base's layout).
        values: its values.
        changed_values: values the delta changes (a tensor stored whole counts every value).
        patched_tensors: tensors the delta patches.
        delta_bytes: the delta's bytes for it (positions and values).
    """

    name: str
    bytes: int
    values: int
    changed_values: int
    patched_tensors: int
    delta_bytes: int

    @property
    def changed_fraction(self) -> float:
        return self.changed_values / self.values if self.values else 0.0

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "values": self.values, "changed_values": self.changed_values,
                "changed_fraction": self.changed_fraction, "patched_tensors": self.patched_tensors,
                "delta_bytes": self.delta_bytes}


@dataclass(frozen=True)
class DeltaView:
    """A delta as a reload sees it.

    Attributes:
        file: the delta file.
        base: the base's location, as the delta names it.
        file_bytes: the delta file's size.
        full_bytes: the full step's tensor bytes.
        layers: every parent layer, in plan order.
        reload_reads: the bytes a reload into an engine holding the base reads: the delta's tensor bytes, and
            the base's bytes of every layer the delta changes (a layer it leaves as it was is skipped, after a
            spot check of a few KiB per tensor).
    """

    file: str
    base: str
    file_bytes: int
    full_bytes: int
    layers: tuple[DeltaLayer, ...]
    reload_reads: int

    def to_dict(self) -> dict:
        changed = sum(layer.changed_values for layer in self.layers)
        values = sum(layer.values for layer in self.layers)
        return {"file": self.file, "base": self.base, "file_bytes": self.file_bytes, "full_bytes": self.full_bytes,
                "changed_values": changed, "values": values, "changed_fraction": changed / values if values else 0.0,
                "changed_layers": sum(1 for layer in self.layers if layer.patched_tensors),
                "reload_reads": self.reload_reads, "layers": [layer.to_dict() for layer in self.layers]}


def describe_delta(plan: Plan) -> DeltaView | None:
    """The delta view of PLAN's checkpoint (a delta opened as its step, `Checkpoint.delta`); None for a full one."""
    delta = plan.checkpoint.delta
    if delta is None:
        return None
    entries = {t.name: t for t in delta.header.tensors}
    rows: dict[str, list[int]] = {}
    for item in plan.layer_order:
        if item.parent is None:
            continue
        row = rows.setdefault(item.parent, [0, 0, 0, 0, 0])
        name = item.entry.name
        values = prod(item.entry.shape)
        row[0] += item.entry.nbytes
        row[1] += values
        patch = delta.patches.get(name)
        if patch is not None:
            row[2] += patch.changed
            row[3] += 1
            row[4] += sum(entries[key].nbytes for key in patch.entry_keys())
    layers = tuple(DeltaLayer(name, *row) for name, row in rows.items())
    changed_bytes = sum(layer.bytes for layer in layers if layer.patched_tensors)
    return DeltaView(str(delta.path), delta.base_location, delta.path.stat().st_size, plan.total_bytes, layers,
                     delta.header.nbytes + changed_bytes)
