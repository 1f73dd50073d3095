"""`layerwise serve` (being built)."""

from __future__ import annotations

from ._output import handle_errors


@handle_errors
def serve_command() -> None:
    """Not built yet."""
    raise NotImplementedError("layerwise serve is not built yet")
