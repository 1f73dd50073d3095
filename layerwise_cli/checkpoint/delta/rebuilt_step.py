"""A delta step rebuilt once into a full step's files on this host, so that a later read decodes nothing.

A server's pre-flight prepares the step this way while it serves (`worker/state/prepared.py`): the reload inside
its pause then reads a full step's files, as fast as the full step itself, instead of decoding every link of the
chain there. The files are the chain's full step's layout (the same shards, the same offsets) with the step's
bytes, each tensor proved by the step's digest as it is rebuilt (`rebuilt_bytes`), and headers carrying the
step's digests, as `open_delta_checkpoint` presents them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

from layerwise_cli.checkpoint.delta.buffers import RebuildBuffers
from layerwise_cli.checkpoint.delta.rebuild import rebuilt_bytes
from layerwise_cli.checkpoint.delta.source import DeltaChain
from layerwise_cli.checkpoint.format.finite import ByteScan, NonFinite, refusal
from layerwise_cli.checkpoint.format.header import encode_header
from layerwise_cli.checkpoint.format.layout import INDEX_NAME
from layerwise_cli.checkpoint.sources import Checkpoint, open_checkpoint
from layerwise_cli.errors import LayerwiseError, describe_exception

_PARTIAL = ".partial"


def write_rebuilt_step(step: Checkpoint, folder: Path, *, check_finite: bool = True) -> Checkpoint:
    """Write the full step STEP rebuilds (a delta step as `open_step` opens it) into FOLDER, and open it.

    With CHECK_FINITE, every rebuilt tensor is checked for NaN and Inf as it is written, as a reload checks
    what it reads: a step that holds one is refused here, naming the step and the tensor (a server's
    pre-flight then refuses it before any server pauses).

    FOLDER is filled under a temporary name beside it and renamed into place, so that it holds a whole step or
    nothing; whatever was there is replaced.

    Returns:
        The step read from FOLDER, with STEP's `source`, `kind`, `revision`, `pinned` and `commit`, and no delta.

    Raises:
        LayerwiseError: STEP is not a delta step, a tensor does not rebuild to the step's digest or holds NaN or
            Inf, or FOLDER cannot be written (each naming the file or the step).
    """
    chain = step.delta
    if not isinstance(chain, DeltaChain):
        raise LayerwiseError("not a delta step: there is nothing to rebuild", where=step.source)
    partial = folder.with_name(folder.name + _PARTIAL)
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        buffers = RebuildBuffers()
        try:
            for shard in step.shards:
                _write_shard(step, shard, chain, partial / shard.name, buffers, check_finite)
        finally:
            buffers.close()
        _write_json(partial / INDEX_NAME, {"metadata": {"total_size": step.total_bytes}, "weight_map": {
            entry.name: shard.name for shard in step.shards for entry in shard.tensors}})
        if step.config is not None:
            _write_json(partial / "config.json", step.config)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise describe_exception(exc, where=str(folder)) from exc
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return replace(open_checkpoint(str(folder)), source=step.source, kind=step.kind, revision=step.revision,
                   pinned=step.pinned, commit=step.commit)


def _write_shard(step: Checkpoint, shard, chain: DeltaChain, path: Path, buffers: RebuildBuffers,
                 check_finite: bool) -> None:
    """One shard of the step: the header (the step's digests), then each tensor rebuilt at its offset (and,
    with CHECK_FINITE, refused if it holds NaN or Inf)."""
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    source = step.shard_path(shard)
    header = encode_header(shard.tensors, dict(shard.metadata))
    data = np.memmap(source, dtype=np.uint8, mode="r")  # unmapped once no array refers to it
    with open(path, "wb") as out:
        out.write(header)
        for entry in sorted(shard.tensors, key=lambda t: t.begin):
            raw = data[shard.data_start + entry.begin:shard.data_start + entry.end]
            rebuilt = rebuilt_bytes(chain, entry, raw, str(source), buffers)
            if check_finite:
                _refuse_nonfinite(entry, rebuilt, step.source)
            out.seek(len(header) + entry.begin)
            out.write(memoryview(rebuilt))


def _refuse_nonfinite(entry, data, where: str) -> None:
    scan = ByteScan(entry.dtype)
    scan.update(data)
    if scan.found:
        raise refusal(NonFinite(entry.name, entry.shard, scan.nan, scan.inf), where)


def _write_json(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n")
