"""The vLLM config context a worker's own loaders run under, for the reload and for what runs after it."""

from __future__ import annotations

import contextlib

from layerwise_cli import vllm_compat


def engine_config(worker):
    """The vLLM config context the worker's own reload runs under (quant methods and loaders may read it)."""
    config = getattr(worker, "vllm_config", None)
    if config is None:
        return contextlib.nullcontext()
    return vllm_compat.set_current_vllm_config(config)
