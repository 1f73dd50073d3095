"""The private vLLM names the `layerwise` backend of vLLM's weight-transfer API relies on, declared as data.

Beside `vllm_symbols.py` (the reload's), with the same `PrivateSymbol`: `vllm_compat.PRIVATE` holds both, so
`scripts/check_vllm_release.py` checks these against every release too. Used by `server/weight_transfer/` (the
inference side), `writer/trainer_engine.py` (the trainer side) and `server/plugin.py` (the registration).
"""

from __future__ import annotations

import re

from layerwise_cli.vllm_symbols import PrivateSymbol

_WEIGHT_TRANSFER = "vllm.distributed.weight_transfer"
_WT_ENGINE_USED_BY = "server/weight_transfer/engine.py (LayerwiseWeightTransferEngine subclasses it)"
WEIGHT_TRANSFER_ENGINE = PrivateSymbol(
    f"{_WEIGHT_TRANSFER}.base", "WeightTransferEngine", "class",
    members=("init_info_cls", "update_info_cls", "supports_draft_weight_update", "parse_init_info",
             "parse_update_info", "init_transfer_engine", "start_weight_update", "finish_weight_update",
             "update_weights", "receive_weights", "shutdown", "model", "vllm_config"),
    used_by=_WT_ENGINE_USED_BY)
TRAINER_WEIGHT_TRANSFER_ENGINE = PrivateSymbol(
    f"{_WEIGHT_TRANSFER}.base", "TrainerWeightTransferEngine", "class",
    members=("init_info_cls", "trainer_init", "send_weights", "shutdown", "client", "source", "is_sender"),
    used_by="writer/trainer_engine.py (LayerwiseTrainerWeightTransferEngine subclasses it)")
TRAINER_INIT_INFO = PrivateSymbol(f"{_WEIGHT_TRANSFER}.base", "TrainerInitInfo", "class",
                                  members=("backend", "rank", "is_sender"),
                                  used_by="writer/trainer_engine.py (LayerwiseTrainerInitInfo subclasses it)")
WEIGHT_TRANSFER_FACTORY = PrivateSymbol(f"{_WEIGHT_TRANSFER}.factory", "WeightTransferEngineFactory", "class",
                                        members=("register_engine", "create_engine"),
                                        used_by="server/plugin.py (registers the `layerwise` backend)")
WEIGHT_TRANSFER_TRAINER_FACTORY = PrivateSymbol(f"{_WEIGHT_TRANSFER}.factory", "WeightTransferTrainerFactory",
                                                "class", members=("register_engine", "trainer_init"),
                                                used_by="server/plugin.py, writer/trainer_engine.py (register the "
                                                "`layerwise` trainer engine)")
WORKER_WEIGHT_TRANSFER = PrivateSymbol(
    "vllm.v1.worker.gpu_worker", "Worker", "class",
    members=("load_model", "model_runner", "weight_transfer_engine", "update_weights", "finish_weight_update"),
    used_by="vllm_compat.worker_building_engine (the worker whose load_model builds the engine, found on the "
            "call stack: the engine is handed only the model)")
VLLM_CONFIG_WEIGHT_TRANSFER = PrivateSymbol("vllm.config.vllm", "VllmConfig", "class",
                                            members=("weight_transfer_config",),
                                            used_by="server/weight_transfer/routes.py (is the backend layerwise?)")

PRIVATE: tuple[PrivateSymbol, ...] = tuple(value for value in dict(globals()).values()
                                           if isinstance(value, PrivateSymbol))

# How vLLM words a worker's failure that reaches an API route (the engine core's utility call, then the
# multiprocessing executor's: vllm/v1/engine/core.py `_invoke_utility_method`, vllm/v1/executor/multiproc_executor.py
# `collective_rpc`): peeled off, outermost first, to answer the route with the worker's own line.
ENGINE_FAILURE_WRAPPERS = (
    re.compile(r"^Call to \w+ method failed: (.*)$", re.DOTALL),
    re.compile(r"^Worker failed with error '(.*)', please check the stack trace above for the root cause$", re.DOTALL),
)
