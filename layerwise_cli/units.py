"""Parse and print byte sizes and durations."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse `512MiB`, `2GB`, `1.5G` or `1048576` into bytes.

    Args:
        text: a number with an optional unit (B, KB/MB/GB/TB in powers of 1000,
            K/M/G/T or KiB/MiB/GiB/TiB in powers of 1024).

    Returns:
        The size in bytes.

    Raises:
        ValueError: the text is not a size.
    """
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 512MiB, 2GB or 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human_bytes(n: int | float) -> str:
    """Format bytes in binary units: `1.50 GiB`."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    """Format seconds: `850 µs`, `12.3 ms`, `1.42 s`."""
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"
