"""Turn tensors into raw safetensors bytes, one at a time, appended to a spill file with their digests."""

from __future__ import annotations

import os
from dataclasses import dataclass

from layerwise_cli.checkpoint.format.digests import TensorHasher
from layerwise_cli.checkpoint.format.dtypes import dtype_name
from layerwise_cli.checkpoint.format.finite import ByteScan
from layerwise_cli.errors import LayerwiseError

# Bytes moved per device-to-host copy and per write: what a CUDA tensor costs in host memory.
CHUNK_BYTES = 8 << 20
# Bytes per NaN/Inf check: numpy's temporaries are a few times this.
_SCAN_BYTES = 1 << 20


@dataclass(frozen=True)
class Spilled:
    """One tensor as it lies in the spill file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # where its bytes start in the spill file
    nbytes: int
    digest: str


def safetensors_dtype(name: str, tensor, where: str) -> str:
    """The safetensors dtype name of a torch tensor, refusing what a safetensors file cannot hold."""
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    if not isinstance(tensor, torch.Tensor):
        raise LayerwiseError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor", where=where)
    if tensor.layout != torch.strided:
        raise LayerwiseError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors can be written",
                             where=where)
    if tensor.device.type == "meta":
        raise LayerwiseError(f"tensor {name!r} is on the meta device and holds no data", where=where)
    dtype = dtype_name(tensor)
    if dtype is None:
        raise LayerwiseError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store",
                             where=where)
    return dtype


def _byte_chunks(tensor):
    """The tensor's raw bytes in order, as host memoryviews: the whole tensor at once when it is contiguous on
    the CPU (no copy), else CHUNK_BYTES at a time (a device tensor is copied to the host chunk by chunk)."""
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    flat = tensor.detach().reshape(-1)  # a copy only when the tensor is not contiguous (on its own device)
    if flat.numel() == 0:
        return
    if flat.device.type == "cpu":
        yield memoryview(flat.view(torch.uint8).numpy())
        return
    step = max(1, CHUNK_BYTES // flat.element_size())
    for start in range(0, flat.numel(), step):
        yield memoryview(flat[start:start + step].to("cpu").view(torch.uint8).numpy())


def write_all(fd: int, data, offset: int) -> None:
    """Write all of DATA at OFFSET (pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view[:CHUNK_BYTES], offset)
        view = view[n:]
        offset += n


class SpillFile:
    """An append-only file holding each tensor's raw bytes as it arrives, in arrival order."""

    def __init__(self, path: str | os.PathLike[str], where: str) -> None:
        self.path = os.fspath(path)
        self.where = where
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.size = 0

    def add(self, name: str, tensor, *, allow_nonfinite: bool) -> Spilled:
        """Check one tensor, append its bytes, and return where they are and their digest.

        Raises:
            LayerwiseError: the tensor is not a dense torch tensor of a
                safetensors dtype, or holds NaN or Inf (unless `allow_nonfinite`).
        """
        dtype = safetensors_dtype(name, tensor, self.where)
        shape = tuple(int(d) for d in tensor.shape)
        hasher = TensorHasher(dtype, shape)
        # NaN/Inf by bit patterns on the bytes as they pass (numpy), the test `reorder --verify` uses:
        # a bf16 sum in torch on the CPU is several times slower than the write itself.
        scan = None if allow_nonfinite else ByteScan(dtype)
        start = offset = self.size
        for chunk in _byte_chunks(tensor):
            if scan is not None:
                for begin in range(0, len(chunk), _SCAN_BYTES):
                    scan.update(chunk[begin:begin + _SCAN_BYTES])  # bounds numpy's temporaries
            hasher.update(chunk)
            write_all(self.fd, chunk, offset)
            offset += len(chunk)
        if scan is not None and scan.found:
            raise LayerwiseError(f"tensor {name!r} has {scan.nan} NaN and {scan.inf} Inf values; refusing to write "
                                 "it (pass allow_nonfinite=True to write it anyway)", where=self.where)
        expected = tensor.numel() * tensor.element_size()
        if offset - start != expected:  # pragma: no cover - a torch invariant
            raise LayerwiseError(f"tensor {name!r}: wrote {offset - start} bytes, expected {expected}",
                                 where=self.where)
        self.size = offset
        return Spilled(name, dtype, shape, start, offset - start, hasher.hexdigest())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def copy_range(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, count: int) -> None:
    """Copy COUNT bytes between files in the kernel (copy_file_range), else through an 8 MiB buffer."""
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < count:
                n = os.copy_file_range(src_fd, dst_fd, count - done, src_offset + done, dst_offset + done)
                if n == 0:
                    break
                done += n
        except OSError:
            pass  # filesystems or kernels without it: the buffered copy below takes over where it stopped
    buf = bytearray(min(CHUNK_BYTES, max(count - done, 1)))
    while done < count:
        view = memoryview(buf)[: min(len(buf), count - done)]
        got = os.preadv(src_fd, [view], src_offset + done)
        if got <= 0:
            raise OSError(f"spill file ended at byte {src_offset + done}")
        write_all(dst_fd, view[:got], dst_offset + done)
        done += got
