"""Buffers an engine derives from checkpoint weights at load (views), and their refresh after a reload."""

from __future__ import annotations

from dataclasses import dataclass, field

from layerwise_cli import vllm_compat
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.worker.repairs.scratch import load_alone, scratch_copy
from layerwise_cli.worker.state.worker_state import kept_on


@dataclass(frozen=True)
class AliasBuffer:
    """A non-persistent buffer that was a view of a checkpoint-loaded parameter when the engine loaded.

    Attributes:
        module: the module that owns the buffer (`model.layers.0.mixer`).
        buffer: its name on that module (`conv_weights`).
        source: the module whose parameter it viewed (`model.layers.0.mixer.conv1d`).
        parameter: that parameter's name on `source` (`weight`).
        live: the buffer still shares the parameter's storage. vLLM's reload
            copies new values into that storage, so the buffer follows (GPU:
            nothing repacks there). False: processing after the load moved the
            parameter to a new storage (CPU: `dispatch_cpu_unquantized_gemm`
            prepacks conv weights), the buffer kept the load-time storage, and
            no reload writes it: layerwise refreshes it (`refresh_alias_buffers`).
    """

    module: str
    buffer: str
    source: str
    parameter: str
    live: bool

    @property
    def name(self) -> str:
        return f"{self.module}.{self.buffer}"


@dataclass(frozen=True)
class DerivedState:
    """Every alias buffer of one engine, found once (`derived_state_of`)."""

    aliases: tuple[AliasBuffer, ...] = ()
    # Buffers vLLM left out of its reload record that alias no parameter, and whose source is
    # ambiguous or absent: name -> why. Nothing refreshes them; `--verify` reports them unchecked.
    unknown: dict[str, str] = field(default_factory=dict)

    def stale_after_reload(self) -> list[AliasBuffer]:
        """The aliases vLLM's reload leaves as they were (their storage is no parameter's any more)."""
        return [alias for alias in self.aliases if not alias.live]

    def on_module(self, module: str) -> frozenset[str]:
        """Names of the derived buffers (aliases and unknown) that MODULE owns."""
        names = {alias.buffer for alias in self.aliases if alias.module == module}
        names |= {name.rpartition(".")[2] for name in self.unknown if name.rpartition(".")[0] == module}
        return frozenset(names)


def _pointer(tensor) -> int | None:
    try:
        if tensor is None or tensor.device.type == "meta" or tensor.numel() == 0:
            return None
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, ValueError):
        return None


def find_derived_state(model) -> DerivedState:
    """Find every non-persistent buffer that was a view of a parameter when the engine loaded.

    The rule is vLLM's own: when it records a model for reloading
    (`reload/meta.py`, `capture_layer_to_meta`), it leaves out of the record
    every non-persistent buffer whose storage is a parameter's of the module
    or a module below it, and never rebuilds such a buffer; it keeps the
    buffer object as it was. So a buffer present on the engine but absent from
    vLLM's record was derived at load. If it still shares a parameter's
    storage, vLLM's in-place copy keeps it current. If not, its source is the
    one parameter below its module, in checkpoint format, whose bytes fill the
    buffer's storage exactly (same dtype, same size); none or several: unknown.

    Call it when no reload is running (vLLM's record and the live tensors are
    then both in place).

    Args:
        model: the engine's model.

    Returns:
        The aliases found, and the buffers whose source could not be told.
    """
    LAYERWISE_INFO = vllm_compat.layerwise_info()
    SKIP_TENSORS = vllm_compat.load(vllm_compat.SKIP_TENSORS)

    modules = dict(model.named_modules())
    aliases: list[AliasBuffer] = []
    unknown: dict[str, str] = {}
    for name, module in modules.items():
        info = LAYERWISE_INFO.get(module)
        if info is None or not module._buffers:
            continue
        recorded_buffers = info.restore_metadata[1]
        for key, buffer in module._buffers.items():
            if (key in recorded_buffers or key in SKIP_TENSORS or key not in module._non_persistent_buffers_set
                    or (pointer := _pointer(buffer)) is None):
                continue
            prefix = f"{name}." if name else ""
            below = {sub: child for sub, child in modules.items() if sub == name or sub.startswith(prefix)}
            live = [(sub, pname) for sub, child in below.items() for pname, param in child._parameters.items()
                    if _pointer(param) == pointer]
            if live:
                aliases.append(AliasBuffer(name, key, live[0][0], live[0][1], live=True))
                continue
            nbytes = buffer.untyped_storage().nbytes()
            candidates = []
            for sub, child in below.items():
                child_info = LAYERWISE_INFO.get(child)
                for pname, meta in (child_info.restore_metadata[0] if child_info is not None else {}).items():
                    if meta.dtype == buffer.dtype and meta.numel() * meta.element_size() == nbytes \
                            and meta.is_contiguous():
                        candidates.append((sub, pname))
            if len(candidates) == 1:
                aliases.append(AliasBuffer(name, key, candidates[0][0], candidates[0][1], live=False))
            else:
                shown = ", ".join(f"{sub}.{pname}" for sub, pname in candidates) or "none"
                unknown[f"{prefix}{key}"] = (
                    "a buffer vLLM does not record for reloading and that shares no parameter's storage, "
                    f"derived at load from an unknown tensor (parameters of its size: {shown})")
    return DerivedState(tuple(aliases), unknown)


def derived_state_of(worker) -> DerivedState:
    """The engine's derived state, found on first use and kept on the worker (its modules never change)."""
    return kept_on(worker, "_layerwise_derived_state", lambda: find_derived_state(worker.model_runner.get_model()))


def expected_alias_value(model, alias: AliasBuffer, tensors: list):
    """What a fresh engine holds in ALIAS: its source parameter as SOURCE's TENSORS load it, unprocessed.

    The source layer is loaded alone into a private copy by vLLM's own
    loaders (`scratch.load_alone`) and the buffer's view (size, stride,
    offset) is taken of the copy's parameter, as the engine took it at load.

    Args:
        model: the engine's model.
        alias: the buffer.
        tensors: SOURCE's `(name, tensor)` pairs of the parent layer `alias.source`.

    Returns:
        A tensor shaped like the buffer.
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    source = model.get_submodule(alias.source)
    info = vllm_compat.layerwise_info().get(source)
    if info is None or not any(info.restore_metadata):
        raise LayerwiseError(f"{alias.name}: vLLM recorded no reload metadata for {alias.source}")
    buffer = model.get_submodule(alias.module)._buffers[alias.buffer]
    scratch = scratch_copy(source, info)
    with torch.no_grad():
        load_alone(model, alias.source, scratch, tensors)
        value = scratch._parameters[alias.parameter].detach().contiguous()
    if value.numel() * value.element_size() != buffer.untyped_storage().nbytes():
        raise LayerwiseError(f"{alias.name}: {alias.source}.{alias.parameter} as loaded holds "
                             f"{value.numel()} elements, not the buffer's storage")
    return torch.as_strided(value, buffer.size(), buffer.stride(), buffer.storage_offset())


STALE_REASON = ("a view of {source}.{parameter} taken when the engine loaded; processing then moved that "
                "parameter to a new storage (CPU prepack), and vLLM's reload writes the new one only")


def refresh_alias_buffers(model, state: DerivedState, tensors_of) -> list[dict]:
    """Write into every stale-able alias buffer what a fresh engine holds, in place (its storage kept).

    Only the aliases whose source layer TENSORS_OF can give are refreshed; the
    others keep what they hold (their source was not reloaded). Live aliases
    (GPU) are never touched: vLLM's reload already wrote their storage.

    Args:
        model: the engine's model.
        state: `derived_state_of(worker)`.
        tensors_of: parent layer name -> SOURCE's `(name, tensor)` pairs of it, or None if SOURCE lacks it.

    Returns:
        One `{"module", "tensor", "reason"}` per buffer refreshed.
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    refreshed = []
    for alias in state.stale_after_reload():
        tensors = tensors_of(alias.source)
        if not tensors:
            continue
        value = expected_alias_value(model, alias, tensors)
        buffer = model.get_submodule(alias.module)._buffers[alias.buffer]
        with torch.no_grad():
            buffer.copy_(value)
        refreshed.append({"module": alias.module, "tensor": alias.buffer,
                          "reason": STALE_REASON.format(source=alias.source, parameter=alias.parameter)})
    return refreshed


def aliases_left_stale(model, state: DerivedState, reloaded: set[str], refreshed: list[dict]) -> list[str]:
    """The buffers derived at load from a layer this reload refilled that are neither live nor refreshed.

    A live alias must still share its parameter's storage (vLLM's in-place copy
    then wrote it); any other must be among REFRESHED. A derived buffer whose
    source could not be told cannot be refreshed, so it is listed too.

    Args:
        model: the engine's model.
        state: `derived_state_of(worker)`, found before the reload.
        reloaded: the parent layers this reload handed to vLLM.
        refreshed: the `{"module", "tensor", ...}` entries of the repairs.

    Returns:
        One `name: why` per buffer, in model order.
    """

    def refilled(module: str) -> bool:
        return any(module == parent or module.startswith(parent + ".") for parent in reloaded)

    done = {(entry["module"], entry["tensor"]) for entry in refreshed}
    left = []
    for alias in state.aliases:
        if not refilled(alias.source):
            continue
        buffer = model.get_submodule(alias.module)._buffers.get(alias.buffer)
        origin = getattr(model.get_submodule(alias.source), alias.parameter, None)
        if alias.live:
            if _pointer(buffer) is None or _pointer(buffer) != _pointer(origin):
                left.append(f"{alias.name}: no longer shares its storage with {alias.source}.{alias.parameter}")
        elif (alias.module, alias.buffer) not in done:
            left.append(f"{alias.name}: a view of {alias.source}.{alias.parameter} taken at load, not refreshed")
    for name in state.unknown:
        module = name.rpartition(".")[0]
        if refilled(module) or any(parent.startswith(module + ".") for parent in reloaded):
            left.append(f"{name}: derived at load from a tensor that cannot be told, so not refreshed")
    return left
