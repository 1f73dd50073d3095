"""layerwise's vLLM plugin for servers: in any `vllm serve` where layerwise is installed, its endpoints too.

vLLM calls every `vllm.general_plugins` entry point in each of its processes
before it builds the server. In the API server process this adds, next to
vLLM's dev endpoints (`VLLM_SERVER_DEV_MODE=1`), what `layerwise serve` adds:
`/layerwise/engines_rpc` (per-engine answers, the version set with the reload)
and the pause lease (`server/pause_lease.py`). In every process it also
wraps vLLM's multiprocessing executor so that node 0 of an engine spread over
several nodes (its engine core) watches the other nodes and ends the engine,
naming the node, when one is gone (`server/follower_watch.py`); elsewhere
that wrapper does nothing. In the engine core's process it adds the utility method that runs a reload, resets
the prefix cache and sets the weight version in one engine-core step (`server/versioned_rpc.py`). And in every
process it registers the `layerwise` backend of vLLM's
weight-transfer API (`--weight-transfer-config '{"backend": "layerwise"}'`): its engine, built in each worker
(`server/weight_transfer/engine.py`), and its trainer-side engine (`writer/trainer_engine.py`), each imported
only when vLLM builds it.
"""

from __future__ import annotations

import sys

from layerwise_cli import WEIGHT_TRANSFER_BACKEND, vllm_compat
from layerwise_cli.server import versioned_rpc
from layerwise_cli.server.follower_watch import install

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def in_api_server() -> bool:
    """Whether this process runs vLLM's OpenAI server (as `vllm serve`, `python -m ...`, or `layerwise serve`)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return API_SERVER_MODULE in sys.modules or getattr(spec, "name", None) == API_SERVER_MODULE \
        or "vllm.entrypoints.cli.serve" in sys.modules


def register() -> None:
    """Register the weight-transfer backend; watch the other nodes from node 0's executor; give the engine core
    the versioned worker call (`server/versioned_rpc.py`); attach layerwise's endpoints in the API server
    (idempotent)."""
    _register_weight_transfer()
    _watch_other_nodes()
    versioned_rpc.add_to_engine_core()  # in the engine core's process: the reload and its version in one utility call
    if not in_api_server():
        return
    from layerwise_cli.server.engines_rpc import attach_engines_rpc  # noqa: PLC0415 - fastapi: only the API server loads it

    attach_engines_rpc()


def _register_weight_transfer() -> None:
    """Name `layerwise` in vLLM's weight-transfer registries (worker and trainer engines, imported when built)."""
    vllm_compat.register_weight_transfer(
        WEIGHT_TRANSFER_BACKEND, ("layerwise_cli.server.weight_transfer.engine", "LayerwiseWeightTransferEngine"),
        ("layerwise_cli.writer.trainer_engine", "LayerwiseTrainerWeightTransferEngine"))


def _watch_other_nodes() -> None:
    """Install the follower watch; a vLLM without the executor it wraps gets a one-line warning, never a failure."""
    try:
        install()
    except Exception as exc:  # noqa: BLE001 - a plugin must not stop vLLM from starting
        sys.stderr.write(f"Warning: layerwise: node 0 of a multi-node engine will not notice a lost node: {exc}\n")
