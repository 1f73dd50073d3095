"""(p) A sparse delta's write limit: its new values written at their positions into its base's tensors, nothing else.

However a delta is loaded, its new values must reach their places in memory;
with 3% of a bf16 tensor's values changed, spread evenly, that touches most of
its cache lines (1 - 0.97^32: 62%), so the writes alone are a pass over most of
the model's memory. This measures that pass, on the engine's thread and device,
with nothing around it: no base check, no NaN/Inf check, no proof, no record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from layerwise_cli.checkpoint.delta.format import VALUES_SUFFIX, WHOLE, WHOLE_SUFFIX, file_mapping, unsigned_type
from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.checkpoint.delta.v2 import SPARSE
from layerwise_cli.checkpoint.format.header import DTYPE_SIZES
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.worker.reload.patch_writes import AS_INTEGERS


@dataclass
class PatchWrite:
    """One patched tensor, ready to be written: its base's bytes in TARGET, the patch's POSITIONS (None: stored
    whole) and VALUES, all on the device the writes run on."""

    name: str
    target: torch.Tensor
    positions: torch.Tensor | None
    values: torch.Tensor


def patch_writes(source: str, device: torch.device) -> list[PatchWrite]:
    """The writes of the delta at SOURCE (one link, over a full step), each target a copy of its base tensor.

    Raises:
        LayerwiseError: SOURCE is not a delta over a full step.
    """
    step = open_step(source)
    if step.delta is None or len(step.delta.links) != 1:
        raise LayerwiseError("the write limit takes a delta over a full step (one link)", where=source)
    delta = step.delta.links[0]
    delta.validate()
    writes = []
    for shard in step.shards:
        mapping = file_mapping(step.local_dir / shard.name)
        for entry in shard.tensors:
            patch = delta.patches.get(entry.name)
            if patch is None:
                continue
            as_integers = AS_INTEGERS[DTYPE_SIZES[patch.dtype]]
            base = mapping[shard.data_start + entry.begin:shard.data_start + entry.end]
            target = torch.from_numpy(base.copy()).view(as_integers).to(device)
            if patch.kind == WHOLE:
                values, positions = delta.raw(entry.name + WHOLE_SUFFIX), None
            else:
                found = delta.positions(entry.name)
                # v2 stores differences: the values written are the base's plus them (decoded here, untimed).
                values = (delta.apply(entry.name, base).view(unsigned_type(DTYPE_SIZES[patch.dtype]))[found]
                          .view(np.uint8) if patch.kind == SPARSE else delta.raw(entry.name + VALUES_SUFFIX))
                positions = torch.from_numpy(found.copy()).to(device)
            writes.append(PatchWrite(entry.name, target, positions,
                                     torch.from_numpy(values.copy()).view(as_integers).to(device)))
    return writes


def write_all(writes: list[PatchWrite]) -> float:
    """Write every patch in order; the seconds it took (a device's queued writes waited for)."""
    cuda = any(write.target.device.type == "cuda" for write in writes)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for write in writes:
        if write.positions is None:
            write.target.copy_(write.values)
        else:
            write.target.index_put_((write.positions,), write.values)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start
