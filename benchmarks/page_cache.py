"""Drop files from the page cache and measure how much of them is cached, for cold reads (Linux)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

_PROT_READ = 1
_MAP_SHARED = 1


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_bytes(paths: list[Path]) -> int | None:
    """Bytes of PATHS in the page cache now (mincore over a fresh mapping), or None where that cannot be asked."""
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                total += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def flush(paths: list[Path]) -> None:
    """fsync each file: dirty pages cannot be dropped from the cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop(paths: list[Path]) -> str:
    """Drop PATHS' clean pages from the page cache; returns how (`fadvise`, or `fadvise+drop_caches` as root).

    `posix_fadvise(DONTNEED)` needs no privileges; where it leaves pages
    behind and this process is root, `/proc/sys/vm/drop_caches` (1: the page
    cache of the whole machine) is written too. A tmpfs keeps its pages
    either way: its pages are the files.
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = resident_bytes(paths)
    if left and os.geteuid() == 0:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "fadvise+drop_caches"
        except OSError:
            pass
    return "fadvise"


def filesystem_of(path: Path) -> str | None:
    """The filesystem type the mount holding PATH has (/proc/mounts, longest matching mount point)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = str(Path(path).resolve())
    best, kind = "", None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind
