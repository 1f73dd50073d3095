"""layerwise's vLLM plugin for servers: in any `vllm serve` where layerwise is installed, its endpoints too.

vLLM calls every `vllm.general_plugins` entry point in each of its processes
before it builds the server. In the API server process this adds, next to
vLLM's dev endpoints (`VLLM_SERVER_DEV_MODE=1`), what `layerwise serve` adds:
`/layerwise/engines_rpc` (per-engine answers, the version set with the reload)
and the pause lease (`server/pause_lease.py`). In vLLM's other processes it
does nothing.
"""

from __future__ import annotations

import sys

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def in_api_server() -> bool:
    """Whether this process runs vLLM's OpenAI server (as `vllm serve`, `python -m ...`, or `layerwise serve`)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return API_SERVER_MODULE in sys.modules or getattr(spec, "name", None) == API_SERVER_MODULE \
        or "vllm.entrypoints.cli.serve" in sys.modules


def register() -> None:
    """Attach layerwise's endpoints where vLLM attaches its dev endpoints (idempotent; API server only)."""
    if not in_api_server():
        return
    from layerwise_cli.server.engines_rpc import attach_engines_rpc

    attach_engines_rpc()
