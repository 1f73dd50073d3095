"""`--verify` inside a worker: load SOURCE afresh into private copies of each layer and compare fingerprints."""

from __future__ import annotations

from layerwise_cli.errors import LayerwiseError, describe_exception
from layerwise_cli.worker.fingerprints import module_fingerprints


def verify_against_source(model, source: str, revision: str | None, model_config) -> dict:
    """Compare every parent layer SOURCE covers, and every module derived from one, with SOURCE.

    For each parent layer (read in layer order, one at a time): a private
    copy of the layer is built from vLLM's reload metadata (the layer in
    checkpoint format), swapped into the model just long enough for
    `model.load_weights` to load SOURCE's tensors of that layer into it
    (so the model's own name mapping, fusing and sharding apply), processed
    by the layer's quant method (repacking, online quantization), and its
    fingerprints compared with the live layer's, bit for bit. Modules SOURCE
    does not name but whose tensors share storage with a layer it does (a
    tied LM head) are then checked against that layer's copy
    (`_verify_derived`).

    Returns:
        `layers`: one entry per parent layer (`name`, `status` match,
        mismatch, skipped or error, `detail`, `compared`; `derived_from`
        for a module checked through the layer it shares with); `checked`,
        `matched`, `tensors_compared`, `kernels_compared`; `mismatched`
        (layer names); `skipped` and `errors` (layer -> reason).
    """
    from dataclasses import replace

    import torch

    from layerwise_cli.checkpoint.sources import open_checkpoint
    from layerwise_cli.worker.cpu_fixups import derived_modules
    from layerwise_cli.worker.rank_plan import plan_for_worker
    from layerwise_cli.worker.reload import resolve_local
    from layerwise_cli.worker.stream import ShardReader, layer_batches
    from layerwise_cli.worker.verify_quantized import require_recomputed

    local = resolve_local(source, revision)
    checkpoint = replace(open_checkpoint(str(local)), source=source)
    hf_config = model_config.hf_config.to_dict() if hasattr(model_config.hf_config, "to_dict") else None
    # Only the layers this rank holds (its pipeline stage, its experts): other ranks check theirs.
    stream = plan_for_worker(checkpoint, model, hf_config).engine_stream("layer")
    folder = local if local.is_dir() else local.parent
    modules = dict(model.named_modules())
    reader = ShardReader(folder)
    layers: list[dict] = []
    # Modules SOURCE does not name whose weights are another layer's (a tied head), and the
    # private copies of those layers loaded from SOURCE, kept only for them.
    derived = derived_modules(model, {item.parent for item in stream if item.parent is not None})
    loaded: dict[str, object] = {}
    try:
        for batch in layer_batches(stream):
            parent = batch[0].parent
            if parent is None:
                continue
            tensors = [(item.entry.name, reader.read(item)) for item in batch]
            try:
                with torch.no_grad():
                    entry, scratch = _verify_layer(model, parent, modules.get(parent), tensors)
                layers.append(require_recomputed(entry, modules.get(parent)))
                if scratch is not None and parent in derived.values():
                    loaded[parent] = scratch
            except Exception as exc:  # noqa: BLE001 - the layer is reported as not checkable, with why
                layers.append(require_recomputed({"name": parent, "status": "error", "compared": [], "detail":
                                                  f"could not be loaded alone: {describe_exception(exc)}"},
                                                 modules.get(parent)))
    finally:
        reader.close()
    layers.extend(_verify_derived(model, derived, loaded))
    matched = [layer for layer in layers if layer["status"] == "match"]
    return {
        "source": source,
        "layers": layers,
        "checked": sum(1 for layer in layers if layer["status"] in ("match", "mismatch")),
        "matched": len(matched),
        "mismatched": [layer["name"] for layer in layers if layer["status"] == "mismatch"],
        "skipped": {layer["name"]: layer["detail"] for layer in layers if layer["status"] == "skipped"},
        "errors": {layer["name"]: layer["detail"] for layer in layers if layer["status"] == "error"},
        # Layers quantized online, re-quantized from SOURCE with the engine's method and compared -> method.
        "quantized": {layer["name"]: layer["quantized"] for layer in layers
                      if layer.get("quantized") and layer["status"] in ("match", "mismatch")},
        "tensors_compared": sum(sum(1 for key in layer["compared"] if key != "#kernel") for layer in layers),
        "kernels_compared": sum(sum(1 for key in layer["compared"] if key == "#kernel") for layer in layers),
    }


def _verify_derived(model, derived: dict[str, str], loaded: dict) -> list[dict]:
    """Check the modules SOURCE does not name but whose weights are derived from a layer it does.

    A tied LM head is not in SOURCE: it shares `embed_tokens.weight`. Each
    such module (see `cpu_fixups.derived_modules`) gets a private copy whose
    shared tensors are the verified layer's copy loaded from SOURCE (its other
    tensors are the live ones), is processed as vLLM processes it at start
    (on CPU: its own packed kernel), and is compared with the live module,
    kernel read-back included. This catches a kernel left stale by a reload.
    """
    import torch

    from layerwise_cli import vllm_compat

    LAYERWISE_INFO = vllm_compat.layerwise_info()
    layers = []
    for name, origin in derived.items():
        module = model.get_submodule(name)
        origin_module = model.get_submodule(origin)
        expected_from = loaded.get(origin)
        entry = {"name": name, "status": "match", "compared": [], "derived_from": origin,
                 "detail": f"derived: shares its weight with {origin} (not in SOURCE itself)"}
        if expected_from is None:
            entry.update(status="skipped", detail=f"shares its weight with {origin}, which was not checked")
            layers.append(entry)
            continue
        info = LAYERWISE_INFO.get(module)
        if info is None or not any(info.restore_metadata):
            entry.update(status="skipped", detail=f"shares its weight with {origin}, but vLLM recorded no "
                         "reload metadata for it")
            layers.append(entry)
            continue
        try:
            with torch.no_grad():
                scratch = _scratch_copy(module, info)
                owner = {tensor.untyped_storage().data_ptr(): key
                         for key, tensor in list(origin_module._parameters.items())
                         + list(origin_module._buffers.items()) if tensor is not None}
                for key, live in list(module._parameters.items()) + list(module._buffers.items()):
                    if live is None or (key not in scratch._parameters and key not in scratch._buffers):
                        continue
                    target = getattr(scratch, key)
                    origin_key = owner.get(live.untyped_storage().data_ptr()) if live.numel() else None
                    value = getattr(expected_from, origin_key) if origin_key is not None else live
                    if value.device.type == "meta" or value.numel() == 0:
                        continue
                    if tuple(value.shape) != tuple(target.shape):
                        raise LayerwiseError(f"{key}: shape {tuple(target.shape)} does not match "
                                             f"{origin}.{origin_key} {tuple(value.shape)}")
                    target.data.copy_(value)
                _process(scratch)
                expected = module_fingerprints(scratch)
                actual = module_fingerprints(module)
        except Exception as exc:  # noqa: BLE001 - reported as not checkable, with why
            entry.update(status="error", detail=f"derived from {origin}; could not be rebuilt alone: "
                         f"{describe_exception(exc)}")
            layers.append(entry)
            continue
        compared = sorted(expected.keys() | actual.keys())
        differing = [key for key in compared if expected.get(key) != actual.get(key)]
        entry["compared"] = compared
        if differing:
            entry.update(status="mismatch", detail=f"derived from {origin} (shares its weight; not in SOURCE) "
                         f"and differs from what SOURCE must produce: {', '.join(differing)}")
        layers.append(entry)
    return layers


def _verify_layer(model, name: str, module, tensors: list) -> tuple[dict, object]:
    from layerwise_cli import vllm_compat

    LAYERWISE_INFO = vllm_compat.layerwise_info()
    CopyCounter = vllm_compat.copy_counter_class()

    from layerwise_cli.worker.verify_quantized import drop_processing_outputs

    def entry(status: str, detail: str = "", compared: list | None = None) -> dict:
        return {"name": name, "status": status, "detail": detail, "compared": compared or []}

    if module is None:
        return entry("mismatch", "no such module in the engine"), None
    info = LAYERWISE_INFO.get(module)
    if info is None or not any(info.restore_metadata):
        return entry("skipped", "vLLM recorded no reload metadata for this layer"), None
    if vllm_compat.is_deferred_attention_layer(module):
        return entry("skipped", "attention layers are processed with the whole model, not alone"), None
    scratch = _scratch_copy(module, info)
    drop_processing_outputs(scratch, module, info)  # a layer quantized online is copied in checkpoint format
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._modules[child] = scratch
    try:
        with CopyCounter() as counter:
            model.load_weights(iter(tensors))
    finally:
        parent._modules[child] = module
    expected_numel = vllm_compat.get_layer_size(scratch)
    if counter.copied_numel < expected_numel and not _fills_its_padding(scratch, counter.copied_numel):
        return entry("skipped", f"SOURCE covers {counter.copied_numel} of the layer's {expected_numel} "
                     "elements"), None
    _process(scratch)
    expected = module_fingerprints(scratch)
    actual = module_fingerprints(module)
    compared = sorted(expected.keys() | actual.keys())
    differing = [key for key in compared if expected.get(key) != actual.get(key)]
    if differing:
        return entry("mismatch", "differs from SOURCE: " + ", ".join(differing), compared), scratch
    return entry("match", "", compared), scratch


def _fills_its_padding(module, copied: int) -> bool:
    """Whether a layer SOURCE covered only in part is still complete: a padded vocabulary.

    vLLM rounds `VocabParallelEmbedding`/`ParallelLMHead` rows up to a
    multiple of 64; its weight loader copies SOURCE's rows and fills the
    padding rows with zeros itself (`vocab_parallel_embedding.py`,
    `weight_loader`), so the copy holds what a fresh engine holds.
    """
    from layerwise_cli import vllm_compat

    return isinstance(module, vllm_compat.vocab_parallel_embedding_class()) and copied > 0


def _scratch_copy(module, info):
    """A private copy of `module` in checkpoint format, sharing no tensor a loader could write into."""
    import copy

    import torch

    scratch = copy.copy(module)
    scratch._parameters = {}
    scratch._buffers = {}
    scratch._modules = dict(module._modules)
    scratch._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    scratch.__dict__.pop("_already_called_process_weights_after_loading", None)
    # The engine's kernel handle must not answer for the copy: processing builds the copy's own.
    scratch.__dict__.pop("cpu_linear", None)
    restore_params, restore_buffers = info.restore_metadata
    with torch.device(info.restore_device):
        for name, meta in restore_params.items():
            scratch.register_parameter(name, _fresh_tensor(meta, scratch, module, zeros=True))
        for name, meta in restore_buffers.items():
            scratch.register_buffer(name, _fresh_tensor(meta, scratch, module, zeros=True),
                                    persistent=name not in scratch._non_persistent_buffers_set)
    # Tensors vLLM leaves out of its metadata (`bias`, expert maps) stay live on
    # the engine's layer: give the copy its own clones of them.
    for name, tensor in module._parameters.items():
        if tensor is not None and name not in scratch._parameters:
            scratch.register_parameter(name, _fresh_tensor(tensor, scratch, module, zeros=False))
    for name, tensor in module._buffers.items():
        if tensor is not None and name not in scratch._buffers:
            scratch.register_buffer(name, _fresh_tensor(tensor, scratch, module, zeros=False),
                                    persistent=name not in scratch._non_persistent_buffers_set)
    return scratch


def _fresh_tensor(template, scratch, module, *, zeros: bool):
    """A new tensor shaped like `template` (zeros, or a copy of its values), with its attributes.

    Weight loaders bound to the engine's layer (or to vLLM's placeholder) are
    rebound to the copy, and layerwise's buffering wrappers are removed, so
    that loading the copy never touches the engine's layer or its buffers.
    """
    from types import MethodType

    import torch

    from layerwise_cli import vllm_compat

    layer_ref_sentinel = vllm_compat.layer_ref_sentinel()

    if zeros or template.device.type == "meta":
        tensor = torch.zeros(tuple(template.shape), dtype=template.dtype)
    else:
        tensor = template.detach().clone()
    tensor.__class__ = template.__class__
    attributes = {}
    for key, value in template.__dict__.items():
        while callable(value) and getattr(value, "__name__", "") == vllm_compat.ONLINE_PROCESS_LOADER_NAME:
            value = value.__wrapped__
        if isinstance(value, MethodType) and (value.__self__ is module or value.__self__ is layer_ref_sentinel):
            value = value.__func__.__get__(scratch)
        attributes[key] = value
    tensor.__dict__ = attributes
    return tensor


def _process(scratch) -> None:
    """What vLLM does to a layer once all its weights are loaded (repacking, online quantization)."""
    from layerwise_cli import vllm_compat

    quant_method = getattr(scratch, "quant_method", None)
    if isinstance(quant_method, vllm_compat.quantize_method_base_class()):
        if getattr(quant_method, "moe_kernel", None) is not None:
            # Process the copy as a fresh engine does, not as a weight update:
            # vLLM's MoE methods skip the kernel's own processing (CPU prepack)
            # once a kernel exists, which is what a reload gets wrong on CPU.
            import copy

            quant_method = copy.copy(quant_method)
            quant_method.moe_kernel = None
            scratch.quant_method = quant_method
        quant_method.process_weights_after_loading(scratch)
        if hasattr(scratch, "update_param_tp_status"):
            scratch.update_param_tp_status()
