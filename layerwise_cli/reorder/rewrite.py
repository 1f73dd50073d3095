"""Rewrite a checkpoint so that vLLM's own loader reads it in layer order: the core of `layerwise reorder`.

The steps live in modules of their own: `output_shards` (the shard-boundary rule),
`write` (headers and tensor bytes), `side_files` (config, tokenizer),
`commit` (the checks before the rename into place, `staging.put_in_place`) and `signals` (SIGINT/SIGTERM).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from layerwise_cli.checkpoint.format.digests import METADATA_KEY
from layerwise_cli.checkpoint.format.finite import NonFinite
from layerwise_cli.checkpoint.sources import Checkpoint, open_checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.inspect import OrderReport
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.planning.plan import Plan, build_plan
from layerwise_cli.reorder.commit import check_destination, check_written
from layerwise_cli.reorder.output_shards import DEFAULT_MAX_SHARD_SIZE, OutputShard, split_shards
from layerwise_cli.reorder.result import ReorderProgress, ReorderResult
from layerwise_cli.reorder.side_files import copy_other_files
from layerwise_cli.reorder.signals import ReorderInterrupted, signals_raise
from layerwise_cli.reorder.write import CopyResult, write_index, write_shards
from layerwise_cli.staging import put_in_place, staging


def reorder(
    source: str,
    destination: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    verify: bool = False,
    revision: str | None = None,
    mapping: str = "auto",
    progress: Callable[[ReorderProgress], None] | None = None,
    allow_nonfinite: bool = False,
    digests: bool = True,
) -> ReorderResult:
    """Rewrite SOURCE into DESTINATION so that vLLM's loader reads complete parent layers one after another.

    Tensor bytes are copied raw, in chunks, from source file to destination
    file: memory stays a few MiB whatever the checkpoint's size. Everything is
    written to a temporary directory beside DESTINATION, fsynced, checked
    (headers re-read, tensor set and layer order re-planned, and with
    `verify` every tensor's digest compared with the source's), and only
    then renamed into place. SIGINT/SIGTERM remove the temporary directory
    and raise `ReorderInterrupted`.

    With `digests` (the default) every shard's header carries its tensors'
    digests (`layerwise.digests`, see `checkpoint.digests`), taken from the
    bytes as they are copied; a source shard that carries digests (written by
    `save_checkpoint` or an earlier reorder) has each tensor's bytes checked
    against them in the same pass, and a difference stops the rewrite.

    Args:
        source: a `.safetensors` file, a directory, a Hub repo id, or a URL
            (`s3://bucket/prefix`, `gs://`, `az://`, `https://`; read at the ETags its
            headers were read at): shards are fetched one at a time as the copy needs them.
        destination: the directory to create.
        max_shard_size: the most tensor bytes per shard (see `split_shards`).
        force: replace an existing DESTINATION (old one removed only after
            the new one is in place).
        verify: re-read every tensor from DESTINATION and compare its digest
            (xxh3-128) with the bytes read from SOURCE, and check the source's
            header digests where it has them; any difference is an error and
            nothing is put in place. In the same pass, every floating tensor
            is checked for NaN and Inf: one is an error too, unless
            `allow_nonfinite` (then the result lists them).
        revision: Hub branch, tag or commit (for a URL: a pin read before, `etags:...`).
        mapping: how tensors map to parent layers (see `mapping_for_config`).
        progress: called with a `ReorderProgress` as bytes are written.
        digests: write per-tensor digests in every shard header (False: none;
            a source's own digests are then dropped unchecked unless `verify`).

    Returns:
        The shards written and the file-order buffering before and after.

    Raises:
        LayerwiseError: bad source, DESTINATION exists without `force`, a
            write fails, or verification finds a difference.
        ReorderInterrupted: SIGINT or SIGTERM arrived.
    """
    started = time.perf_counter()
    checkpoint = open_checkpoint(source, revision)
    plan = build_plan(checkpoint, mapping_for_config(checkpoint.config, mapping))
    before = OrderReport(plan, plan.simulate("file"), plan.simulate("layer"))
    if not plan.file_order:
        raise LayerwiseError("the checkpoint has no tensors to write", where=source)
    dst = Path(destination).absolute()
    check_destination(checkpoint, dst, force)
    shards = split_shards(plan, max_shard_size)
    metadata, conflicts = _merged_metadata(checkpoint)

    written = _write_checked(checkpoint, plan, shards, metadata, dst, force=force, verify=verify, progress=progress,
                             allow_nonfinite=allow_nonfinite, digests=digests)
    return ReorderResult(
        source=checkpoint.source, revision=checkpoint.revision, destination=dst, max_shard_size=max_shard_size,
        before=before, after=written.after, shards=shards, bytes_written=written.copy.bytes_written,
        files_copied=written.files_copied, files_skipped=written.files_skipped, verified=verify,
        replaced=written.replaced, seconds=time.perf_counter() - started, metadata_conflicts=conflicts,
        nonfinite=written.nonfinite, digests=digests, source_digests_checked=written.copy.source_digests_checked,
    )


@dataclass(frozen=True)
class _Written:
    """What the staged rewrite wrote, checked and put in place."""

    copy: CopyResult
    after: OrderReport  # the order vLLM reads the written checkpoint in
    files_copied: list[str]
    files_skipped: list[str]  # with why
    nonfinite: list[NonFinite]  # found with `verify` and `allow_nonfinite`
    replaced: bool  # an existing destination was replaced


def _write_checked(checkpoint: Checkpoint, plan: Plan, shards: list[OutputShard], metadata: dict[str, str], dst: Path,
                   *, force: bool, verify: bool, progress: Callable[[ReorderProgress], None] | None,
                   allow_nonfinite: bool, digests: bool) -> _Written:
    """Write SHARDS and the side files in a staging directory beside DST, check them, and rename them into place.

    SIGINT/SIGTERM remove the staging directory and raise `ReorderInterrupted`; one that arrives while the
    finished checkpoint is being swapped in waits for the swap, then raises it with `committed=True`. A failed
    write is a `LayerwiseError` and puts nothing in place.
    """
    with signals_raise() as guard:
        try:
            with staging(dst, hold=guard.hold) as tmp:
                out = tmp / "out"
                out.mkdir()
                copied, skipped = copy_other_files(checkpoint, out, tmp)
                nonfinite: list[NonFinite] = []
                copy = write_shards(checkpoint, shards, metadata, out, tmp, verify, progress, allow_nonfinite,
                                    nonfinite, digests=digests)
                write_index(checkpoint, shards, out)
                after = check_written(checkpoint, plan, out, dst, copy.digests, progress, digests=digests,
                                      verify=verify)
                with guard.hold():
                    replaced = put_in_place(out, dst, tmp, replace=force,
                                            refusal="appeared while writing; pass --force to replace it")
        except OSError as exc:
            raise LayerwiseError(
                f"cannot write: {exc.strerror or exc}; nothing was put in place", where=str(dst)
            ) from None
        if guard.pending is not None:
            # The signal came while the finished checkpoint was being swapped in: it is in place.
            raise ReorderInterrupted(guard.pending, committed=True)
    return _Written(copy=copy, after=after, files_copied=copied, files_skipped=skipped, nonfinite=nonfinite,
                    replaced=replaced)


def _merged_metadata(checkpoint: Checkpoint) -> tuple[dict[str, str], list[str]]:
    """The shards' `__metadata__` merged (first value wins), and the keys whose values differ between shards.

    A shard's digests (`layerwise.digests`) name that shard's tensors only: they
    are never carried over (each new shard gets its own, or none).
    """
    merged: dict[str, str] = {}
    conflicts: list[str] = []
    for shard in checkpoint.shards:
        for key, value in shard.metadata.items():
            if key == METADATA_KEY:
                continue
            if key in merged and merged[key] != value and key not in conflicts:
                conflicts.append(key)
            merged.setdefault(key, value)
    return merged, conflicts
