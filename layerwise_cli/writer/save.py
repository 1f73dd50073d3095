"""`save_checkpoint`: write a trainer's tensors as a checkpoint that every loader reads in layer order."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from layerwise_cli.checkpoint.delta.format import DELTA_FILE
from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.checkpoint.format.digests import digests_metadata
from layerwise_cli.checkpoint.format.header import ShardHeader, TensorEntry
from layerwise_cli.checkpoint.sources import INDEX_NAME, Checkpoint
from layerwise_cli.errors import LayerwiseError, describe_exception
from layerwise_cli.planning.inspect import OrderReport
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.planning.plan import build_plan
from layerwise_cli.reorder.output_shards import DEFAULT_MAX_SHARD_SIZE, split_shards
from layerwise_cli.reorder.write import shard_header
from layerwise_cli.staging import fsync_dir, put_in_place, staging
from layerwise_cli.writer.delta_file import MAX_CHAIN_WRITTEN, DeltaSummary, write_delta_from_spill
from layerwise_cli.writer.spill import Spilled, SpillFile, copy_range, write_all

_SPILL = ".layerwise-spill"
_WRITTEN_NAMES = (INDEX_NAME, "config.json")
# A DIRECTORY that filled up while the writer wrote (it was checked empty, or `overwrite` was not given).
FILLED_UP = "exists and is not empty; pass overwrite=True to replace it"


@dataclass(frozen=True)
class SavedCheckpoint:
    """What `save_checkpoint` wrote.

    Attributes:
        directory: the checkpoint directory (after the atomic rename).
        shards: the shard file names, in layer order.
        tensors: how many tensors were written.
        total_bytes: tensor bytes (headers not counted).
        largest_layer_bytes: the largest parent layer's bytes.
        peak_buffer_bytes: what vLLM's own loader buffers reading it (inspect-order's
            file-order peak): the largest layer, or the layers vLLM holds to the end
            together (a padded vocabulary), whichever is larger.
        marker: the completion marker written last, or None.
        replaced: an existing directory was replaced (overwrite=True).
        seconds: wall time of the whole save, marker included.
        delta: what the delta holds, when a delta was written against a base (`save_checkpoint(base=...)`,
            `write_delta`); None for a full checkpoint. Then `shards` is `("delta.safetensors",)`,
            `total_bytes` the delta's tensor bytes, and the layer figures those of the full step.
        fallback: why a full checkpoint was written although a base was given (None otherwise).
    """

    directory: Path
    shards: tuple[str, ...]
    tensors: int
    total_bytes: int
    largest_layer_bytes: int
    peak_buffer_bytes: int
    marker: Path | None
    replaced: bool
    seconds: float
    delta: DeltaSummary | None = None
    fallback: str | None = None


def save_checkpoint(
    named_tensors: Iterable[tuple[str, object]],
    directory: str | os.PathLike[str],
    *,
    config: dict | object | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    marker: str | None = "STABLE",
    overwrite: bool = False,
    allow_nonfinite: bool = False,
    mapping: str = "auto",
    base: str | os.PathLike[str] | None = None,
    whole_fraction: float | None = None,
    max_chain: int | None = MAX_CHAIN_WRITTEN,
) -> SavedCheckpoint:
    """Write tensors as a safetensors checkpoint in layer order, with digests, atomically, marker last.

    For training loops: pass `model.state_dict().items()`, or a generator that
    yields one tensor at a time (gathered from shards, or read from a
    checkpoint larger than RAM). The result loads with vLLM's own loader and
    with `transformers`; its shards are laid out so that vLLM's loader (shards
    in natural order, each shard's tensors by name) completes parent layers one
    after another, so `layerwise reload`, `reload_weights` and a fresh engine
    all buffer at most the largest parent layer (`inspect-order` shows it).

    What is written, into a temporary directory beside DIRECTORY:
    `model-0000i-of-0000N.safetensors` shards (each header's `__metadata__`
    holds `format: pt` and `layerwise.digests`, the xxh3-128 digest of each of
    its tensors: see `layerwise_cli.checkpoint.format.digests`),
    `model.safetensors.index.json`, and `config.json` when CONFIG is given.
    Every file and the directory are fsync'd, the directory is renamed to
    DIRECTORY, and only then is the empty MARKER file created inside it and
    fsync'd: a reader that waits for the marker never sees a partial
    checkpoint. On any error, or Ctrl-C,
    the temporary directory is removed and DIRECTORY is left as it was.

    Memory is bounded by one tensor, whatever the checkpoint's size: each
    tensor is checked, hashed and appended to a spill file inside the
    temporary directory as it arrives (a CUDA tensor is copied to the host in
    8 MiB pieces; a non-contiguous tensor is first made contiguous on its own
    device, one copy of that tensor), then dropped; the shards are then filled
    from the spill file in layer order by the kernel (`copy_file_range`) or an
    8 MiB buffer. Beyond what the caller's iterable holds, the writer keeps
    about 200 bytes per tensor. Disk: DIRECTORY's filesystem needs about twice
    the checkpoint's size free while writing (spill file and shards).

    Args:
        named_tensors: (name, torch.Tensor) pairs in any order, on the CPU or a
            GPU; names are the checkpoint's tensor names (as `save_pretrained`
            writes them: `model.layers.0.self_attn.q_proj.weight`).
        directory: the checkpoint directory to create (e.g. `run/step_120`).
        config: the model's config (a dict, or an object with `to_dict()` such
            as a `transformers` config): written as `config.json`, and used to
            map tensors to vLLM's parent layers. Without it, tensors are grouped
            by their decoder-layer index (`layers.N.`) in natural order.
        max_shard_size: the most tensor bytes per shard (a larger parent layer
            gets consecutive shards of its own).
        marker: the name of the empty completion file created last inside
            DIRECTORY (None: no marker).
        overwrite: replace an existing non-empty DIRECTORY (only one that holds
            plain files: no subdirectories or links); the old one is removed
            after the new one is in place.
        allow_nonfinite: write tensors holding NaN or Inf (refused by default,
            as `layerwise reload` refuses them).
        mapping: how tensors map to parent layers (see `mapping_for_config`).
        base: the previous step's directory (a full checkpoint on this machine): write a sparse delta
            against it (`delta.safetensors`, see `layerwise_cli.checkpoint.delta.format` and docs/deltas.md) instead
            of the full step, when the base is proved (each base tensor's bytes hash to its header digest,
            or, without digests, the digest is computed from them), holds the same tensors with the same
            shapes and dtypes, and the delta is smaller than the full step; otherwise the full step is
            written and `fallback` says why. The delta's metadata holds the full step's digests.
        whole_fraction: with BASE, a tensor with more than this fraction of its values changed is stored
            whole (None: `checkpoint.delta.WHOLE_FRACTION`, one half).
        max_chain: with BASE, the most deltas a chain may hold: when BASE is a delta already that many links
            from its chain's full step, the full step is written (a new chain starts; `fallback` says so).
            Every reload that rebuilds a step decodes each link of its chain. None: no bound but the readers'.

    Returns:
        What was written and what vLLM's loader will buffer reading it.

    Raises:
        LayerwiseError: a duplicate, empty or unsafe tensor name, a value that
            is not a dense torch tensor, a tensor holding NaN or Inf, no
            tensors at all, an existing non-empty DIRECTORY without
            `overwrite`, a bad MARKER name, or a failed write. Nothing is put
            in place then.
    """
    started = time.perf_counter()
    dst = Path(directory).absolute()
    where = str(dst)
    config_dict = _config_dict(config, where)
    if max_shard_size <= 0:
        raise LayerwiseError(f"max_shard_size must be positive, not {max_shard_size}", where=where)
    _check_marker(marker, where)
    _check_destination(dst, overwrite)
    layer_mapping = mapping_for_config(config_dict, mapping)
    try:
        with staging(dst) as tmp:
            out = tmp / "out"
            out.mkdir()
            contents = _write_contents(named_tensors, out, tmp, where, config_dict=config_dict,
                                       layer_mapping=layer_mapping, max_shard_size=max_shard_size,
                                       allow_nonfinite=allow_nonfinite, base=base, whole_fraction=whole_fraction,
                                       max_chain=max_chain)
            delta = contents.delta
            # A delta rebuilds the base's layout: its figures are the base's plan's, and its order the base's
            # writer's, whatever wrote it (only shards written here are held to layer order).
            written = (_check_written(out, layer_mapping, where) if delta is None
                       else _written_order(Path(delta.base), layer_mapping))
            replaced = put_in_place(out, dst, tmp, replace=overwrite, refusal=FILLED_UP)
        marker_path = _write_marker(dst, marker) if marker else None
    except OSError as exc:
        raise LayerwiseError(f"cannot write: {exc.strerror or exc}; nothing was put in place", where=where) from None
    return _saved(dst, contents.shard_names, contents.tensors, written, (delta, contents.fallback), marker_path,
                  replaced, started)


@dataclass(frozen=True)
class _Contents:
    """What `_write_contents` wrote into the staging directory, before the check and the rename into place."""

    tensors: int
    shard_names: list[str]  # in layer order; empty for a delta (its one file is `DELTA_FILE`)
    delta: DeltaSummary | None
    fallback: str | None  # why a full step was written although a base was given


def _write_contents(named_tensors: Iterable[tuple[str, object]], out: Path, tmp: Path, where: str, *,
                    config_dict: dict | None, layer_mapping, max_shard_size: int, allow_nonfinite: bool,
                    base: str | os.PathLike[str] | None, whole_fraction: float | None,
                    max_chain: int | None) -> _Contents:
    """Spill NAMED_TENSORS into TMP, then write into OUT the step's shards and index, or its delta against BASE.

    `config.json` is written too when there is a config. The spill file is
    removed whatever happens; OUT is left for the caller to check and put in
    place.
    """
    spill = SpillFile(tmp / _SPILL, where)
    delta = fallback = None
    try:
        spilled = _spill_all(named_tensors, spill, where, allow_nonfinite)
        if base is not None:
            delta, fallback = write_delta_from_spill(base, spilled, spill, out, whole_fraction, max_chain)
        if delta is None:
            shards = _write_shards(spilled, config_dict, layer_mapping, max_shard_size, spill, out)
    finally:
        spill.close()
        os.unlink(spill.path)
    if delta is None:
        _write_json(out / INDEX_NAME, {
            "metadata": {"total_size": sum(s.nbytes for s in spilled)},
            "weight_map": {entry.name: shard.name for shard in shards
                           for entry in sorted(shard.tensors, key=lambda t: t.name)},
        })
    if config_dict is not None:
        _write_json(out / "config.json", config_dict)
    return _Contents(tensors=len(spilled), shard_names=[] if delta is not None else [s.name for s in shards],
                     delta=delta, fallback=fallback)


def _saved(dst: Path, shard_names: list[str], tensors: int, written: OrderReport,
           delta: tuple[DeltaSummary | None, str | None], marker: Path | None, replaced: bool,
           started: float) -> SavedCheckpoint:
    """What `save_checkpoint` or `write_delta` put at DST: a delta's figures are its own, its layout its base's."""
    plan = written.plan
    summary, fallback = delta
    return SavedCheckpoint(
        directory=dst, shards=(DELTA_FILE,) if summary is not None else tuple(shard_names),
        tensors=tensors, total_bytes=summary.delta_bytes if summary is not None else plan.total_bytes,
        largest_layer_bytes=plan.largest_layer_bytes,
        peak_buffer_bytes=written.file_order_buffering.peak_buffer_bytes, marker=marker, replaced=replaced,
        seconds=time.perf_counter() - started, delta=summary, fallback=fallback,
    )


def _config_dict(config: object, where: str) -> dict | None:
    if config is None or isinstance(config, dict):
        return config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        result = to_dict()
        if isinstance(result, dict):
            return result
    raise LayerwiseError(f"config must be a dict or have to_dict(), not a {type(config).__name__}", where=where)


def _check_marker(marker: str | None, where: str) -> None:
    if marker is None:
        return
    if (not isinstance(marker, str) or not marker or marker in {".", ".."} or "/" in marker or "\\" in marker
            or "\0" in marker or marker in _WRITTEN_NAMES or marker.endswith(".safetensors")):
        raise LayerwiseError(f"marker {marker!r} must be a plain file name other than the checkpoint's own files",
                             where=where)


def _check_name(name: object, where: str) -> str:
    # Tensor names never become paths here (the spill file holds every tensor), but a name with a path
    # separator, a NUL or the header's own `__metadata__` key is no module path any loader would accept.
    if not isinstance(name, str) or not name:
        raise LayerwiseError(f"tensor name {name!r} is not a non-empty string", where=where)
    if name == "__metadata__" or any(c in name for c in "/\\\0") or name.startswith(".") or ".." in name:
        raise LayerwiseError(f"tensor name {name!r} is not a module path (no '/', '\\\\', '..', NUL, "
                             "leading '.' or '__metadata__')", where=where)
    return name


def _check_destination(dst: Path, overwrite: bool) -> None:
    where = str(dst)
    if dst.is_symlink():
        raise LayerwiseError("is a symlink; write to a real directory", where=where)
    if not dst.exists():
        return
    if not dst.is_dir():
        raise LayerwiseError("exists and is not a directory", where=where)
    entries = list(dst.iterdir())
    if not entries:
        return
    if not overwrite:
        raise LayerwiseError("exists and is not empty; pass overwrite=True to replace it", where=where)
    for entry in entries:
        if entry.is_symlink() or not entry.is_file():
            raise LayerwiseError(f"overwrite replaces only a directory of plain files, and this one holds "
                                 f"{entry.name!r}; remove it yourself", where=where)


def _spill_all(named_tensors: Iterable[tuple[str, object]], spill: SpillFile, where: str,
               allow_nonfinite: bool) -> list[Spilled]:
    spilled: list[Spilled] = []
    seen: set[str] = set()
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise LayerwiseError(f"expected (name, tensor) pairs, got a {type(item).__name__}", where=where)
        name = _check_name(item[0], where)
        if name in seen:
            raise LayerwiseError(f"tensor {name!r} is given twice", where=where)
        seen.add(name)
        spilled.append(spill.add(name, item[1], allow_nonfinite=allow_nonfinite))
        # Drop our references before the iterable makes the next tensor: one tensor alive at a time.
        item = None
    if not spilled:
        raise LayerwiseError("no tensors to write", where=where)
    return spilled


def _write_shards(spilled: list[Spilled], config: dict | None, layer_mapping, max_shard_size: int,
                  spill: SpillFile, out: Path):
    """Plan the shards with the same rule as `layerwise reorder`, then fill each from the spill file."""
    # The plan is made over the tensors in name order, so that any input order gives the same files.
    by_name = {s.name: s for s in spilled}
    entries = [TensorEntry(s.name, s.dtype, s.shape, _SPILL, s.offset, s.offset + s.nbytes)
               for s in sorted(spilled, key=lambda s: s.offset)]
    source = ShardHeader(name=_SPILL, header_len=0, file_size=None, tensors=entries)
    checkpoint = Checkpoint(source=str(out), kind="directory", shards=[source], config=config)
    plan = build_plan(checkpoint, layer_mapping)
    shards = split_shards(plan, max_shard_size)
    for shard in shards:
        digests = {entry.name: by_name[entry.name].digest for entry in shard.tensors}
        header, offsets = shard_header(shard, {"format": "pt", **digests_metadata(digests)})
        fd = os.open(out / shard.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, header, 0)  # the length prefix included
            data_start = len(header)
            for entry in sorted(shard.tensors, key=lambda t: offsets[t.name][0]):
                source_entry = by_name[entry.name]
                copy_range(spill.fd, fd, source_entry.offset, data_start + offsets[entry.name][0],
                           source_entry.nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)
    return shards


def _write_json(path: Path, doc: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8"), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _written_order(folder: Path, layer_mapping) -> OrderReport:
    """The order report of the checkpoint in FOLDER (a delta's base: the step it rebuilds)."""
    plan = build_plan(open_step(str(folder)), layer_mapping)
    return OrderReport(plan, plan.simulate("file"), plan.simulate("layer"))


def _check_written(out: Path, layer_mapping, where: str) -> OrderReport:
    """Re-read the shards written to OUT and re-plan them: vLLM's read order must buffer no more than layer order."""
    report = _written_order(out, layer_mapping)
    file_peak = report.file_order_buffering.peak_buffer_bytes
    layer_peak = report.layer_order_buffering.peak_buffer_bytes
    if file_peak > layer_peak:
        raise LayerwiseError(
            f"internal error: the written shards buffer {file_peak} bytes in vLLM's read order, more than layer "
            f"order's {layer_peak}; please report this", where=where)
    return report


def _write_marker(dst: Path, marker: str) -> Path:
    path = dst / marker
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:
        raise describe_exception(exc, where=str(path)) from exc
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(dst)
    return path
