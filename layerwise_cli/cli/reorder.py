"""`layerwise reorder` (being built)."""

from __future__ import annotations

from ._output import handle_errors


@handle_errors
def reorder_command() -> None:
    """Not built yet."""
    raise NotImplementedError("layerwise reorder is not built yet")
