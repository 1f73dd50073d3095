"""Staging tensors for a CUDA engine: host copies into pinned memory, the copy to the device, the handover."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

# Host copies into pinned memory are split into chunks of this size over a
# few threads: after start-up vLLM sets torch to one CPU thread on GPU
# workers, and one thread copying out of the page cache is slower than the
# device's copy engine.
_STAGING_CHUNK_BYTES = 64 << 20


def staging_threads() -> int:
    """Threads for host-side staging copies on CUDA: half the CPUs this process may use, 1 to 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


def copy_in_chunks(dst: torch.Tensor, src: torch.Tensor, pool: ThreadPoolExecutor | None,
                   chunk_bytes: int = _STAGING_CHUNK_BYTES) -> None:
    """`dst.copy_(src)` for two contiguous tensors of one dtype and shape, in byte ranges over POOL.

    torch releases the GIL inside `copy_`, so the chunks copy in parallel.
    """
    nbytes = src.numel() * src.element_size()
    if pool is None or nbytes <= chunk_bytes:
        dst.copy_(src)
        return
    flat_dst = dst.reshape(-1).view(torch.uint8)
    flat_src = src.reshape(-1).view(torch.uint8)

    def copy(start: int) -> None:
        flat_dst[start:start + chunk_bytes].copy_(flat_src[start:start + chunk_bytes])

    for future in [pool.submit(copy, start) for start in range(0, nbytes, chunk_bytes)]:
        future.result()


def to_device(host: torch.Tensor, device: torch.device | None, copy_stream) -> tuple[torch.Tensor, object]:
    """(HOST on DEVICE, the event its copy records on COPY_STREAM); unchanged with no event off CUDA."""
    if copy_stream is None:
        return host, None
    with torch.cuda.stream(copy_stream):
        # The caching host allocator keeps `pinned` from reuse until this copy is done.
        staged = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(copy_stream)
    return staged, event


def handed_over(tensor: torch.Tensor, event, device: torch.device | None) -> torch.Tensor:
    """TENSOR, safe to use on DEVICE's current stream once its copy (EVENT, if any) is done."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
        tensor.record_stream(torch.cuda.current_stream(device))
    return tensor
