"""layerwise: stream new weights into running vLLM engines in layer order."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
