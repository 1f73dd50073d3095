"""Work around what vLLM's CPU backend leaves undone after an in-place reload."""

from __future__ import annotations

import torch

from layerwise_cli import vllm_compat

# The diagnostic switch (`LAYERWISE_NO_REPAIRS=1`) lives where the client reads it too.
from layerwise_cli.engine_defaults import NO_REPAIRS_ENV, repairs_disabled
from layerwise_cli.worker.repairs.derived_state import refresh_alias_buffers


def apply_repairs(model: torch.nn.Module, reloaded: set[str], *, derived=None, tensors_of=None,
                  enabled: bool = True, loaded_outside: set[str] = frozenset()) -> tuple[list[str], list[dict]]:
    """Repair what vLLM's reload leaves stale; one note per kind of repair, one entry per tensor refreshed.

    Every repair is found by a rule, never by architecture, and is a no-op
    where its condition does not hold: on a GPU nothing is repacked after
    loading, no module holds a CPU kernel handle and every alias buffer still
    shares its parameter's storage, so nothing is done there.

    Args:
        model: the engine's model.
        reloaded: names of the modules this reload processed.
        derived: the engine's alias buffers (`derived_state.derived_state_of`); None: not refreshed.
        tensors_of: parent layer -> SOURCE's `(name, tensor)` pairs of it (None if SOURCE lacks it),
            to recompute alias buffers from.
        enabled: False (or `LAYERWISE_NO_REPAIRS` set in the worker) leaves the engine as vLLM's
            reload leaves it: the diagnostic switch.
        loaded_outside: modules loaded after vLLM's reload with the model's own loader, which processes nothing
            (`put_back_layers`): their CPU kernels are rebuilt too.

    Returns:
        (notes for the reload report, `{"module", "tensor", "reason"}` per tensor refreshed).
    """
    if repairs_disabled() or not enabled:
        return [f"CPU repairs are off ({NO_REPAIRS_ENV} is set): derived kernels, alias buffers and MoE experts "
                "are left as vLLM's reload leaves them"], []
    notes: list[str] = []
    refreshed: list[dict] = []
    repacked = repack_cpu_moe_experts(model, reloaded)
    if repacked:
        notes.append(f"re-packed {len(repacked)} CPU MoE expert layer(s) after the reload "
                     "(vLLM's CPU backend skips this on weight updates)")
        reason = "CPU MoE experts are prepacked only when the kernel is built; vLLM skips it on a weight update"
        refreshed += [{"module": name, "tensor": param, "reason": reason}
                      for name in repacked for param in ("w13_weight", "w2_weight")]
    reprocessed, left_outside = rebuild_kernels(model, {name: "" for name in sorted(loaded_outside)})
    if reprocessed:
        notes.append(f"rebuilt the CPU kernel of {', '.join(sorted(reprocessed))}: loaded after vLLM's reload by "
                     "the model's own loader, which does not re-process a module")
        refreshed += [{"module": name, "tensor": "cpu_linear",
                       "reason": "its packed CPU kernel is built when a module is processed, and the model's own "
                                 "loader, which loaded it after vLLM's reload, processes nothing"}
                      for name in sorted(reprocessed)]
    rebuilt, left = rebuild_derived_kernels(model, reloaded, done=set(reprocessed))
    left.update(left_outside)
    if rebuilt:
        notes.append(f"rebuilt the CPU kernel of {', '.join(sorted(rebuilt))}: it shares its weight with "
                     f"{', '.join(sorted(set(rebuilt.values())))}, which this reload refilled, and vLLM does not "
                     "re-process a module that is not in the checkpoint (tied head)")
        refreshed += [{"module": name, "tensor": "cpu_linear",
                       "reason": f"its packed CPU kernel is built from the weight it shares with {origin}, "
                                 "and vLLM does not re-process a module the checkpoint does not name"}
                      for name, origin in sorted(rebuilt.items())]
    for name, why in sorted(left.items()):
        notes.append(f"{name} shares its weight with a reloaded module but could not be rebuilt ({why}); "
                     "--verify checks it")
    if derived is not None and tensors_of is not None:
        aliases = refresh_alias_buffers(model, derived, tensors_of)
        if aliases:
            notes.append(f"refreshed {len(aliases)} buffer(s) derived at load from a reloaded weight, which "
                         f"vLLM's reload leaves stale: {', '.join(a['module'] + '.' + a['tensor'] for a in aliases)}")
        refreshed += aliases
    for name, why in sorted((derived.unknown if derived is not None else {}).items()):
        notes.append(f"{name}: {why}; not refreshed (--verify reports it unchecked)")
    return notes, refreshed


def _storages(module: torch.nn.Module) -> dict[int, str]:
    """Storage pointer -> tensor name, for the module's own stored parameters and buffers."""
    out = {}
    for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
        if tensor is None or tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        out[tensor.untyped_storage().data_ptr()] = name
    return out


def derived_modules(model: torch.nn.Module, sources: set[str]) -> dict[str, str]:
    """Modules outside SOURCES whose own tensors share storage with a module in SOURCES.

    This is the whole class of modules whose weights are derived from another
    module's: a tied LM head (`lm_head.weight is embed_tokens.weight`), an
    embedding a multimodal wrapper or an MTP/draft head shares by tensor. A
    module shared as the same object (`self.embed_tokens = other.embed_tokens`)
    is one module, reached under its first name, and is never stale.

    Args:
        model: the engine's model.
        sources: names of the modules whose tensors are the originals (those a
            reload refilled, or those `--verify` checked against SOURCE).

    Returns:
        derived module name -> the name of the module it shares storage with.
    """
    modules = dict(model.named_modules())
    chosen = {id(modules[name]) for name in sources if name in modules}
    owner: dict[int, str] = {}
    for name in sources:
        if name in modules:
            for pointer in _storages(modules[name]):
                owner.setdefault(pointer, name)
    derived = {}
    for name, module in modules.items():
        if id(module) in chosen:
            continue
        shared = [owner[pointer] for pointer in _storages(module) if pointer in owner]
        if shared:
            derived[name] = shared[0]
    return derived


def rebuild_derived_kernels(model: torch.nn.Module, reloaded: set[str],
                            done: set[str] = frozenset()) -> tuple[dict[str, str], dict[str, str]]:
    """Redo the CPU processing of modules whose weight a reload refilled through another module.

    On CPU, `UnquantizedEmbeddingMethod.process_weights_after_loading` (which
    `ParallelLMHead` uses) builds a packed copy of the weight into a oneDNN or
    SGL kernel handle (`layer.cpu_linear`, `dispatch_cpu_unquantized_gemm`).
    vLLM processes a module during a reload only when the checkpoint fills it;
    a tied head is not in the checkpoint, so its storage (shared with
    `embed_tokens`) takes the new values while its kernel keeps packing the old
    ones, and the logits come from the old head. vLLM's own
    `reload_weights(weights_path=...)` has the same fault.

    The rule: every module not processed by this reload whose own tensors
    share storage with a module it processed, and that holds CPU kernel state
    (`cpu_linear`), is processed again by vLLM's own method, which on CPU
    only rebuilds that handle from the module's current weight. Parameters and
    their storage are not touched. Modules with another quant method are
    reported in `left`, not guessed at. Nothing else is done: without shared
    storage, or without a CPU kernel handle (GPU: the head multiplies by the
    shared weight itself), this is a no-op.

    Args:
        model: the engine's model.
        reloaded: names of the modules this reload processed.
        done: modules whose kernel was rebuilt already (`loaded_outside`).

    Returns:
        (rebuilt: module -> the reloaded module it shares with,
         left: module -> why it could not be rebuilt).
    """
    return rebuild_kernels(model, {name: origin for name, origin in derived_modules(model, reloaded).items()
                                   if name not in done})


def rebuild_kernels(model: torch.nn.Module, modules: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Process each of MODULES (name -> what it is rebuilt for) again with vLLM's own embedding method, on CPU.

    Only modules holding CPU kernel state (`cpu_linear`) are processed; the method only rebuilds that handle
    from the module's current weight, and their parameters stay where they are.

    Returns:
        (rebuilt: name -> what it was rebuilt for, left: name -> why it could not be rebuilt).
    """
    rebuilt, left = {}, {}
    for name, origin in modules.items():
        module = model.get_submodule(name)
        if getattr(module, "cpu_linear", None) is None:
            continue
        method = getattr(module, "quant_method", None)
        if not isinstance(method, vllm_compat.unquantized_embedding_method_class()):
            left[name] = f"quant method {type(method).__name__}"
            continue
        before = {key: tensor.untyped_storage().data_ptr()
                  for key, tensor in module.named_parameters(recurse=False)}
        method.process_weights_after_loading(module)
        after = {key: tensor.untyped_storage().data_ptr()
                 for key, tensor in module.named_parameters(recurse=False)}
        if before != after:
            raise RuntimeError(f"{name}: rebuilding its CPU kernel moved its parameters")
        rebuilt[name] = origin
    return rebuilt, left


def repack_cpu_moe_experts(model: torch.nn.Module, reloaded: set[str]) -> list[str]:
    """Redo the CPU prepack of unquantized MoE experts that this reload refilled.

    vLLM (0.32) prepacks unquantized CPU expert weights into its kernel's
    layout only when it first builds the MoE kernel
    (`UnquantizedFusedMoEMethod._setup_kernel` skips the kernel's
    `process_weights_after_loading` on a weight update). A reload therefore
    copies checkpoint-layout weights into the prepacked storage and the CPU
    kernel misreads them; vLLM's own `reload_weights` has the same fault. GPU
    backends reshuffle on every update and are not affected.

    Args:
        model: the engine's model.
        reloaded: names of the modules this reload processed; only these are
            repacked (repacking twice would scramble a layer).

    Returns:
        The names of the modules repacked, in place (storage pointers kept).
    """
    repacked = []
    for name, module in model.named_modules():
        if name not in reloaded:
            continue
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None:
            continue
        # Subclasses too: on AMX CPUs the kernel is `X86CPUUnquantizedExperts` (isa "amx").
        if not isinstance(experts, vllm_compat.cpu_unquantized_experts_class()) or getattr(experts, "_use_zentorch",
                                                                                          False):
            continue

        for param in ("w13_weight", "w2_weight"):
            tensor = getattr(module, param)
            packed = vllm_compat.cpu_prepack_moe_weight(tensor.data.clone(), experts.isa)
            if packed.shape != tensor.shape:
                raise RuntimeError(f"{name}.{param}: CPU MoE prepack changed the shape; cannot repack in place")
            tensor.data.copy_(packed)
        repacked.append(name)
    return repacked
