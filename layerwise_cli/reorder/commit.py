"""Check a rewritten checkpoint before it is put in place (`staging.put_in_place` puts it there)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from layerwise_cli.checkpoint.format.chunks import CHUNK_BYTES, read_chunks
from layerwise_cli.checkpoint.format.digests import METADATA_KEY, TensorHasher, header_digests
from layerwise_cli.checkpoint.format.layout import WEIGHT_INDEX_SUFFIXES, WEIGHT_SUFFIXES
from layerwise_cli.checkpoint.sources import Checkpoint, open_checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.inspect import OrderReport
from layerwise_cli.planning.plan import Plan, build_plan
from layerwise_cli.reorder.result import ReorderProgress

# What a checkpoint directory holds (weights, index, config, tokenizer, model card, remote code).
CHECKPOINT_FILE_SUFFIXES = WEIGHT_SUFFIXES + WEIGHT_INDEX_SUFFIXES + (
    ".json", ".txt", ".model", ".jinja", ".md", ".py", ".tiktoken", ".spm", ".yaml", ".yml")
CHECKPOINT_FILE_NAMES = ("LICENSE", "LICENSE.txt", "NOTICE", "USE_POLICY.md", ".gitattributes")


def check_destination(checkpoint: Checkpoint, dst: Path, force: bool) -> None:
    """Refuse a DST that is SRC or inside it, that exists without `force`, or that `force` may not replace."""
    if checkpoint.local_dir is not None:
        src = Path(checkpoint.source).resolve()
        real = dst.resolve()
        if real == src or (src.is_dir() and src in real.parents):
            raise LayerwiseError("the destination is the source or inside it; choose another path", where=str(dst))
        if force and real in src.parents:
            raise LayerwiseError("--force would remove the source along with the destination", where=str(dst))
    if (dst.exists() or dst.is_symlink()) and not force:
        raise LayerwiseError("already exists; pass --force to replace it", where=str(dst))
    if force and (dst.exists() or dst.is_symlink()):
        why = not_a_checkpoint(dst)
        if why:
            raise LayerwiseError(f"--force replaces only a checkpoint directory, and this {why}; "
                                 "remove it yourself or choose another destination", where=str(dst))


def not_a_checkpoint(dst: Path) -> str | None:
    """Why DST does not look like a checkpoint directory `--force` may replace, or None when it does.

    A checkpoint directory holds safetensors shards (or nothing) and only the
    kinds of files a trainer or this tool writes beside them; anything else
    (photos, notes, a plain file, a symlink) is the user's and is not removed.
    """
    if dst.is_symlink():
        return "is a symlink"
    if not dst.is_dir():
        return "is a file, not a directory"
    has_weights = False
    for root, dirs, files in os.walk(dst):
        for name in dirs:
            if (Path(root) / name).is_symlink():
                return f"holds a symlink {str((Path(root) / name).relative_to(dst))!r}"
        for name in files:
            path = Path(root) / name
            relative = str(path.relative_to(dst))
            if path.is_symlink() or not path.is_file():
                return f"holds {relative!r}, which is not a regular file"
            if not (name.endswith(CHECKPOINT_FILE_SUFFIXES) or name in CHECKPOINT_FILE_NAMES):
                return f"holds {relative!r}, which is not a checkpoint file"
            has_weights = has_weights or (root == str(dst) and name.endswith(".safetensors"))
    if not has_weights and any(dst.iterdir()):
        return "holds no .safetensors shards"
    return None


def check_written(
    checkpoint: Checkpoint,
    plan: Plan,
    out: Path,
    dst: Path,
    hashes: dict[str, str],
    progress: Callable[[ReorderProgress], None] | None,
    *,
    digests: bool = False,
    verify: bool = False,
) -> OrderReport:
    """Re-read what was written: headers, tensor set, the order vLLM reads, and (verify) every tensor's bytes.

    HASHES are the digests taken from SRC's bytes as they were copied. With
    `digests`, every written header must carry exactly those (headers only, no
    data read); with `verify`, every tensor's bytes are re-read and hashed
    against them, and against the header's digest where there is one.
    """
    written = replace(open_checkpoint(str(out)), source=str(dst))
    wanted = {(t.name, t.dtype, t.shape) for t in checkpoint.tensors}
    got = {(t.name, t.dtype, t.shape) for t in written.tensors}
    if wanted != got:
        missing = sorted(n for n, *_ in wanted - got) + sorted(n for n, *_ in got - wanted)
        raise LayerwiseError(f"written tensors differ from the source's, first: {missing[0]!r}", where=str(dst))
    if digests:
        _check_header_digests(written, hashes, dst)
    after_plan = build_plan(written, plan.mapping)
    after = OrderReport(after_plan, after_plan.simulate("file"), after_plan.simulate("layer"))
    # The least any order buffers: the largest layer, or the layers vLLM holds to the end together.
    peak, largest = after.file_order_buffering.peak_buffer_bytes, after_plan.least_peak_bytes
    finished: set[str] = set()
    previous: str | None = None
    for item in after_plan.file_order:
        if item.parent is None or item.parent == previous:
            continue
        if item.parent in finished:
            raise LayerwiseError(
                f"internal error: {item.parent} is read in two pieces in the rewritten order; please report this",
                where=str(dst),
            )
        if previous is not None:
            finished.add(previous)
        previous = item.parent
    if peak != largest:
        raise LayerwiseError(
            f"internal error: the rewritten file order buffers {peak} bytes, not the least possible {largest}; "
            "please report this",
            where=str(dst),
        )
    if verify:
        verify_bytes(written, out, hashes, dst, progress)
    return after


def _check_header_digests(written: Checkpoint, hashes: dict[str, str], dst: Path) -> None:
    """Every written header carries the digests taken from the source's bytes, and nothing else."""
    for shard in written.shards:
        carried = header_digests(shard, where=str(dst / shard.name))
        if carried is None:
            raise LayerwiseError(f"internal error: {shard.name} carries no {METADATA_KEY}; please report this",
                                 where=str(dst))
        wrong = sorted(name for name, digest in carried.items() if hashes.get(name) != digest)
        if wrong:
            raise LayerwiseError(f"internal error: {shard.name}'s {METADATA_KEY} digest of {wrong[0]} is not the one "
                                 "taken from the source's bytes; please report this", where=str(dst))


def verify_bytes(
    written: Checkpoint,
    out: Path,
    hashes: dict[str, str],
    dst: Path,
    progress: Callable[[ReorderProgress], None] | None,
) -> None:
    """Re-read every written tensor and compare its digest with the one taken from SRC as it was copied.

    The digest is `checkpoint.digests`' (xxh3-128 of dtype, shape and bytes),
    the one written headers carry (`check_written` made sure they carry these):
    a tensor whose bytes differ from SRC's also differs from its header digest.
    """
    total = written.total_bytes
    done = 0
    buf = bytearray(CHUNK_BYTES)
    differ: list[str] = []
    for index, shard in enumerate(written.shards):
        fd = os.open(out / shard.name, os.O_RDONLY)
        try:
            for entry in sorted(shard.tensors, key=lambda t: t.begin):
                hasher = TensorHasher(entry.dtype, entry.shape)
                for view in read_chunks(fd, shard.data_start + entry.begin, entry.nbytes, buf, tensor=entry.name,
                                        where=str(dst / shard.name)):
                    hasher.update(view)
                    done += len(view)
                    if progress is not None:
                        progress(ReorderProgress("verify", done, total, index, len(written.shards), shard.name))
                if hasher.hexdigest() != hashes.get(entry.name):
                    differ.append(f"{entry.name} ({shard.name})")
        finally:
            os.close(fd)
        if progress is not None:
            progress(ReorderProgress("verify", done, total, index + 1, len(written.shards), shard.name))
    if differ:
        raise LayerwiseError(
            f"--verify: {len(differ)} tensor(s) differ from the source, first: {differ[0]}; nothing was put in place",
            where=str(dst),
        )

