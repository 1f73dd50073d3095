"""Where layerwise keeps what it caches on disk (demo checkpoints, objects fetched from a store)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """layerwise's cache folder: `$LAYERWISE_CACHE` if set, else `$XDG_CACHE_HOME/layerwise`, else
    `~/.cache/layerwise`."""
    if root := os.environ.get("LAYERWISE_CACHE"):
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "layerwise"
