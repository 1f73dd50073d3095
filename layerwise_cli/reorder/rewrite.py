"""Rewrite a checkpoint so that vLLM's own loader reads it in layer order: the core of `layerwise reorder`."""

from __future__ import annotations

import bisect
import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from layerwise_cli.checkpoint.finite import ByteScan, NonFinite
from layerwise_cli.checkpoint.header import DTYPE_SIZES, ShardHeader, TensorEntry, read_shard_header
from layerwise_cli.checkpoint.sources import INDEX_NAME, Checkpoint, open_checkpoint, shard_file
from layerwise_cli.errors import LayerwiseError, describe_exception
from layerwise_cli.planning.inspect import OrderReport
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.planning.plan import Plan, build_plan

# The shard-boundary rule
# -----------------------
# vLLM's default loader reads shard files in natural sort order and, inside a
# shard, tensors sorted by name (`safe_open(...).keys()`), whatever the order
# of the data. Names sort lexicographically: `layers.10` < `layers.2`, and in
# one decoder layer `k_proj` < `o_proj` < `q_norm` < `q_proj` < `v_proj`.
#
# "Complete parent layers one after another" is taken strictly: in that read
# order, every parent layer's tensors form one contiguous run, so at most one
# layer is ever partly delivered and the file-order peak equals the largest
# parent layer exactly (reached when its last tensor arrives).
#
# Inside one shard, a parent layer is contiguous in sorted order iff no tensor
# of another parent in the same shard sorts between its first and last name.
# So a shard is valid iff the name intervals [first, last] of its parent
# layers are pairwise disjoint. Sorted name sets with a common prefix form an
# interval, so whole decoder layers (`...layers.7.`) and fused experts
# (`...mlp.experts.`) never collide with each other; what collides is the
# attention block: `o_proj` and `q_norm` sort inside `qkv_proj`'s interval
# [`k_proj`, `v_proj`] and must live in another shard than that `qkv_proj`.
#
# Packing (`plan_shards`): parent layers in model order go into a window of
# two open shards. A layer goes into the current shard if it fits and its
# interval is free there; if it fits but collides, into the next shard (so
# `o_proj`/`q_norm` ride one shard later, next to later layers, which they do
# not collide with); if it does not fit, the current shard is closed and the
# next one becomes current. A layer larger than `max_shard_size` gets shards
# of its own, consecutive, split between tensors in name order, so it is still
# read as one run. A dense model thus needs about one shard more than
# size alone would ask for. Tensors the engine does not load (no parent
# layer) are never buffered and are packed by size only.
#
# Before anything is put in place, the written headers are re-read and
# re-planned (`_check_written`): a layer read in two pieces, or a file-order
# peak other than the largest layer, stops the rewrite as an internal error.

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # the Hub's convention: 5GB
_CHUNK = 8 * 2**20  # bytes copied per read/write: what the copy holds in memory
_TMP_MARK = ".layerwise-tmp-"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")
_WEIGHT_INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json", ".pt.index.json")
# What a single-file SRC's folder holds for the model (its other files are not the model's).
_MODEL_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "README.md",
)


@dataclass
class PlannedShard:
    """One shard of the rewritten checkpoint: its tensors, in the order of its data section."""

    name: str
    tensors: list[TensorEntry]
    parents: list[str]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class ReorderProgress:
    """Where a rewrite stands; passed to the `progress` callback."""

    phase: str  # "fetch", "write" or "verify"
    bytes_done: int
    bytes_total: int
    shards_done: int
    shards_total: int
    file: str = ""


@dataclass
class ReorderResult:
    """What `reorder` wrote, and the file-order buffering before and after."""

    source: str
    revision: str | None
    destination: Path
    max_shard_size: int
    before: OrderReport
    after: OrderReport
    shards: list[PlannedShard]
    bytes_written: int  # file bytes: headers and tensor data
    files_copied: list[str]
    files_skipped: list[str]
    verified: bool  # every tensor's bytes re-read from DST and matched against SRC (sha256)
    replaced: bool  # an existing DST was replaced (--force)
    seconds: float
    metadata_conflicts: list[str] = field(default_factory=list)
    # With verify: tensors holding NaN or Inf (written only with allow_nonfinite).
    nonfinite: list[NonFinite] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready data: integers for bytes, seconds as a float."""
        largest = self.after.plan.largest_layer_bytes

        def side(report: OrderReport) -> dict:
            return {
                "shards": len(report.plan.checkpoint.shards),
                "file_order_peak_buffer_bytes": report.file_order_buffering.peak_buffer_bytes,
                "peak_over_largest_layer": report.file_order_buffering.peak_buffer_bytes / largest if largest else 0.0,
                "open_layers_at_peak": report.file_order_buffering.peak_open_layers,
                "peak_tensor": report.file_order_buffering.peak_tensor,
            }

        return {
            "source": self.source,
            "revision": self.revision,
            "destination": str(self.destination),
            "mapping": {"kind": self.after.plan.mapping.kind, "architecture": self.after.plan.mapping.architecture},
            "max_shard_size": self.max_shard_size,
            "tensors": len(self.after.plan.file_order),
            "total_bytes": self.after.plan.total_bytes,
            "bytes_written": self.bytes_written,
            "largest_layer_bytes": largest,
            "before": side(self.before),
            "after": side(self.after),
            "shards": [
                {"name": s.name, "tensors": len(s.tensors), "parent_layers": len(s.parents), "bytes": s.nbytes}
                for s in self.shards
            ],
            "files_copied": self.files_copied,
            "files_skipped": self.files_skipped,
            "metadata_conflicts": self.metadata_conflicts,
            "verified": self.verified,
            "nonfinite": [found.to_dict() for found in self.nonfinite],
            "replaced": self.replaced,
            "seconds": self.seconds,
        }


class ReorderInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while writing; temporary files are removed before this propagates."""

    def __init__(self, signum: int, committed: bool = False) -> None:
        self.signum = signum
        self.committed = committed  # True: the signal came during the final rename, DST is complete
        super().__init__(signal.Signals(signum).name)


# --- planning -----------------------------------------------------------------------------------------------


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


def plan_shards(plan: Plan, max_shard_size: int) -> list[PlannedShard]:
    """Split a checkpoint's tensors into shards that vLLM's loader reads in layer order.

    See the shard-boundary rule at the top of this module. No parent layer
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
        shards.append(PlannedShard(f"model-{i:05d}-of-{total:05d}.safetensors", data_order, builder.parents))
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


def shard_header(shard: PlannedShard, metadata: dict[str, str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Build a shard's header: the JSON padded with spaces to 8 bytes, and each tensor's offsets.

    Returns:
        The header bytes (without the 8-byte length prefix) and, per tensor
        name, its [begin, end) in the data section.
    """
    offsets: dict[str, tuple[int, int]] = {}
    position = 0
    for entry in shard.tensors:
        offsets[entry.name] = (position, position + entry.nbytes)
        position += entry.nbytes
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = metadata
    for entry in sorted(shard.tensors, key=lambda t: t.name):
        doc[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": list(offsets[entry.name])}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return raw, offsets


# --- writing ------------------------------------------------------------------------------------------------


def _write_chunk(fd: int, data: memoryview | bytes, offset: int) -> None:
    """Write all of `data` at `offset` (the one place tensor bytes are written)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _reserve(fd: int, size: int) -> None:
    # Reserving the space up front turns a full disk into an error before any
    # tensor is copied; filesystems without fallocate get a sparse file.
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


class _SignalGuard:
    """Turn SIGINT/SIGTERM into `ReorderInterrupted`, or hold them while the DST is being swapped in."""

    def __init__(self) -> None:
        self.held = False
        self.pending: int | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self.held:
            self.pending = signum
            return
        raise ReorderInterrupted(signum)

    @contextmanager
    def hold(self) -> Iterator[None]:
        self.held = True
        try:
            yield
        finally:
            self.held = False


@contextmanager
def _signals_raise() -> Iterator[_SignalGuard]:
    guard = _SignalGuard()
    if threading.current_thread() is not threading.main_thread():
        yield guard  # signals reach only the main thread's handlers anyway
        return
    previous = {sig: signal.signal(sig, guard.handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield guard
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _merged_metadata(checkpoint: Checkpoint) -> tuple[dict[str, str], list[str]]:
    merged: dict[str, str] = {}
    conflicts: list[str] = []
    for shard in checkpoint.shards:
        for key, value in shard.metadata.items():
            if key in merged and merged[key] != value and key not in conflicts:
                conflicts.append(key)
            merged.setdefault(key, value)
    return merged, conflicts


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(_WEIGHT_INDEX_SUFFIXES)


def _other_files(folder: Path, whole_folder: bool) -> tuple[list[Path], list[str]]:
    """The non-weight files of a checkpoint folder (relative paths), and the weight files left out."""
    if not whole_folder:
        return [Path(n) for n in _MODEL_SIDE_FILES if (folder / n).is_file()], []
    keep: list[Path] = []
    skipped: list[str] = []
    for root, dirs, files in os.walk(folder):
        # Hidden entries are tooling (.git, .cache/huggingface, our own temp dirs), not the model.
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            relative = (Path(root) / name).relative_to(folder)
            if _is_weight_file(name):
                skipped.append(str(relative))
            else:
                keep.append(relative)
    return keep, skipped


class _HubFetcher:
    """Fetch a Hub source's shards one at a time: from the local cache when there, else into the temp dir."""

    def __init__(self, checkpoint: Checkpoint, fetch_dir: Path) -> None:
        self.checkpoint = checkpoint
        self.fetch_dir = fetch_dir

    def shard(self, name: str) -> tuple[Path, bool]:
        """Return a local path for shard `name` and whether to delete it after use."""
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        repo, revision = self.checkpoint.source, self.checkpoint.revision
        try:
            cached = try_to_load_from_cache(repo, name, revision=revision)
            if isinstance(cached, str):
                return Path(cached), False
            return Path(hf_hub_download(repo, name, revision=revision, local_dir=self.fetch_dir)), True
        except Exception as exc:
            raise describe_exception(exc, where=f"{repo}/{name}") from exc

    def other_files(self) -> tuple[Path, list[Path], list[str]]:
        """Fetch the repo's non-weight files (config, tokenizer, README) through the Hub cache."""
        from huggingface_hub import snapshot_download

        ignore = [f"*{s}" for s in _WEIGHT_SUFFIXES + _WEIGHT_INDEX_SUFFIXES] + [".*"]
        try:
            folder = Path(snapshot_download(self.checkpoint.source, revision=self.checkpoint.revision,
                                            ignore_patterns=ignore))
        except Exception as exc:
            raise describe_exception(exc, where=self.checkpoint.source) from exc
        keep, _ = _other_files(folder, whole_folder=True)
        return folder, keep, []


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
) -> ReorderResult:
    """Rewrite SOURCE into DESTINATION so that vLLM's loader reads complete parent layers one after another.

    Tensor bytes are copied raw, in chunks, from source file to destination
    file: memory stays a few MiB whatever the checkpoint's size. Everything is
    written to a temporary directory beside DESTINATION, fsynced, checked
    (headers re-read, tensor set and layer order re-planned, and with
    `verify` every tensor's sha256 compared with the source's), and only
    then renamed into place. SIGINT/SIGTERM remove the temporary directory
    and raise `ReorderInterrupted`.

    Args:
        source: a `.safetensors` file, a directory, or a Hub repo id (shards
            are fetched one at a time as the copy needs them).
        destination: the directory to create.
        max_shard_size: the most tensor bytes per shard (see `plan_shards`).
        force: replace an existing DESTINATION (old one removed only after
            the new one is in place).
        verify: re-read every tensor from DESTINATION and compare its sha256
            with the bytes read from SOURCE; any difference is an error and
            nothing is put in place. In the same pass, every floating tensor
            is checked for NaN and Inf: one is an error too, unless
            `allow_nonfinite` (then the result lists them).
        revision: Hub branch, tag or commit.
        mapping: how tensors map to parent layers (see `mapping_for_config`).
        progress: called with a `ReorderProgress` as bytes are written.

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
    _check_destination(checkpoint, dst, force)
    shards = plan_shards(plan, max_shard_size)
    metadata, conflicts = _merged_metadata(checkpoint)

    with _signals_raise() as guard:
        tmp: Path | None = None
        try:
            try:
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}{_TMP_MARK}", dir=dst.parent))
            except OSError as exc:
                raise LayerwiseError(
                    f"cannot write beside the destination: {exc.strerror or exc}", where=str(dst)
                ) from None
            out = tmp / "out"
            out.mkdir()
            copied, skipped = _copy_other_files(checkpoint, out, tmp)
            nonfinite: list[NonFinite] = []
            hashes, bytes_written = _write_shards(checkpoint, shards, metadata, out, tmp, verify, progress,
                                                  allow_nonfinite, nonfinite)
            _write_index(checkpoint, shards, out)
            _fsync_dir(out)
            after = _check_written(checkpoint, plan, out, dst, hashes, progress)
            with guard.hold():
                replaced = _commit(out, dst, tmp, force)
        except OSError as exc:
            raise LayerwiseError(
                f"cannot write: {exc.strerror or exc}; nothing was put in place", where=str(dst)
            ) from None
        finally:
            if tmp is not None:
                with guard.hold():
                    shutil.rmtree(tmp, ignore_errors=True)
        if guard.pending is not None:
            # The signal came while the finished checkpoint was being swapped in: it is in place.
            raise ReorderInterrupted(guard.pending, committed=True)
    return ReorderResult(
        source=checkpoint.source, revision=checkpoint.revision, destination=dst, max_shard_size=max_shard_size,
        before=before, after=after, shards=shards, bytes_written=bytes_written, files_copied=copied,
        files_skipped=skipped, verified=verify, replaced=replaced, seconds=time.perf_counter() - started,
        metadata_conflicts=conflicts, nonfinite=nonfinite,
    )


def _check_destination(checkpoint: Checkpoint, dst: Path, force: bool) -> None:
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
        why = _not_a_checkpoint(dst)
        if why:
            raise LayerwiseError(f"--force replaces only a checkpoint directory, and this {why}; "
                                 "remove it yourself or choose another destination", where=str(dst))


# What a checkpoint directory holds (weights, index, config, tokenizer, model card, remote code).
_CHECKPOINT_FILE_SUFFIXES = _WEIGHT_SUFFIXES + _WEIGHT_INDEX_SUFFIXES + (
    ".json", ".txt", ".model", ".jinja", ".md", ".py", ".tiktoken", ".spm", ".yaml", ".yml")
_CHECKPOINT_FILE_NAMES = ("LICENSE", "LICENSE.txt", "NOTICE", "USE_POLICY.md", ".gitattributes")


def _not_a_checkpoint(dst: Path) -> str | None:
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
            if not (name.endswith(_CHECKPOINT_FILE_SUFFIXES) or name in _CHECKPOINT_FILE_NAMES):
                return f"holds {relative!r}, which is not a checkpoint file"
            has_weights = has_weights or (root == str(dst) and name.endswith(".safetensors"))
    if not has_weights and any(dst.iterdir()):
        return "holds no .safetensors shards"
    return None


def _copy_other_files(checkpoint: Checkpoint, out: Path, tmp: Path) -> tuple[list[str], list[str]]:
    if checkpoint.kind == "hub":
        folder, keep, skipped = _HubFetcher(checkpoint, tmp / "fetch").other_files()
    else:
        folder = checkpoint.local_dir
        assert folder is not None
        keep, skipped = _other_files(folder, whole_folder=checkpoint.kind == "directory")
        # The source's shards and index are what gets rewritten, not files left behind.
        rewritten = {s.name for s in checkpoint.shards} | {INDEX_NAME}
        skipped = [s for s in skipped if s not in rewritten]
    copied: list[str] = []
    for relative in keep:
        refused = _copy_side_file(folder, relative, out / relative)
        if refused:
            skipped.append(f"{relative} ({refused})")
        else:
            copied.append(str(relative))
    return copied, skipped


def _copy_side_file(folder: Path, relative: Path, target: Path) -> str | None:
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
                chunk = os.read(fd, min(_CHUNK, info.st_size - done))
                if not chunk:
                    break
                _write_chunk(out_fd, chunk, done)
                done += len(chunk)
            os.fsync(out_fd)
        finally:
            os.close(out_fd)
    finally:
        os.close(fd)
    return None


def _write_shards(
    checkpoint: Checkpoint,
    shards: list[PlannedShard],
    metadata: dict[str, str],
    out: Path,
    tmp: Path,
    verify: bool,
    progress: Callable[[ReorderProgress], None] | None,
    allow_nonfinite: bool = False,
    nonfinite: list[NonFinite] | None = None,
) -> tuple[dict[str, str], int]:
    """Create every DST shard (header, space reserved), then copy tensors in, one SRC shard at a time.

    With `verify`, each tensor's bytes are hashed and checked for NaN/Inf as
    they are copied; a non-finite tensor is refused unless `allow_nonfinite`,
    and then appended to `nonfinite`.
    """
    # Where each tensor goes: DST shard, absolute file offset.
    target: dict[str, tuple[PlannedShard, int]] = {}
    remaining: dict[str, int] = {}
    bytes_written = 0
    for shard in shards:
        header, offsets = shard_header(shard, metadata)
        path = out / shard.name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_chunk(fd, struct.pack("<Q", len(header)) + header, 0)
            _reserve(fd, 8 + len(header) + shard.nbytes)
        finally:
            os.close(fd)
        bytes_written += 8 + len(header)
        for entry in shard.tensors:
            target[entry.name] = (shard, 8 + len(header) + offsets[entry.name][0])
        remaining[shard.name] = len(shard.tensors)

    total = sum(s.nbytes for s in shards)
    done_bytes = 0
    done_shards = 0
    hashes: dict[str, str] = {}
    buf = bytearray(_CHUNK)
    # Fetch source shards in the order the plan needs them: the one holding the earliest destination tensor first.
    rank = {entry.name: i for i, entry in enumerate(t for s in shards for t in s.tensors)}
    ordered = sorted(checkpoint.shards, key=lambda s: min((rank[t.name] for t in s.tensors), default=len(rank)))
    fetcher = _HubFetcher(checkpoint, tmp / "fetch") if checkpoint.kind == "hub" else None

    def report(phase: str, file: str) -> None:
        if progress is not None:
            progress(ReorderProgress(phase, done_bytes, total, done_shards, len(shards), file))

    report("write", "")
    for src_shard in ordered:
        if not src_shard.tensors:
            continue
        if fetcher is not None:
            report("fetch", src_shard.name)
            path, delete = fetcher.shard(src_shard.name)
            local = _local_header(path, src_shard, checkpoint)
        else:
            path, delete, local = checkpoint.shard_path(src_shard), False, src_shard
        src_fd = os.open(path, os.O_RDONLY)
        try:
            by_dst: dict[str, list[TensorEntry]] = {}
            for entry in sorted(local.tensors, key=lambda t: t.begin):
                by_dst.setdefault(target[entry.name][0].name, []).append(entry)
            for dst_name, entries in by_dst.items():
                dst_fd = os.open(out / dst_name, os.O_WRONLY)
                try:
                    for entry in entries:
                        hasher = hashlib.sha256() if verify else None
                        scan = ByteScan(entry.dtype) if verify else None
                        src_at = local.data_start + entry.begin
                        dst_at = target[entry.name][1]
                        copied = 0
                        while copied < entry.nbytes:
                            n = min(_CHUNK, entry.nbytes - copied)
                            view = memoryview(buf)[:n]
                            got = os.preadv(src_fd, [view], src_at + copied)
                            if got <= 0:
                                raise LayerwiseError(
                                    f"tensor {entry.name!r}: file ended while reading (changed while reading?)",
                                    where=str(path),
                                )
                            if hasher is not None:
                                hasher.update(view[:got])
                                scan.update(view[:got])
                            _write_chunk(dst_fd, view[:got], dst_at + copied)
                            copied += got
                            done_bytes += got
                            report("write", dst_name)
                        if hasher is not None:
                            hashes[entry.name] = hasher.hexdigest()
                            if scan.found:
                                found = NonFinite(entry.name, src_shard.name, scan.nan, scan.inf)
                                if not allow_nonfinite:
                                    raise LayerwiseError(
                                        f"--verify: {found.describe()}; refusing, nothing was put in place "
                                        "(use --allow-nonfinite to write it anyway)", where=str(path))
                                if nonfinite is not None:
                                    nonfinite.append(found)
                        remaining[dst_name] -= 1
                    if remaining[dst_name] == 0:
                        os.fsync(dst_fd)
                        done_shards += 1
                        report("write", dst_name)
                finally:
                    os.close(dst_fd)
        finally:
            os.close(src_fd)
            if delete:
                path.unlink(missing_ok=True)
    return hashes, bytes_written + total


def _local_header(path: Path, remote: ShardHeader, checkpoint: Checkpoint) -> ShardHeader:
    """Read a fetched shard's header and check it is the one planned from the Hub's metadata."""
    local, _ = read_shard_header(path, remote.name)
    planned = {(t.name, t.dtype, t.shape, t.nbytes) for t in remote.tensors}
    if {(t.name, t.dtype, t.shape, t.nbytes) for t in local.tensors} != planned:
        raise LayerwiseError(
            "the downloaded shard differs from the metadata read before (repo changed? pin --revision)",
            where=f"{checkpoint.source}/{remote.name}",
        )
    return local


def _write_index(checkpoint: Checkpoint, shards: list[PlannedShard], out: Path) -> None:
    meta: dict[str, object] = {}
    if checkpoint.index and isinstance(checkpoint.index.get("metadata"), dict):
        meta.update(checkpoint.index["metadata"])  # e.g. total_parameters
    meta["total_size"] = sum(s.nbytes for s in shards)
    weight_map = {t.name: s.name for s in shards for t in s.tensors}
    doc = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    path = out / INDEX_NAME
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _check_written(
    checkpoint: Checkpoint,
    plan: Plan,
    out: Path,
    dst: Path,
    hashes: dict[str, str],
    progress: Callable[[ReorderProgress], None] | None,
) -> OrderReport:
    """Re-read what was written: headers, tensor set, the order vLLM reads, and (verify) every tensor's bytes."""
    written = replace(open_checkpoint(str(out)), source=str(dst))
    wanted = {(t.name, t.dtype, t.shape) for t in checkpoint.tensors}
    got = {(t.name, t.dtype, t.shape) for t in written.tensors}
    if wanted != got:
        missing = sorted(n for n, *_ in wanted - got) + sorted(n for n, *_ in got - wanted)
        raise LayerwiseError(f"written tensors differ from the source's, first: {missing[0]!r}", where=str(dst))
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
    if hashes:
        _verify_bytes(written, out, hashes, dst, progress)
    return after


def _verify_bytes(
    written: Checkpoint,
    out: Path,
    hashes: dict[str, str],
    dst: Path,
    progress: Callable[[ReorderProgress], None] | None,
) -> None:
    total = written.total_bytes
    done = 0
    buf = bytearray(_CHUNK)
    differ: list[str] = []
    for index, shard in enumerate(written.shards):
        fd = os.open(out / shard.name, os.O_RDONLY)
        try:
            for entry in sorted(shard.tensors, key=lambda t: t.begin):
                hasher = hashlib.sha256()
                at = shard.data_start + entry.begin
                read = 0
                while read < entry.nbytes:
                    view = memoryview(buf)[: min(_CHUNK, entry.nbytes - read)]
                    got = os.preadv(fd, [view], at + read)
                    if got <= 0:
                        break
                    hasher.update(view[:got])
                    read += got
                    done += got
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


def _commit(out: Path, dst: Path, tmp: Path, force: bool) -> bool:
    """Rename the finished checkpoint into place; an old DST is moved aside first and removed after."""
    replaced = False
    if dst.exists() or dst.is_symlink():
        if not force:
            raise LayerwiseError("appeared while writing; pass --force to replace it", where=str(dst))
        os.rename(dst, tmp / "previous")
        replaced = True
    try:
        os.rename(out, dst)
    except OSError:
        if replaced:
            os.rename(tmp / "previous", dst)
        raise
    _fsync_dir(dst.parent)
    return replaced
