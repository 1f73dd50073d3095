"""`layerwise demo` (being built)."""

from __future__ import annotations

from ._output import handle_errors


@handle_errors
def demo_command() -> None:
    """Not built yet."""
    raise NotImplementedError("layerwise demo is not built yet")
