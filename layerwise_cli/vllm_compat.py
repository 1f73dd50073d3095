"""Every private vLLM symbol layerwise touches, behind one door: a vLLM upgrade is this file to read.

The line between public and private: the names the top-level `vllm` package
exports (`vllm.LLM`, `vllm.SamplingParams`) and the documented command line
(`python -m vllm.entrypoints.openai.api_server`, its flags and HTTP
endpoints) are vLLM's public API; code may import them where it uses them.
Everything else under `vllm.` (module paths, classes, functions, module
globals, attributes layerwise reads on vLLM objects) is private: it is
declared here, as data (`PRIVATE`), and imported here, lazily (importing this
module imports no vLLM and no torch; `--help` stays instant).
`scripts/check_imports.py` refuses a `vllm.` import anywhere else in the
package but a public one, and `scripts/check_vllm_release.py` reads `PRIVATE`
and `COPIED_RULES` and checks each entry against the source of vLLM's newest
release, without installing it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

# The names of the top-level `vllm` package that code outside this file may import
# (`from vllm import LLM`); scripts/check_imports.py reads this tuple.
PUBLIC_NAMES = ("LLM", "SamplingParams")


@dataclass(frozen=True)
class PrivateSymbol:
    """A private vLLM name layerwise uses, and what it relies on about it.

    Attributes:
        module: the dotted module path.
        name: the name in that module (None: the module itself).
        kind: `module`, `class`, `function` (a module-level def, or a def
            nested anywhere in the module when `nested`), or `attribute`
            (a module-level assignment).
        members: for a class, the attributes and methods layerwise reads on
            it or its instances (class body, `self.X = ...` in a method, or a base).
        parameters: for a function, the parameter names layerwise passes, in order.
        nested: a function defined inside another (checked by its name anywhere in the module).
        used_by: where layerwise uses it (for the reader of a failed check).
    """

    module: str
    name: str | None
    kind: str
    members: tuple[str, ...] = ()
    parameters: tuple[str, ...] | None = None
    nested: bool = False
    used_by: str = ""

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


_RELOAD = "vllm.model_executor.model_loader.reload"

LAYERWISE_INFO = PrivateSymbol(f"{_RELOAD}.layerwise", "LAYERWISE_INFO", "attribute",
                               used_by="worker/probe.py, worker/reload.py, worker/verify.py")
LAYER_RELOADING_INFO = PrivateSymbol(
    f"{_RELOAD}.types", "LayerReloadingInfo", "class",
    members=("restore_metadata", "restore_device", "loaded_weights", "load_numel", "load_numel_total", "can_load"),
    used_by="the values of LAYERWISE_INFO (worker/probe.py, worker/reload.py, worker/verify.py)")
ONLINE_PROCESS_LOADER = PrivateSymbol(f"{_RELOAD}.layerwise", "online_process_loader", "function", nested=True,
                                      used_by="worker/verify.py (unwraps the buffering loader by its name)")
COPY_COUNTER = PrivateSymbol(f"{_RELOAD}.meta", "CopyCounter", "class", members=("copied_numel",),
                             used_by="worker/verify.py")
GET_LAYER_SIZE = PrivateSymbol(f"{_RELOAD}.utils", "get_layer_size", "function", parameters=("layer",),
                               used_by="worker/verify.py")
LAYER_REF_SENTINEL = PrivateSymbol(f"{_RELOAD}.sanitize", "layer_ref_sentinel", "attribute",
                                   used_by="worker/verify.py")
IS_DEFERRED_ATTENTION_LAYER = PrivateSymbol("vllm.model_executor.layers.attention", "is_deferred_attention_layer",
                                            "function", parameters=("layer",), used_by="worker/verify.py")
VOCAB_PARALLEL_EMBEDDING = PrivateSymbol("vllm.model_executor.layers.vocab_parallel_embedding",
                                         "VocabParallelEmbedding", "class", used_by="worker/verify.py")
UNQUANTIZED_EMBEDDING_METHOD = PrivateSymbol(
    "vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod", "class",
    members=("process_weights_after_loading",), used_by="worker/cpu_fixups.py (the tied LM head's CPU kernel)")
QUANTIZE_METHOD_BASE = PrivateSymbol("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase",
                                     "class", members=("process_weights_after_loading", "apply"),
                                     used_by="worker/verify.py, worker/fingerprints.py")
QUANTIZATION_METHODS = PrivateSymbol("vllm.model_executor.layers.quantization", "QUANTIZATION_METHODS", "attribute",
                                     used_by="cli/_options.py (--quantization)")
LINEAR_BASE = PrivateSymbol("vllm.model_executor.layers.linear", "LinearBase", "class",
                            used_by="worker/fingerprints.py")
CPU_LINEAR_HANDLE = PrivateSymbol("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", "function",
                                  parameters=("layer",),
                                  used_by="worker/cpu_fixups.py, worker/fingerprints.py, worker/verify.py "
                                  "(the `cpu_linear` handle it sets on a layer)")
CPU_UNQUANTIZED_EXPERTS = PrivateSymbol("vllm.model_executor.layers.fused_moe.experts.cpu_moe",
                                        "CPUUnquantizedExperts", "class", members=("isa", "_use_zentorch"),
                                        used_by="worker/cpu_fixups.py (CPU MoE repack)")
CPU_PREPACK_MOE_WEIGHT = PrivateSymbol("vllm._custom_ops", "cpu_prepack_moe_weight", "function",
                                       parameters=("weight", "isa"), used_by="worker/cpu_fixups.py")
PARALLEL_STATE = PrivateSymbol("vllm.distributed.parallel_state", None, "module",
                               used_by="worker/consensus.py, worker/rank_plan.py")
GET_TP_GROUP = PrivateSymbol("vllm.distributed.parallel_state", "get_tp_group", "function", parameters=(),
                             used_by="worker/consensus.py, worker/rank_plan.py")
GET_PP_GROUP = PrivateSymbol("vllm.distributed.parallel_state", "get_pp_group", "function", parameters=(),
                             used_by="worker/consensus.py, worker/rank_plan.py")
GROUP_COORDINATOR = PrivateSymbol("vllm.distributed.parallel_state", "GroupCoordinator", "class",
                                  members=("rank_in_group", "world_size", "cpu_group"),
                                  used_by="worker/consensus.py, worker/rank_plan.py")
SET_CURRENT_VLLM_CONFIG = PrivateSymbol("vllm.config", "set_current_vllm_config", "function",
                                        parameters=("vllm_config",), used_by="worker/extension.py")
MODEL_RUNNER = PrivateSymbol("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "class",
                             members=("get_model", "model_config", "vllm_config"),
                             used_by="worker/extension.py (worker.model_runner; the CPU runner subclasses it)")
MODEL_REGISTRY = PrivateSymbol("vllm.model_executor.models", "ModelRegistry", "attribute",
                               used_by="planning/vllm_mapping.py")
MODEL_REGISTRY_CLASS = PrivateSymbol("vllm.model_executor.models.registry", "_ModelRegistry", "class",
                                     members=("_try_load_model_cls",), used_by="planning/vllm_mapping.py")
MIXTURE_OF_EXPERTS = PrivateSymbol("vllm.model_executor.models.interfaces", "MixtureOfExperts", "class",
                                   used_by="planning/vllm_mapping.py")
# Online quantization (worker/online_quant.py subclasses these, so it loads them when it is imported).
LINEAR_METHOD_BASE = PrivateSymbol("vllm.model_executor.layers.linear", "LinearMethodBase", "class",
                                   members=("create_weights", "apply", "process_weights_after_loading"),
                                   used_by="worker/online_quant.py (base of LayerwiseOnlineLinearMethod)")
QUANTIZATION_CONFIG = PrivateSymbol("vllm.model_executor.layers.quantization.base_config", "QuantizationConfig",
                                    "class", members=("get_name", "get_supported_act_dtypes", "get_min_capability",
                                                      "get_config_filenames", "from_config", "get_quant_method"),
                                    used_by="worker/online_quant.py (base of the layerwise_fp8/int8 configs)")
REGISTER_QUANTIZATION_CONFIG = PrivateSymbol("vllm.model_executor.layers.quantization",
                                             "register_quantization_config", "function",
                                             parameters=("quantization",), used_by="worker/online_quant.py")
INITIALIZE_ONLINE_PROCESSING = PrivateSymbol(f"{_RELOAD}.layerwise", "initialize_online_processing", "function",
                                             parameters=("layer",),
                                             used_by="worker/online_quant.py (create_weights, as vLLM's own)")
MODEL_WEIGHT_PARAMETER = PrivateSymbol("vllm.model_executor.parameter", "ModelWeightParameter", "class",
                                       used_by="worker/online_quant.py (the weight on meta)")
REPLACE_PARAMETER = PrivateSymbol("vllm.model_executor.utils", "replace_parameter", "function",
                                  parameters=("layer", "param_name"),
                                  used_by="worker/online_quant.py (quantized weight and scale)")
SKIP_TENSORS = PrivateSymbol(f"{_RELOAD}.meta", "SKIP_TENSORS", "attribute",
                             used_by="worker/verify_quantized.py (tensors vLLM's restore leaves alone)")
AUTO_WEIGHTS_LOADER = PrivateSymbol("vllm.model_executor.models.utils", "AutoWeightsLoader", "class",
                                    members=("REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER",),
                                    used_by="planning/skip_rules.py (the rotary buffers vLLM's loader drops)")
GET_SPEC_LAYER_IDX = PrivateSymbol("vllm.model_executor.models.utils", "get_spec_layer_idx_from_weight_name",
                                   "function", parameters=("config", "weight_name"),
                                   used_by="planning/skip_rules.py (MTP/nextn layers vLLM skips without a draft)")
AUTHENTICATION_MIDDLEWARE = PrivateSymbol("vllm.entrypoints.serve.middleware.authenticate",
                                          "AuthenticationMiddleware", "class", members=("app", "verify_token"),
                                          used_by="server/launch.py (replaced so the API key covers every path)")
ATTACH_DEV_ROUTER = PrivateSymbol("vllm.entrypoints.serve.dev.rpc.api_router", "attach_router", "function",
                                  parameters=("app",), used_by="server/engines_rpc.py (wrapped)")
CALL_UTILITY_ALL_ASYNC = PrivateSymbol("vllm.v1.engine.core_client", "AsyncMPClient", "class",
                                       members=("call_utility_all_async",),
                                       used_by="server/engines_rpc.py (engine_client.engine_core)")
ENGINE_CORE_SHUTDOWN = PrivateSymbol("vllm.v1.engine.core_client", "SyncMPClient", "class", members=("shutdown",),
                                     used_by="client/local.py stop_engine (llm.llm_engine.engine_core)")
SERVER_MODULE = PrivateSymbol("vllm.entrypoints.openai.api_server", None, "module",
                              used_by="server/launch.py (run as __main__)")
LOGGER_RELOAD = PrivateSymbol(f"{_RELOAD}.layerwise", None, "module", used_by="vllm_logs.py (logger name)")
LOGGER_INPLACE = PrivateSymbol(f"{_RELOAD}.inplace", None, "module", used_by="vllm_logs.py (logger name)")
LOGGER_SHUTDOWN = PrivateSymbol("vllm.v1.utils", None, "module", used_by="vllm_logs.py (logger name)")
LOGGER_KILL_TREE = PrivateSymbol("vllm.utils.system_utils", None, "module", used_by="vllm_logs.py (logger name)")

PRIVATE: tuple[PrivateSymbol, ...] = tuple(value for value in dict(globals()).values()
                                           if isinstance(value, PrivateSymbol))


@dataclass(frozen=True)
class CopiedRule:
    """A rule layerwise's planner copies from vLLM: the vLLM code it follows, compared release against release.

    Attributes:
        name: what the rule decides.
        module: the vLLM module holding it.
        definitions: top-level functions, classes or assignments that make the
            rule (empty: every top-level definition of `module`).
        constant: an assignment whose literal value must equal `copied_value`.
        copied_value: (layerwise module, name) holding layerwise's copy of `constant`.
        layerwise_site: where layerwise copies it.
    """

    name: str
    module: str
    definitions: tuple[str, ...] = ()
    constant: str | None = None
    copied_value: tuple[str, str] | None = None
    layerwise_site: str = ""


COPIED_RULES: tuple[CopiedRule, ...] = (
    CopiedRule("read order", "vllm.model_executor.model_loader.weight_utils",
               ("_natural_sort_key", "safetensors_weights_iterator"),
               layerwise_site="planning/plan.py vllm_read_order"),
    CopiedRule("vocabulary padding", "vllm.model_executor.layers.vocab_parallel_embedding",
               ("pad_vocab_size", "DEFAULT_VOCAB_PADDING_SIZE"), constant="DEFAULT_VOCAB_PADDING_SIZE",
               copied_value=("layerwise_cli.planning.completion", "VOCAB_PADDING"),
               layerwise_site="planning/completion.py VOCAB_PADDING"),
    *(CopiedRule("completion rule", f"{_RELOAD}.{name}", layerwise_site="planning/completion.py")
      for name in ("layerwise", "types", "utils", "meta", "sanitize")),
)


def _load(symbol: PrivateSymbol) -> Any:
    module = importlib.import_module(symbol.module)
    return module if symbol.name is None else getattr(module, symbol.name)


# Accessors: each imports its symbol on first call (never at import time).

def layerwise_info():
    """vLLM's per-module reload bookkeeping: `WeakKeyDictionary[module, LayerReloadingInfo]`."""
    return _load(LAYERWISE_INFO)


def copy_counter_class() -> type:
    """The dispatch mode that counts the elements weight loaders copy (`.copied_numel`)."""
    return _load(COPY_COUNTER)


def get_layer_size(layer) -> int:
    """The elements vLLM waits for before it processes LAYER (its completion threshold)."""
    return _load(GET_LAYER_SIZE)(layer)


def is_deferred_attention_layer(layer) -> bool:
    """Whether vLLM processes LAYER with the whole model at the end of a reload, not alone."""
    return _load(IS_DEFERRED_ATTENTION_LAYER)(layer)


def layer_ref_sentinel() -> object:
    """The object vLLM binds a layer's weight loaders to while the layer is on the meta device."""
    return _load(LAYER_REF_SENTINEL)


def vocab_parallel_embedding_class() -> type:
    return _load(VOCAB_PARALLEL_EMBEDDING)


def unquantized_embedding_method_class() -> type:
    return _load(UNQUANTIZED_EMBEDDING_METHOD)


def quantize_method_base_class() -> type:
    return _load(QUANTIZE_METHOD_BASE)


def quantization_methods() -> list[str]:
    """The `quantization` methods the installed vLLM knows."""
    return list(_load(QUANTIZATION_METHODS))


def linear_base_class() -> type:
    return _load(LINEAR_BASE)


def cpu_unquantized_experts_class() -> type:
    return _load(CPU_UNQUANTIZED_EXPERTS)


def cpu_prepack_moe_weight(weight, isa: str):
    """vLLM's CPU prepack of MoE expert weights into its kernel's layout."""
    return _load(CPU_PREPACK_MOE_WEIGHT)(weight, isa)


def parallel_state():
    """`vllm.distributed.parallel_state` (`get_tp_group`, `get_pp_group`)."""
    return _load(PARALLEL_STATE)


def set_current_vllm_config(config):
    """The context manager vLLM runs weight loading under (quant methods read the config from it)."""
    return _load(SET_CURRENT_VLLM_CONFIG)(config)


def model_class_for(architecture: str) -> type | None:
    """vLLM's model class for ARCHITECTURE, or None (no public lookup stops short of building a model config)."""
    return _load(MODEL_REGISTRY)._try_load_model_cls(architecture)


def load(symbol: PrivateSymbol) -> Any:
    """The object SYMBOL names, imported now (for the few modules that subclass vLLM's classes at import time)."""
    return _load(symbol)


def auto_weights_loader_class() -> type:
    return _load(AUTO_WEIGHTS_LOADER)


def spec_layer_index_function():
    """vLLM's `get_spec_layer_idx_from_weight_name(config, weight_name)`: the MTP layer a name belongs to, or None."""
    return _load(GET_SPEC_LAYER_IDX)


def mixture_of_experts_class() -> type:
    return _load(MIXTURE_OF_EXPERTS)


def authenticate_module():
    """The module whose `AuthenticationMiddleware` vLLM's server imports when it adds the API-key check."""
    return _load(PrivateSymbol(AUTHENTICATION_MIDDLEWARE.module, None, "module"))


def dev_rpc_router_module():
    """The module whose `attach_router(app)` adds vLLM's `/collective_rpc` (dev mode only)."""
    return _load(PrivateSymbol(ATTACH_DEV_ROUTER.module, None, "module"))


def call_utility_all_async(engine_client):
    """The server's engine client's call to every data-parallel engine, or None (a client of one engine)."""
    return getattr(getattr(engine_client, "engine_core", None), CALL_UTILITY_ALL_ASYNC.members[0], None)


def shutdown_engine_core(llm) -> None:
    """Stop a `vllm.LLM`'s engine processes now."""
    getattr(llm.llm_engine.engine_core, ENGINE_CORE_SHUTDOWN.members[0])()


SERVER_MODULE_NAME = SERVER_MODULE.module
RELOAD_LOGGER = LOGGER_RELOAD.module
INPLACE_LOGGER = LOGGER_INPLACE.module
KILL_TREE_LOGGER = LOGGER_KILL_TREE.module
SHUTDOWN_LOGGER = LOGGER_SHUTDOWN.module
ONLINE_PROCESS_LOADER_NAME = ONLINE_PROCESS_LOADER.name
