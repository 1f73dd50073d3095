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
        moved_to: modules that hold the same name in later releases (vLLM moved it), tried in
            order after `module`, at run time and by the release check.
        since: the first release that has it (an older one lacks it: layerwise then keeps the
            behaviour vLLM had before it). None: every supported release has it.
        used_by: where layerwise uses it (for the reader of a failed check).
    """

    module: str
    name: str | None
    kind: str
    members: tuple[str, ...] = ()
    parameters: tuple[str, ...] | None = None
    nested: bool = False
    moved_to: tuple[str, ...] = ()
    since: str | None = None
    used_by: str = ""

    @property
    def modules(self) -> tuple[str, ...]:
        """Where to look for it, first to last."""
        return (self.module, *self.moved_to)

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


_RELOAD = "vllm.model_executor.model_loader.reload"

LAYERWISE_INFO = PrivateSymbol(f"{_RELOAD}.layerwise", "LAYERWISE_INFO", "attribute",
                               used_by="worker/probe.py, worker/reload.py, worker/verify.py")
LAYER_RELOADING_INFO = PrivateSymbol(
    f"{_RELOAD}.types", "LayerReloadingInfo", "class",
    members=("restore_metadata", "restore_device", "loaded_weights", "load_numel", "load_numel_total", "can_load",
             "kernel_tensors"),
    used_by="the values of LAYERWISE_INFO (worker/probe.py, worker/reload.py, worker/verify.py, worker/in_place.py)")
ONLINE_PROCESS_LOADER = PrivateSymbol(f"{_RELOAD}.layerwise", "online_process_loader", "function", nested=True,
                                      used_by="worker/verify.py (unwraps the buffering loader by its name)")
COPY_COUNTER = PrivateSymbol(f"{_RELOAD}.meta", "CopyCounter", "class", members=("copied_numel",),
                             used_by="worker/verify.py")
GET_LAYER_SIZE = PrivateSymbol(f"{_RELOAD}.utils", "get_layer_size", "function", parameters=("layer",),
                               used_by="worker/verify.py")
GET_LAYER_TENSORS = PrivateSymbol(f"{_RELOAD}.utils", "get_layer_tensors", "function", parameters=("layer",),
                                  used_by="worker/in_place.py (the tensors vLLM materializes for a layer)")
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
                                       parameters=("weight", "isa"), moved_to=("vllm._cpu_ops",),  # 0.34
                                       used_by="worker/cpu_fixups.py")
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
                             moved_to=("vllm.v1.worker.gpu.model_runner",),  # 0.34
                             used_by="worker/extension.py (worker.model_runner; the x86 CPU runner subclasses "
                             "it, 0.34's StandaloneCPUModelRunner elsewhere has the same members)")
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
                             used_by="worker/verify_quantized.py, worker/in_place.py (tensors vLLM's restore "
                             "leaves alone)")
MATERIALIZE_LAYER = PrivateSymbol(f"{_RELOAD}.layerwise", "materialize_layer", "function",
                                  parameters=("layer", "info"),
                                  used_by="worker/in_place.py (the name `_layerwise_process` calls, replaced "
                                  "during a layerwise reload)")
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
ENGINE_CORE_PAUSE = PrivateSymbol("vllm.v1.engine.core", "EngineCore", "class",
                                  members=("pause_scheduler", "resume_scheduler"),
                                  used_by="client/local.py (pauses an in-process engine, caches cleared, around a "
                                  "reload: vLLM 0.34's extensible KV cache lends its memory to the reload then)")
SERVER_MODULE = PrivateSymbol("vllm.entrypoints.openai.api_server", None, "module",
                              used_by="server/launch.py (run as __main__)")
# vLLM 0.34's second reload mode (`VLLM_RELOAD_MODE=direct`): no per-layer buffers, no LAYERWISE_INFO bookkeeping.
DIRECT_RELOAD_ENABLED = PrivateSymbol(f"{_RELOAD}.direct", "direct_reload_enabled", "function", parameters=(),
                                      since="0.34.0", used_by="worker/reload.py (refuses the direct mode)")
# vLLM 0.34 ends every reload by rerunning each module's own process_weights_after_loading.
FINALIZE_MODEL_WEIGHTS = PrivateSymbol("vllm.model_executor.model_loader.weight_utils", "finalize_model_weights",
                                       "function", parameters=("model",), since="0.34.0",
                                       used_by="worker/rerun_hooks.py (layers a skip would leave to those hooks)")
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
    # worker/in_place.py hands `_layerwise_process` views of the engine's tensors: it relies on vLLM calling
    # `materialize_layer` by its module-level name, loading into what it materialized and copying that back.
    CopiedRule("in-place materialization", f"{_RELOAD}.layerwise",
               ("_layerwise_process", "_copy_and_restore_kernel_tensors", "_place_kernel_tensors"),
               layerwise_site="worker/in_place.py"),
    CopiedRule("in-place materialization", f"{_RELOAD}.meta", ("materialize_layer", "materialize_meta_tensor"),
               layerwise_site="worker/in_place.py"),
)


@dataclass(frozen=True)
class ReviewedChange:
    """A release's definition of a copied rule that differs from the installed vLLM's, read and judged.

    `scripts/check_vllm_release.py` passes a changed definition only when this
    records exactly the release's text (its digest): a later edit fails again.

    Attributes:
        module: the vLLM module.
        definition: the top-level name in it.
        release: the first release reviewed with this text.
        digest: `check_vllm_release.definition_digest` of the release's definition (`removed`: it is gone).
        verdict: what changed and what layerwise does about it.
    """

    module: str
    definition: str
    release: str
    digest: str
    verdict: str


_LAYERWISE = f"{_RELOAD}.layerwise"
_FINALIZE_HOOKS = ("worker/reload.py runs no hook itself; the planner's completion rule is unchanged (when a "
                   "layer is processed, what it buffers)")

REVIEWED_CHANGES: tuple[ReviewedChange, ...] = (
    ReviewedChange("vllm.model_executor.model_loader.weight_utils", "safetensors_weights_iterator", "0.34.0",
                   "4fde37e5c749",
                   "adds shuffle_safetensors_files (off by default; --shuffle-safetensors-files): each rank reads "
                   "the shards in a rank-seeded random order. The default order the planner copies is unchanged; "
                   "inspect-order and the benchmark's vLLM variant model the default only"),
    ReviewedChange(_LAYERWISE, "__all__", "0.34.0", "12227efb2728", "exports max_layer_reload_bytes too"),
    ReviewedChange(_LAYERWISE, "max_layer_reload_bytes", "0.34.0", "4a6a5282b00e",
                   "new: the largest layer's checkpoint bytes, which GPUWorker.reload_weights needs free before it "
                   "reloads with an extensible KV cache (it lends the cache or refuses); not part of the rule"),
    ReviewedChange(_LAYERWISE, "initialize_layerwise_reload", "0.34.0", "0e0efde319f7",
                   "adds defer_processing (default False; only EPLB redistribution passes True): vLLM's reload "
                   "and layerwise's pass nothing, so the rule is unchanged"),
    ReviewedChange(_LAYERWISE, "make_online_process_loader", "0.34.0", "4ffc58360be0",
                   "with defer_processing a layer waits for finalize; off by default: the rule is unchanged"),
    ReviewedChange(_LAYERWISE, "finalize_layerwise_processing", "0.34.0", "dd66e8e423b0",
                   "the delayed-processing test drops 'load_numel > 0', which the branch above already "
                   "guarantees, and adds defer_processing: unchanged by default"),
    ReviewedChange(_LAYERWISE, "finalize_layerwise_reload", "0.34.0", "b4d5697808b4",
                   "then runs weight_utils.finalize_model_weights: every module's own process_weights_after_loading "
                   "(quantized layers' submodules excepted), on every reload, sent layers or not; "
                   + _FINALIZE_HOOKS),
    ReviewedChange(_LAYERWISE, "_finalize_attention_layer", "0.34.0", "e610a00d2737",
                   "no longer runs the attention layer's hook itself: finalize_model_weights runs it after every "
                   "other layer (as before: last)"),
    ReviewedChange(f"{_RELOAD}.types", "LayerReloadingInfo", "0.34.0", "0cedceeb8bc0",
                   "adds the defer_processing field (default False); the members layerwise reads are unchanged"),
    ReviewedChange(f"{_RELOAD}.meta", "materialize_meta_tensor", "0.34.0", "11ae1efddf88",
                   "zero-fills the materialized tensor: the same bytes are allocated, so the planner's buffer sizes "
                   "hold; padding a loader does not write is zero instead of uninitialized (worker/in_place.py "
                   "takes only layers with no such padding)"),
)


@dataclass(frozen=True)
class ReviewedHook:
    """A module-level `process_weights_after_loading` read and judged safe to rerun on weights not re-sent.

    `worker/rerun_hooks.py` lets a layer be skipped under vLLM 0.34's rerun of
    every module hook only if each hook in it is one of these (by module and
    qualified name); `scripts/check_vllm_release.py` fails when a release's
    text of one differs from the digest reviewed.
    """

    module: str
    qualname: str
    release: str
    digest: str
    verdict: str


IDEMPOTENT_HOOKS: tuple[ReviewedHook, ...] = (
    ReviewedHook("vllm.model_executor.layers.attention.attention", "Attention.process_weights_after_loading",
                 "0.34.0", "db62e92e1143", "the backend's own processing and default KV scales, from the layer's "
                 "config; vLLM 0.32 and 0.33 already reran it on every attention layer of a reload"),
    ReviewedHook("vllm.model_executor.layers.attention.mm_encoder_attention",
                 "MMEncoderAttention.process_weights_after_loading", "0.34.0", "ff51325d578b",
                 "fills FP8 scale buffers from the configured scale file, or nothing"),
    ReviewedHook("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner.process_weights_after_loading",
                 "0.34.0", "8e23916a02e8", "refills the fused router and shared-expert gate (_combined_gate_weight) "
                 "from the two gate weights, in place"),
)


def _load(symbol: PrivateSymbol) -> Any:
    """The object SYMBOL names, from the first of its modules that holds it (the last failure is raised)."""
    failure: Exception | None = None
    for name in symbol.modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise  # the module exists and an import inside it failed: not a move
            failure = exc
            continue
        if symbol.name is None:
            return module
        if hasattr(module, symbol.name):
            return getattr(module, symbol.name)
        failure = AttributeError(f"module {name!r} has no attribute {symbol.name!r}")
    raise failure


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


def get_layer_tensors(layer) -> dict:
    """LAYER's own parameters and buffers, as vLLM's reload lists them (the tensors it materializes)."""
    return _load(GET_LAYER_TENSORS)(layer)


def layer_ref_sentinel() -> object:
    """The object vLLM binds a layer's weight loaders to while the layer is on the meta device."""
    return _load(LAYER_REF_SENTINEL)


def reload_layerwise_module():
    """vLLM's `reload.layerwise` module, whose global `materialize_layer` its `_layerwise_process` calls."""
    _load(MATERIALIZE_LAYER)
    return _load(PrivateSymbol(MATERIALIZE_LAYER.module, None, "module"))


def skip_tensors() -> set[str]:
    """Tensor names vLLM's reload never moves to, or materializes from, the meta device."""
    return set(_load(SKIP_TENSORS))


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


def reload_mode() -> str:
    """The reload mode the installed vLLM runs in this process: `layerwise`, or `direct` (0.34's
    `VLLM_RELOAD_MODE=direct`). A vLLM before the direct mode always reloads layerwise."""
    try:
        enabled = _load(DIRECT_RELOAD_ENABLED)
    except ModuleNotFoundError:
        return "layerwise"
    return "direct" if enabled() else "layerwise"


def reruns_module_hooks() -> bool:
    """Whether the installed vLLM reruns every module's own `process_weights_after_loading` after a reload (0.34)."""
    try:
        _load(FINALIZE_MODEL_WEIGHTS)
    except (ModuleNotFoundError, AttributeError):
        return False
    return True


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


def pause_engine_core(llm) -> None:
    """Pause a `vllm.LLM`'s scheduler with its caches cleared, as vLLM asks before a weight update.

    Requests in flight are aborted (an offline `LLM` has none between calls).
    On vLLM 0.34 with its extensible KV cache (the CUDA default) this is what
    marks the cache reclaimable, so that the reload may borrow its memory.
    """
    _engine_core_call(llm, ENGINE_CORE_PAUSE.members[0], "abort", True)


def resume_engine_core(llm) -> None:
    """Resume what `pause_engine_core` paused."""
    _engine_core_call(llm, ENGINE_CORE_PAUSE.members[1])


def _engine_core_call(llm, method: str, *args) -> Any:
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):  # the engine core in its own process (SyncMPClient)
        return client.call_utility(method, *args)
    return getattr(client.engine_core, method)(*args)  # in this process (InprocClient)


SERVER_MODULE_NAME = SERVER_MODULE.module
RELOAD_LOGGER = LOGGER_RELOAD.module
INPLACE_LOGGER = LOGGER_INPLACE.module
KILL_TREE_LOGGER = LOGGER_KILL_TREE.module
SHUTDOWN_LOGGER = LOGGER_SHUTDOWN.module
ONLINE_PROCESS_LOADER_NAME = ONLINE_PROCESS_LOADER.name
