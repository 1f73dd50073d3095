"""This machine's CPU feature flags (Linux `/proc/cpuinfo`), for behaviour of vLLM that depends on them."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags (`avx2`, `avx512f`, `amx_tile`, ...); empty where /proc/cpuinfo cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())
