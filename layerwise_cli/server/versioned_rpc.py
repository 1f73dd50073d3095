"""A worker call, the prefix-cache reset and the weight version in one engine-core step.

vLLM's engine core runs a utility call between two scheduler steps. Setting
the weight version (`/update_weight_version`) and resetting the prefix cache
(`/reset_prefix_cache`) after a reload are utility calls of their own, so
without a pause (`--pause-mode none`) the engine can sample tokens between
them: tokens of the new weights under the old version's name, or a new
prompt served from KV blocks the old weights computed.

`layerwise serve`'s plugin gives the engine core one more utility method,
`CORE_METHOD`: it runs the worker call (vLLM's `collective_rpc`) and, when
every worker answered and none said it failed, resets the prefix cache if
asked and sets the version, all inside the same utility call. No step runs
between the weights and their name.

The answer also says how long the call held the engine core
(`"engine_s"`): no scheduler step runs during a utility call, so that is the
time the engine generated nothing for this reload, even where nothing paused
the server (`layerwise_engine_stall_seconds`).
"""

from __future__ import annotations

import time
from typing import Any

from layerwise_cli import vllm_compat

CORE_METHOD = "layerwise_rpc_then_version"


def workers_failed(results: list | None) -> bool:
    """Whether a worker call failed: no worker answered, or one answered `{"ok": false, ...}`.

    vLLM's own `reload_weights` answers None on every worker: not a failure.
    """
    return not results or any(isinstance(r, dict) and not r.get("ok", True) for r in results)


def rpc_then_version(engine_core, method: str, timeout: float | None, args: list, kwargs: dict,
                     version: str | None, reset_prefix_cache: bool) -> dict[str, Any]:
    """Run METHOD on every worker of ENGINE_CORE; if none failed, reset the prefix cache (RESET_PREFIX_CACHE)
    and name the weights VERSION (when given), with no scheduler step in between.

    Returns `{"results": [per worker], "previous": the version before, "versioned": whether VERSION was set,
    "prefix_cache_reset": whether the reset took (None: not asked, or the call failed), "engine_s": the seconds
    the call held the engine core}`.
    """
    start = time.perf_counter()
    results = getattr(engine_core, vllm_compat.ENGINE_CORE_COLLECTIVE_RPC)(method, timeout, tuple(args), kwargs)
    previous = getattr(engine_core, vllm_compat.ENGINE_CORE_GET_VERSION)()
    answer = {"results": results, "previous": previous, "versioned": False, "prefix_cache_reset": None}
    if not workers_failed(results):
        _name_weights(engine_core, answer, version, reset_prefix_cache)
    answer["engine_s"] = time.perf_counter() - start
    return answer


def _name_weights(engine_core, answer: dict[str, Any], version: str | None, reset_prefix_cache: bool) -> None:
    """After workers that all succeeded: reset the prefix cache if asked, and set VERSION (when given)."""
    if reset_prefix_cache:
        # Running requests are preempted and recompute their KV with the new weights (as the client's own reset).
        answer["prefix_cache_reset"] = bool(
            getattr(engine_core, vllm_compat.ENGINE_CORE_RESET_PREFIX_CACHE)(True))
    if version is not None:
        getattr(engine_core, vllm_compat.ENGINE_CORE_SET_VERSION)(version)
        answer["versioned"] = True


def _core_method(self, method, timeout, args, kwargs, version, reset_prefix_cache):
    return rpc_then_version(self, method, timeout, args, kwargs, version, reset_prefix_cache)


def add_to_engine_core() -> None:
    """Add `CORE_METHOD` to vLLM's engine core, where this process runs one (idempotent)."""
    vllm_compat.add_engine_core_method(CORE_METHOD, _core_method)
