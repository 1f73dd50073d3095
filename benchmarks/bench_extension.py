"""Benchmark-only worker methods: the read limit, the engine's floor, a delta's write limit, vLLM's own reload.

`benchmarks/bench_reload.py` starts its engine with
`worker_extension_cls=BENCH_EXTENSION_CLS`; the product never loads this module.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.bench_patch_floor import patch_writes, write_all
from layerwise_cli.checkpoint.sources import open_checkpoint, resolve_local
from layerwise_cli.errors import describe_exception
from layerwise_cli.worker.extension import LayerwiseWorkerExtension
from layerwise_cli.worker.reload.probe import BufferProbe
from layerwise_cli.worker.stream.rank_plan import plan_for_worker
from layerwise_cli.worker.stream.shard_reader import ShardReader
from layerwise_cli.worker.stream.staging import copy_in_chunks, staging_threads

BENCH_EXTENSION_CLS = "benchmarks.bench_extension.BenchWorkerExtension"
# Set by `bench_reload --linear-fallback`: vLLM's CPU GEMM dispatch takes its `F.linear` fallback on the stored
# weight (as on an AVX2 CPU: no oneDNN, no SGL kernel), so the dense linear layers keep their loaded layout and
# load in place, as on a GPU. Applied when the worker imports this module, before it loads the model.
LINEAR_FALLBACK_ENV = "LAYERWISE_BENCH_LINEAR_FALLBACK"


if os.environ.get(LINEAR_FALLBACK_ENV):
    from tests.support.cpu_kernels import take_linear_fallback

    take_linear_fallback()


class BenchWorkerExtension(LayerwiseWorkerExtension):
    """The product's worker methods plus measurements that only a benchmark needs.

    Like the product's methods, each returns `{"ok": False, "error": ...}`
    rather than raising: an exception escaping a worker method shuts the
    engine down.
    """

    def layerwise_bench_info(self) -> dict:
        """This worker's device, threads and CPU affinity (main thread and a new thread)."""
        return _guard(lambda: _info(self))

    def layerwise_bench_read(self, source: str, order: str = "layer") -> dict:
        """(d) the read limit: every tensor read with safetensors into memory the process owns, nothing else.

        On CPU each tensor is copied out of the file mapping into an anonymous
        tensor (what "in memory" means once safetensors' lazy mmap views are
        touched); on CUDA it is staged in pinned host memory and copied to the
        device, as the stream does. Each tensor is dropped after it is read,
        so memory stays flat.
        """
        return _guard(lambda: _read(self, source, order))

    def layerwise_bench_floor(self, source: str, order: str = "layer") -> dict:
        """(e) the engine's floor: vLLM's layerwise reload fed from tensors already in memory.

        Every tensor is read first (untimed), then only
        `reload_weights(weights_iterator=...)` is timed: vLLM's own loading and
        processing, with no reading and no probe. On CUDA the tensors wait on
        the device. On CPU they are safetensors' views of the page cache with
        every page already mapped: nothing is left to read, and the engine
        copies from them faster than from anonymous copies of the same bytes
        (measured here: about 1.2 s against 1.6 to 2.6 s for 1 GiB), so this is
        the lower of the two floors.
        """
        return _guard(lambda: _floor(self, source, order))

    def layerwise_bench_patch_floor(self, source: str) -> dict:
        """(p) a sparse delta's write limit: its new values written at their positions, nothing else.

        Every patch of the delta at SOURCE is written, in file order on the
        engine's thread, into a copy of its base tensor on the engine's device
        (the copies, positions and values made beforehand, untimed): the
        writes alone, with no base check, no NaN/Inf check, no proof and no
        record (`bench_patch_floor`). However the delta is loaded, its writes
        take at least this long.
        """
        return _guard(lambda: _patch_floor(self, source))

    def layerwise_bench_vllm_peak(self, source: str) -> dict:
        """The peak buffered bytes of vLLM's own reload from a path.

        Builds the iterator exactly as `reload_weights(weights_path=...)` does
        (`get_model_loader(load_config).get_all_weights(model_config, model)`,
        after pointing `model_config` at the path, as vLLM does) and wraps it
        with the `BufferProbe`, so the order, the reading and the buffering
        are vLLM's own; only the measurement is added.
        """
        return _guard(lambda: _vllm_peak(self, source))

    def layerwise_bench_memory_mark(self) -> dict:
        """Reset the device's peak-allocated counter; return what is allocated now (None on CPU)."""
        return _guard(lambda: _memory(self, reset=True))

    def layerwise_bench_memory_peak(self) -> dict:
        """The device's peak allocated bytes since the last mark (None on CPU)."""
        return _guard(lambda: _memory(self, reset=False))

    def layerwise_bench_sync(self) -> dict:
        """Wait for the device's queued work (vLLM's own reload returns before its copies finish)."""
        return _guard(lambda: _sync(self))


def _guard(run) -> dict:
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - an exception here would take the engine down
        return {"ok": False, "error": str(describe_exception(exc)), "traceback": traceback.format_exc()}


def _sync(worker) -> dict:
    device = _device(worker)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"ok": True}


def _memory(worker, reset: bool) -> dict:
    device = _device(worker)
    if device.type != "cuda":
        return {"ok": True, "allocated": None, "peak_allocated": None}
    torch.cuda.synchronize(device)
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return {"ok": True, "allocated": torch.cuda.memory_allocated(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device)}


def _device(worker):
    model = worker.model_runner.get_model()
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def _info(worker) -> dict:
    seen: dict = {}

    def probe() -> None:
        seen["affinity"] = sorted(os.sched_getaffinity(0))

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    device = _device(worker)
    return {
        "ok": True,
        "pid": os.getpid(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "main_thread_affinity": sorted(os.sched_getaffinity(0)),
        "new_thread_affinity": seen.get("affinity"),
        "quantization": getattr(worker.model_runner.model_config, "quantization", None),
    }


def _engine_stream(worker, source: str, order: str):
    """The planned stream in engine names (as the reload streams it), and the checkpoint's folder."""
    model = worker.model_runner.get_model()
    model_config = worker.model_runner.model_config
    local = resolve_local(source)
    checkpoint = open_checkpoint(str(local))
    hf_config = model_config.hf_config.to_dict() if hasattr(model_config.hf_config, "to_dict") else None
    mine = plan_for_worker(checkpoint, model, hf_config)
    plan, vllm_names, engine_stream = mine.plan, mine.vllm_names, mine.engine_stream(order)
    folder = local if local.is_dir() else local.parent
    return folder, plan, vllm_names, engine_stream


class _Prefault:
    """Maps a tensor's file pages into the process now (`madvise(MADV_POPULATE_READ)`, Linux >= 5.14).

    safetensors' tensors view the file through mmap, and their pages are
    mapped on first touch. The floor wants nothing left to read, so it maps
    them before the clock starts. (Done in the stream's read-ahead thread
    instead, it made reloads slower on the 2-core benchmark machine, not
    faster, so the product does not.)
    """

    MADV_POPULATE_READ = 22

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            madvise.restype = ctypes.c_int
            self._madvise = madvise
        except (OSError, AttributeError):
            self._madvise = None

    def __call__(self, tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._madvise is None or nbytes == 0:
            return
        start = tensor.data_ptr() & ~(self._page - 1)
        if self._madvise(start, tensor.data_ptr() + nbytes - start, self.MADV_POPULATE_READ) != 0:
            # Not available here: touch one byte per page instead.
            int(tensor.reshape(-1).view(torch.uint8)[::self._page].sum())


class _Loader:
    """Reads tensors into memory the process owns: anonymous host memory, or the device via pinned staging.

    On CUDA this is the stream's own staging (pinned host buffers filled by a
    few threads, then an asynchronous copy), so that (d) measures what the
    stream's reading can do.
    """

    def __init__(self, folder: Path, device) -> None:
        self.prefault = _Prefault()
        self.device = device
        self.cuda = device.type == "cuda"
        self.reader = ShardReader(folder)
        self.pool = ThreadPoolExecutor(staging_threads()) if self.cuda else None
        self.copy_stream = torch.cuda.Stream(device=device) if self.cuda else None

    def load(self, item, *, mapped: bool = False):
        """The tensor in memory: an anonymous copy (or, with MAPPED, the prefaulted view) on CPU."""
        tensor = self.reader.read(item)
        if not self.cuda:
            if mapped:
                self.prefault(tensor)
                return tensor
            return torch.empty_like(tensor).copy_(tensor)
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        copy_in_chunks(pinned, tensor, self.pool)
        with torch.cuda.stream(self.copy_stream):
            return pinned.to(self.device, non_blocking=True)

    def finish(self) -> None:
        if self.cuda:
            self.copy_stream.synchronize()
            torch.cuda.synchronize(self.device)
            self.pool.shutdown(wait=True)
        self.reader.close()


def _read(worker, source: str, order: str) -> dict:
    folder, _plan, _, stream = _engine_stream(worker, source, order)
    device = _device(worker)
    loader = _Loader(folder, device)
    total = 0
    start = time.perf_counter()
    try:
        for item in stream:
            loader.load(item)
            total += item.entry.nbytes
    finally:
        loader.finish()
    return {"ok": True, "seconds": time.perf_counter() - start, "bytes": total, "tensors": len(stream),
            "order": order, "device": str(device)}


def _floor(worker, source: str, order: str) -> dict:
    folder, _plan, _, stream = _engine_stream(worker, source, order)
    device = _device(worker)
    cuda = device.type == "cuda"
    loader = _Loader(folder, device)
    try:
        # Mapped page-cache views (CPU) or device tensors (CUDA): nothing left to read.
        weights = [(item.entry.name, loader.load(item, mapped=True)) for item in stream]
    finally:
        loader.finish()
    total = sum(t.numel() * t.element_size() for _, t in weights)

    def handover() -> Iterator:
        # Pop as we go, so that a layer's tensors are freed once vLLM has taken them.
        while weights:
            yield weights.pop(0)

    start = time.perf_counter()
    worker.reload_weights(weights_iterator=handover(), is_checkpoint_format=True)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    weights.clear()  # whatever vLLM did not take
    gc.collect()
    return {"ok": True, "seconds": seconds, "bytes": total, "tensors": len(stream), "order": order,
            "device": str(device)}


def _patch_floor(worker, source: str) -> dict:
    writes = patch_writes(source, _device(worker))
    seconds = write_all(writes)
    written = sum(write.values.numel() * write.values.element_size() for write in writes)
    tensors = len(writes)
    writes.clear()
    gc.collect()
    return {"ok": True, "seconds": seconds, "bytes": written, "tensors": tensors}


def _vllm_peak(worker, source: str) -> dict:
    from vllm.model_executor.model_loader import get_model_loader  # noqa: PLC0415 - vllm: heavy (`--help` stays fast)

    _folder, plan, vllm_names, _ = _engine_stream(worker, source, "file")
    model = worker.model_runner.get_model()
    model_config = worker.model_runner.model_config
    # What `reload_weights(weights_path=...)` does before it builds its iterator.
    model_config.model = str(Path(source))
    model_config.model_weights = ""
    model_config.revision = None
    weights = get_model_loader(worker.vllm_config.load_config).get_all_weights(model_config, model)
    probe = BufferProbe(model)
    order: list[str] = []

    def probed() -> Iterator:
        for name, tensor in weights:
            order.append(name)
            probe.before_handover(name, vllm_names.get(name), tensor.numel() * tensor.element_size())
            yield name, tensor
        probe.finish()

    start = time.perf_counter()
    worker.reload_weights(weights_iterator=probed(), is_checkpoint_format=True)
    device = _device(worker)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    planned = [item.entry.name for item in plan.file_order]
    return {
        "ok": True,
        "seconds": time.perf_counter() - start,
        "peak_buffer_bytes": probe.peak,
        "peak_tensor": probe.peak_tensor,
        "largest_layer_bytes": plan.largest_layer_bytes,
        "unexpected": probe.unexpected,
        # vLLM's read order, checked against the planner's file order.
        "order_matches_plan": order == planned,
        "tensors": len(order),
    }
