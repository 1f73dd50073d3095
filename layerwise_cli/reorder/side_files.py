"""Copy a checkpoint's other files (config, tokenizer, model card) beside the rewritten shards."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from layerwise_cli.checkpoint.format.chunks import CHUNK_BYTES
from layerwise_cli.checkpoint.format.layout import INDEX_NAME, is_weight_file, shard_file
from layerwise_cli.checkpoint.shard_copy import copy_fetcher
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.reorder.write import write_chunk

# What a single-file SRC's folder holds for the model (its other files are not the model's).
MODEL_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "README.md",
)


def other_files(folder: Path, whole_folder: bool) -> tuple[list[Path], list[str]]:
    """The non-weight files of a checkpoint folder (relative paths), and the weight files left out."""
    if not whole_folder:
        return [Path(n) for n in MODEL_SIDE_FILES if (folder / n).is_file()], []
    keep: list[Path] = []
    skipped: list[str] = []
    for root, dirs, files in os.walk(folder):
        # Hidden entries are tooling (.git, .cache/huggingface, our own temp dirs), not the model.
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            relative = (Path(root) / name).relative_to(folder)
            if is_weight_file(name):
                skipped.append(str(relative))
            else:
                keep.append(relative)
    return keep, skipped


def copy_other_files(checkpoint: Checkpoint, out: Path, tmp: Path) -> tuple[list[str], list[str]]:
    """Copy SRC's non-weight files into `out`; return those copied and those skipped (with why)."""
    fetcher = copy_fetcher(checkpoint, tmp / "fetch")
    if fetcher is not None:
        folder = fetcher.other_files()
        keep, skipped = other_files(folder, whole_folder=True)[0], []
    else:
        folder = checkpoint.local_dir
        assert folder is not None
        keep, skipped = other_files(folder, whole_folder=checkpoint.kind == "directory")
        # The source's shards and index are what gets rewritten, not files left behind.
        rewritten = {s.name for s in checkpoint.shards} | {INDEX_NAME}
        skipped = [s for s in skipped if s not in rewritten]
    copied: list[str] = []
    for relative in keep:
        refused = copy_side_file(folder, relative, out / relative)
        if refused:
            skipped.append(f"{relative} ({refused})")
        else:
            copied.append(str(relative))
    return copied, skipped


def copy_side_file(folder: Path, relative: Path, target: Path) -> str | None:
    """Copy one non-weight file of SRC; return why it was not copied, or None.

    Only regular files are copied, and only when they resolve inside SRC (a
    symlink into the Hub cache's `blobs/` counts as inside, see `shard_file`):
    a link to `/dev/zero` would never end, one to `/etc/...` would copy a file
    that is not the checkpoint's. At most the size the file had when opened is
    copied, so a file that grows meanwhile cannot fill the disk.
    """
    source = folder / relative
    try:
        shard_file(folder, str(relative), str(folder))
    except LayerwiseError:
        return "a symlink to outside the source"
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW on the resolved path: no link swapped in.
        fd = os.open(source.resolve(), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return f"cannot open: {exc.strerror or exc}"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        os.set_blocking(fd, True)
        target.parent.mkdir(parents=True, exist_ok=True)
        out_fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            done = 0
            while done < info.st_size:
                chunk = os.read(fd, min(CHUNK_BYTES, info.st_size - done))
                if not chunk:
                    break
                write_chunk(out_fd, chunk, done)
                done += len(chunk)
            os.fsync(out_fd)
        finally:
            os.close(out_fd)
    finally:
        os.close(fd)
    return None
