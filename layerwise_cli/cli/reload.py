"""`layerwise reload` (being built)."""

from __future__ import annotations

from ._output import handle_errors


@handle_errors
def reload_command() -> None:
    """Not built yet."""
    raise NotImplementedError("layerwise reload is not built yet")
