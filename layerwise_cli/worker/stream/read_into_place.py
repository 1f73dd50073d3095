"""Read a checkpoint tensor from its file straight into the engine's tensor, checked and hashed in the same pass.

For a tensor whose loader is a plain copy (`loader_copies`) into a layer the
last reload loaded into the engine's own tensors (`in_place`), the least a
reload can do is one copy: the file's bytes from the page cache into the
engine's storage. The reading side does that copy itself (`os.preadv` into the
engine tensor's memory, in 2 MiB chunks, the GIL released) and, on each chunk
while it is in the cache, the NaN/Inf check (exact, from the bit patterns:
`finite.bytes_hold_nonfinite`); then the xxh3 digests of whole tensors for the
records. A layer's chunks, then its digests, are shared by the reading thread
and one on the engine's core (`_share`). vLLM is then handed the checkpoint's
tensor as before (safetensors' view of the file, never touched), counts it,
buffers it and replays its loader as before; the replayed copy of bytes already
in place is skipped (`LoaderWatch`).

What is read into place is new in the engine's tensor before vLLM processes
its layer: a layer refused after it was read (NaN/Inf, a file cut short) is
put back by the rollback, which reloads every layer. Only the CPU path: on a
GPU the engine's tensors are in device memory. Off by default
(`LAYERWISE_READ_INTO_PLACE=1`): on a 2-core CPU it is slower than leaving the
copy to vLLM's loader (docs/performance.md, "Reading into place").
"""

from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from layerwise_cli.checkpoint.digests import TensorHasher
from layerwise_cli.checkpoint.finite import NonFinite, bytes_hold_nonfinite, count_nonfinite
from layerwise_cli.checkpoint.samples import buffer_sample, file_sample
from layerwise_cli.checkpoint.sources import shard_file
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.stream.loader_copies import Filled, LoaderFacts, LoaderWatch, PlainCopy

# Bytes read (then flagged and hashed) at a time: small enough to stay in the core's cache for the checks.
CHUNK_BYTES = 2 << 20


@dataclass(frozen=True)
class Target:
    """Where one plain copy of a checkpoint tensor lands: the engine tensor's elements it fills."""

    copy: PlainCopy
    dst: torch.Tensor  # a flat view of the engine tensor's storage, `copy.numel` elements
    layer: torch.nn.Module  # the module holding it


@dataclass(frozen=True)
class IntoPlace:
    """One checkpoint tensor to read into place: its targets; `whole` when one target takes all of it, in order."""

    targets: tuple[Target, ...]
    whole: bool


def plan_into_place(model: torch.nn.Module, facts: LoaderFacts, stream: list[PlannedTensor]
                    ) -> dict[str, IntoPlace]:
    """Before the reload, on the engine's thread: the tensors of STREAM to read into place, and where.

    A tensor qualifies when the last completed reload showed its loader a
    plain copy for this dtype and shape, into modules that reload loaded into
    the engine's own tensors, and those tensors are still on the host,
    contiguous, of that dtype and large enough.
    """
    modules = dict(model.named_modules())
    plans: dict[str, IntoPlace] = {}
    for item in stream:
        fact = facts.copies.get(item.entry.name)
        if item.parent is None or fact is None:
            continue
        if fact.dtype != item.entry.dtype or fact.shape != tuple(item.entry.shape):
            continue
        numel = 1
        for size in item.entry.shape:
            numel *= size
        targets = []
        for copy in fact.copies:
            layer = modules.get(copy.module)
            kernel = _engine_tensor(layer, copy.tensor) if copy.module in facts.in_place else None
            if (kernel is None or kernel.is_meta or kernel.device.type != "cpu" or not kernel.is_contiguous()
                    or copy.dst_offset < 0 or copy.dst_offset + copy.numel > kernel.numel()
                    or copy.src_offset + copy.numel > numel):
                break
            targets.append(Target(copy, kernel.detach().view(-1)[copy.dst_offset:copy.dst_offset + copy.numel], layer))
        else:
            if targets and sum(t.copy.numel for t in targets) <= numel:
                whole = len(targets) == 1 and targets[0].copy.src_offset == 0 and targets[0].copy.numel == numel
                plans[item.entry.name] = IntoPlace(tuple(targets), whole)
    return plans


def place_reader(model: torch.nn.Module, folder: Path, stream: list[PlannedTensor], facts: LoaderFacts,
                 watch: LoaderWatch, *, enabled: bool) -> PlaceReader | None:
    """The reader of this reload's tensors to read into place; None unless ENABLED (and on the CPU, in place).

    With `LAYERWISE_FRESH_BUFFERS` set in the worker no layer loads in place, so nothing is read into place.
    """
    from layerwise_cli.engine_defaults import fresh_buffers_forced

    if not enabled or fresh_buffers_forced():
        return None
    return PlaceReader(folder, plan_into_place(model, facts, stream), watch)


def _engine_tensor(module, name: str) -> torch.Tensor | None:
    if module is None:
        return None
    found = module._parameters.get(name)
    return found if found is not None else module._buffers.get(name)


@dataclass
class PlacedTensor:
    """What reading one tensor into place found: NaN/Inf in it, its sample, (whole) its digest."""

    nonfinite: bool
    sample: str
    digest: str | None
    mapped: torch.Tensor | None = None  # the tensor vLLM is handed (safetensors' view of the file)


@dataclass
class _Reading:
    """One tensor being read into place: where its bytes are, and what the chunks found."""

    item: PlannedTensor
    mapped: torch.Tensor
    plan: IntoPlace
    fd: int
    at: int  # where its data starts in the file
    path: str
    nonfinite: bool = False
    digest: str | None = None


class PlaceReader:
    """Reads the planned tensors from their shard files into the engine's tensors (the reading thread's side)."""

    def __init__(self, folder: Path, plans: dict[str, IntoPlace], watch: LoaderWatch) -> None:
        self._folder = folder
        self.plans = plans
        self._watch = watch
        self._files: dict[str, tuple[int, int, str]] = {}  # shard -> (fd, data start, path)
        self.bytes = 0
        self.tensors = 0
        self.layers: set[str] = set()
        # Set once vLLM asked for the first tensor: nothing is written into the engine before its reload began
        # (a reload vLLM refuses at its start leaves the engine as it was).
        self.engine_started = threading.Event()

    def wait_for_engine(self, stop: threading.Event) -> bool:
        """Block until vLLM's reload began; False when the stream was stopped first."""
        while not self.engine_started.wait(0.05):
            if stop.is_set():
                return False
        return True

    def read(self, item: PlannedTensor, mapped: torch.Tensor, check: bool, digest: bool) -> PlacedTensor:
        """Read one tensor into place (`read_layer` of it alone, on this thread)."""
        from layerwise_cli.worker.stream.stats import ReadAheadStats

        return self.read_layer([item], lambda _: mapped, ReadAheadStats(), {}, {}, check=check,
                               digest=digest)[item.entry.name]

    def read_layer(self, items: list[PlannedTensor], mapped_of, stats, samples: dict, digests: dict, *,
                   check: bool, digest: bool, submit=None) -> dict[str, PlacedTensor]:
        """Read ITEMS (a layer's tensors to read into place; MAPPED_OF(item): the tensor vLLM is handed).

        Its chunks are read and flagged for NaN/Inf, then the digests of whole tensors (when DIGEST) taken,
        from one queue: by this thread and, with SUBMIT (an executor's `submit`, on the engine's core), by a
        second one, whichever is free taking the next. The seconds go to STATS as read, check and hash; the
        samples and digests to theirs.
        """
        if not items:
            return {}
        readings = [_Reading(item, mapped_of(item), self.plans[item.entry.name], *self._where(item)) for item in items]
        chunks = [(reading, target, begin, min(begin + CHUNK_BYTES, _nbytes(target.dst)))
                  for reading in readings for target in reading.plan.targets
                  for begin in range(0, _nbytes(target.dst), CHUNK_BYTES)]
        _share(lambda job: self._fill(*job, check=check), chunks, submit, stats)
        _share(self._hash, [r for r in readings if digest and r.plan.whole], submit, stats, hashing=True)
        found = {}
        for reading in readings:
            item, plan = reading.item, reading.plan
            for target in plan.targets:
                self._watch.fill(Filled(module=target.copy.module, dst_ptr=target.dst.data_ptr(),
                                        src_ptr=reading.mapped.data_ptr() + target.copy.src_offset
                                        * target.dst.element_size(),
                                        numel=target.copy.numel, dtype=target.dst.dtype), target.layer)
            self.bytes += sum(_nbytes(target.dst) for target in plan.targets)
            self.tensors += 1
            if item.parent is not None:
                self.layers.add(item.parent)
            started = time.perf_counter()
            if plan.whole:
                raw = plan.targets[0].dst.view(torch.uint8).numpy()
                sample = buffer_sample(item.entry.dtype, item.entry.shape, raw)
            else:
                sample = file_sample(reading.fd, reading.at, item.entry.dtype, item.entry.shape, item.entry.nbytes)
            stats.sample_s += time.perf_counter() - started
            stats.read_bytes += item.entry.nbytes
            samples[item.entry.name] = sample
            if reading.digest is not None:
                digests[item.entry.name] = reading.digest
            found[item.entry.name] = PlacedTensor(reading.nonfinite, sample, reading.digest, reading.mapped)
        return found

    def _fill(self, reading: _Reading, target: Target, begin: int, end: int, *, check: bool) -> tuple[float, float]:
        """Read bytes [BEGIN, END) of TARGET from the file, and flag NaN/Inf in them: (read s, check s)."""
        start = time.perf_counter()
        chunk = target.dst.view(torch.uint8)[begin:end].numpy()
        _read_fully(reading.fd, chunk, reading.at + target.copy.src_offset * target.dst.element_size() + begin,
                    reading.path)
        read = time.perf_counter()
        if check and bytes_hold_nonfinite(chunk, reading.item.entry.dtype):
            reading.nonfinite = True
        return read - start, time.perf_counter() - read

    def _hash(self, reading: _Reading) -> tuple[float, float]:
        """The digest of a tensor read whole into its one target (after its chunks): (0, hash s)."""
        start = time.perf_counter()
        hasher = TensorHasher(reading.item.entry.dtype, reading.item.entry.shape)
        raw = reading.plan.targets[0].dst.view(torch.uint8)
        for begin in range(0, raw.numel(), CHUNK_BYTES):
            hasher.update(raw[begin:begin + CHUNK_BYTES].numpy())
        reading.digest = hasher.hexdigest()
        return 0.0, time.perf_counter() - start

    def _where(self, item: PlannedTensor) -> tuple[int, int, str]:
        fd, data_start, path = self._open(item.entry.shard)
        return fd, data_start + item.entry.begin, path

    def to_place(self, batch: list[PlannedTensor], may_drop: bool, may_skip) -> set[str]:
        """The tensors of BATCH to read into place: none when the layer may be unchanged (it is hashed first).

        MAY_DROP: the layer could be skipped by its digest now; MAY_SKIP: the stream's samples test (None: any).
        """
        names = {item.entry.name for item in batch if item.entry.name in self.plans}
        if names and may_drop and (may_skip is None or may_skip(batch[0].parent, self.samples_of(batch))):
            return set()
        return names

    def samples_of(self, batch: list[PlannedTensor]) -> dict[str, str]:
        """The sample digests of BATCH's tensors, read from their files (a few windows each, nothing mapped)."""
        found = {}
        for item in batch:
            fd, data_start, _ = self._open(item.entry.shard)
            found[item.entry.name] = file_sample(fd, data_start + item.entry.begin, item.entry.dtype,
                                                 item.entry.shape, item.entry.nbytes)
        return found

    def nonfinite(self, item: PlannedTensor) -> NonFinite | None:
        """Count NaN and Inf in what was read into place for ITEM (after a flag said it may hold some)."""
        nan = inf = 0
        for target in self.plans[item.entry.name].targets:
            found_nan, found_inf = count_nonfinite(target.dst)
            nan, inf = nan + found_nan, inf + found_inf
        return NonFinite(item.entry.name, item.entry.shard, nan, inf) if nan or inf else None

    def _open(self, shard: str) -> tuple[int, int, str]:
        """SHARD opened once (only the reading thread opens; the other reads through the descriptor)."""
        found = self._files.get(shard)
        if found is None:
            found = self._files[shard] = open_shard(self._folder, shard)
        return found

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()


def open_shard(folder: Path, shard: str) -> tuple[int, int, str]:
    """SHARD of the checkpoint in FOLDER opened for reading: (descriptor, where its data section starts, path)."""
    path = str(shard_file(folder, shard, str(folder)))
    fd = os.open(path, os.O_RDONLY)
    (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    return fd, 8 + header_len, path


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _share(work, jobs: list, submit, stats, *, hashing: bool = False) -> None:
    """Run WORK on each of JOBS, taken from one queue by this thread and (with SUBMIT) by another.

    Each WORK returns (read s, check s), or with HASHING (0, hash s), for STATS. The first failure stops both and
    is raised once the other thread stopped too (nothing is written into the engine after this returns).
    """
    if not jobs:
        return
    queue = iter(jobs)
    lock = threading.Lock()
    failed = threading.Event()

    def drain() -> tuple[float, float]:
        spent = [0.0, 0.0]
        while not failed.is_set():
            with lock:
                job = next(queue, None)
            if job is None:
                break
            try:
                first, second = work(job)
            except BaseException:
                failed.set()
                raise
            spent[0] += first
            spent[1] += second
        return spent[0], spent[1]

    pending = submit(drain) if submit is not None and len(jobs) > 1 else None
    error = None
    spent = []
    try:
        spent.append(drain())
    except BaseException as exc:  # noqa: BLE001 - raised below, once the other thread stopped
        error = exc
    if pending is not None:
        try:
            spent.append(pending.result())
        except BaseException as exc:  # noqa: BLE001 - the first failure is raised
            error = error or exc
    if error is not None:
        raise error
    for first, second in spent:
        if hashing:
            stats.hash_s += second
        else:
            stats.read_s += first
            stats.check_s += second


def _read_fully(fd: int, chunk, offset: int, path: str) -> None:
    """Fill CHUNK (a writable buffer) from FD at OFFSET; a file that ends first is cut short."""
    view = memoryview(chunk).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise LayerwiseError(f"{path}: the file ends at byte {offset + done}, inside a tensor its header "
                                 "places there (cut short while it was read)")
        done += got

