"""`--verify` inside a worker: load SOURCE afresh into private copies of each layer and compare fingerprints."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from layerwise_cli import vllm_compat
from layerwise_cli.checkpoint.delta.hub_run import is_hub_step
from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.checkpoint.sources import resolve_local
from layerwise_cli.checkpoint.store.objects import StoreSource, display_url, is_store_url
from layerwise_cli.errors import LayerwiseError, describe_exception
from layerwise_cli.worker.proof.fingerprints import module_fingerprints
from layerwise_cli.worker.repairs.derived_state import expected_alias_value, find_derived_state
from layerwise_cli.worker.repairs.scratch import load_alone, process_copy, scratch_copy


def verify_against_source(model, source: str, revision: str | None, model_config, derived=None) -> dict:
    """Compare every parent layer SOURCE covers, and every module and buffer derived from one, with SOURCE.

    For each parent layer (read in layer order, one at a time): a private
    copy of the layer is built from vLLM's reload metadata (the layer in
    checkpoint format), swapped into the model just long enough for
    `model.load_weights` to load SOURCE's tensors of that layer into it
    (so the model's own name mapping, fusing and sharding apply), processed
    by the layer's quant method (repacking, online quantization), and its
    fingerprints compared with the live layer's, bit for bit. Modules SOURCE
    does not name but whose tensors share storage with a layer it does (a
    tied LM head) are then checked against that layer's copy
    (`_verify_derived`). Buffers the engine derived at load from a parameter
    (views: `derived_state`) are left out of their layer's comparison and
    checked on their own: each against its source parameter as SOURCE loads
    it (`_verify_alias_buffers`). A buffer whose source cannot be told is
    reported `skipped`: not checked, which fails `--verify`.

    Args:
        model: the engine's model.
        source: the checkpoint.
        revision: its Hub revision.
        model_config: the engine's model config.
        derived: the engine's `DerivedState` (None: found now).

    Returns:
        `layers`: one entry per parent layer (`name`, `status` match,
        mismatch, skipped or error, `detail`, `compared`; `derived_from`
        for a module checked through the layer it shares with); `checked`,
        `matched`, `tensors_compared`, `kernels_compared`; `mismatched`
        (layer names); `skipped` and `errors` (layer -> reason).
    """
    from layerwise_cli.worker.proof.verify_mla import mla_modules, verify_mla  # noqa: PLC0415 - torch: heavy, only where a tensor is touched
    from layerwise_cli.worker.repairs.after_reload import derived_modules  # noqa: PLC0415 - torch: heavy, only where a tensor is touched
    from layerwise_cli.worker.stream.rank_plan import plan_for_worker  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    checkpoint, folder = _open_source(source, revision)
    hf_config = model_config.hf_config.to_dict() if hasattr(model_config.hf_config, "to_dict") else None
    # Only the layers this rank holds (its pipeline stage, its experts): other ranks check theirs.
    stream = plan_for_worker(checkpoint, model, hf_config).engine_stream("layer")
    reader, fetch = _reader(checkpoint, folder, stream)
    # Modules SOURCE does not name whose weights are another layer's (a tied head), and the
    # private copies of those layers loaded from SOURCE, kept only for them.
    derived_state = derived if derived is not None else find_derived_state(model)
    parents = {item.parent for item in stream if item.parent is not None}
    # MLA's W_UV and W_UK_T are recomputed from kv_b_proj as vLLM derives them (views or copies alike).
    mla = mla_modules(model, parents)
    derived = {name: origin for name, origin in derived_modules(model, parents).items() if name not in mla}
    try:
        checked = _check_layers(model, stream, reader, derived_state, keep=set(derived.values()) | set(mla.values()))
    finally:
        reader.close()
        if fetch is not None:
            fetch.close()
    layers = checked.layers
    layers.extend(_verify_derived(model, derived, checked.loaded))
    layers.extend(verify_mla(model, mla, checked.loaded))
    layers.extend(_verify_alias_buffers(model, derived_state, checked.source_tensors, checked.statuses))
    return _summary(source, layers)


@dataclass(frozen=True)
class _Checked:
    """What the layer-by-layer pass found: an entry per parent layer, and what the later checks need of it."""

    layers: list[dict] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)  # parent layer -> its status, for those loaded alone
    # parent layer -> SOURCE's tensors of it, for the buffers derived at load from one of its parameters
    source_tensors: dict[str, list] = field(default_factory=dict)
    # parent layer -> its private copy loaded from SOURCE, for the modules derived from it (a tied head, MLA)
    loaded: dict[str, object] = field(default_factory=dict)


def _check_layers(model, stream, reader, derived_state, keep: set[str]) -> _Checked:
    """Load each parent layer of STREAM alone from READER (SOURCE), in layer order, and compare it with the live one.

    A layer that cannot be loaded alone is reported `error`, with why. KEEP
    names the layers whose private copies the derived and MLA checks need
    afterwards; the others are dropped as soon as they are compared.
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    from layerwise_cli.worker.proof.verify_quantized import require_recomputed  # noqa: PLC0415 - torch: heavy, only where a tensor is touched
    from layerwise_cli.worker.stream.shard_reader import layer_batches  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    modules = dict(model.named_modules())
    alias_sources = {alias.source for alias in derived_state.aliases}
    checked = _Checked()
    for batch in layer_batches(stream):
        parent = batch[0].parent
        if parent is None:
            continue
        tensors = [(item.entry.name, reader.read(item)) for item in batch]
        try:
            with torch.no_grad():
                entry, scratch = _verify_layer(model, parent, modules.get(parent), tensors,
                                               derived_state.on_module(parent))
            entry = require_recomputed(entry, modules.get(parent))
            checked.layers.append(entry)
            checked.statuses[parent] = entry["status"]
            if parent in alias_sources:
                checked.source_tensors[parent] = tensors
            if scratch is not None and parent in keep:
                checked.loaded[parent] = scratch
        except Exception as exc:  # noqa: BLE001 - the layer is reported as not checkable, with why
            checked.layers.append(require_recomputed({"name": parent, "status": "error", "compared": [], "detail":
                                                      f"could not be loaded alone: {describe_exception(exc)}"},
                                                     modules.get(parent)))
    return checked


def _summary(source: str, layers: list[dict]) -> dict:
    """`verify_against_source`'s answer: LAYERS, and the counts and names drawn from their statuses."""
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


def _open_source(source: str, revision: str | None):
    """SOURCE's headers and the folder of its shards (a delta's base's); a URL's read by range at its pin
    (REVISION), no folder."""
    if is_store_url(source):
        # A delta step by URL is read from this host's copies of its chain (`delta.remote`), as a local one.
        checkpoint = open_step(source, revision)
        return checkpoint, checkpoint.local_dir if checkpoint.delta is not None else None
    if is_hub_step(source):
        checkpoint = open_step(source, revision)  # from the Hub cache at the commit: a folder here
        return checkpoint, checkpoint.local_dir
    local = resolve_local(source, revision)
    checkpoint = replace(open_step(str(local)), source=source)
    # A delta is read from its base's files, through its patch.
    folder = checkpoint.local_dir if checkpoint.delta is not None else local if local.is_dir() else local.parent
    return checkpoint, folder


def _reader(checkpoint, folder, stream):
    """(a reader of STREAM's tensors, the fetch to close after it or None).

    A URL source's tensors are fetched by range like a reload's, at the objects' pinned ETags, into private
    files deleted on close.
    """
    from layerwise_cli.worker.stream.remote_stream import RemoteStream  # noqa: PLC0415 - torch: heavy, only where a tensor is touched
    from layerwise_cli.worker.stream.shard_reader import ShardReader  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    if folder is not None:
        return ShardReader(folder, delta=checkpoint.delta), None
    fetch = RemoteStream(StoreSource(checkpoint.source, pinned=checkpoint.pinned), checkpoint,
                      [item.entry for item in stream if item.parent is not None], keep=False).start()
    return ShardReader(Path(display_url(checkpoint.source)), remote=fetch), fetch


def _verify_derived(model, derived: dict[str, str], loaded: dict) -> list[dict]:
    """Check the modules SOURCE does not name but whose weights are derived from a layer it does.

    A tied LM head is not in SOURCE: it shares `embed_tokens.weight`. Each
    such module (see `after_reload.derived_modules`) gets a private copy whose
    shared tensors are the verified layer's copy loaded from SOURCE (its other
    tensors are the live ones), is processed as vLLM processes it at start
    (on CPU: its own packed kernel), and is compared with the live module,
    kernel read-back included. This catches a kernel left stale by a reload.
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

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
                scratch = scratch_copy(module, info)
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
                    loaded_shape = tuple(value.shape)
                    if loaded_shape != tuple(target.shape) and origin_key is not None:
                        # A view of the origin's tensor in another shape: the same view of what SOURCE loads
                        # into the origin.
                        value = same_view(live, getattr(origin_module, origin_key), value)
                    if value is None or tuple(value.shape) != tuple(target.shape):
                        raise LayerwiseError(f"{key}: shape {tuple(target.shape)} does not match "
                                             f"{origin}.{origin_key} {loaded_shape}")
                    target.data.copy_(value)
                process_copy(scratch)
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


def same_view(live, origin, expected):
    """The view of EXPECTED that LIVE is of ORIGIN (size, strides, offset), or None when EXPECTED is laid out otherwise.

    LIVE shares ORIGIN's storage; EXPECTED is ORIGIN as SOURCE loads it, with ORIGIN's shape and strides.
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    if tuple(expected.shape) != tuple(origin.shape) or expected.stride() != origin.stride():
        return None
    offset = live.storage_offset() - origin.storage_offset()
    end = offset + sum((size - 1) * stride for size, stride in zip(live.shape, live.stride())) + 1
    if offset < 0 or end > origin.numel():
        return None
    return torch.as_strided(expected, live.size(), live.stride(), expected.storage_offset() + offset)


def _verify_alias_buffers(model, state, source_tensors: dict[str, list], statuses: dict[str, str]) -> list[dict]:
    """Check every buffer derived at load from a parameter (`derived_state`) against SOURCE.

    A buffer that still shares its parameter's storage is checked by its
    source layer's comparison (the same bytes); one that does not (CPU
    prepack moved the parameter) is compared with its parameter as SOURCE
    loads it, unprocessed (`expected_alias_value`), which is what a fresh
    engine holds. A buffer whose source is unknown is not checked (`skipped`).
    """
    from layerwise_cli.worker.proof.checksums import tensor_sha256  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    layers = []
    for alias in state.aliases:
        origin = f"{alias.source}.{alias.parameter}"
        entry = {"name": alias.name, "status": "match", "compared": [], "derived_from": origin,
                 "detail": f"derived at load: a view of {origin}"}
        if alias.source not in statuses:
            entry.update(status="skipped", detail=f"a view of {origin}, which SOURCE does not cover")
        elif alias.live:
            entry.update(status=statuses[alias.source] if statuses[alias.source] in ("match", "mismatch")
                         else "skipped", compared=[alias.buffer],
                         detail=f"shares its storage with {origin}, checked with {alias.source}")
        else:
            try:
                expected = expected_alias_value(model, alias, source_tensors[alias.source])
                live = model.get_submodule(alias.module)._buffers[alias.buffer]
                same = tensor_sha256(expected) == tensor_sha256(live)
            except Exception as exc:  # noqa: BLE001 - reported as not checkable, with why
                entry.update(status="error", detail=f"a view of {origin}; could not be recomputed from SOURCE: "
                             f"{describe_exception(exc)}")
                layers.append(entry)
                continue
            entry["compared"] = [alias.buffer]
            if not same:
                entry.update(status="mismatch", detail=f"{alias.buffer}: a view of {origin} taken at load, "
                             "differs from that parameter as SOURCE loads it (left stale by the reload)")
        layers.append(entry)
    for name, why in state.unknown.items():
        layers.append({"name": name, "status": "skipped", "compared": [], "detail": why})
    return layers


def _verify_layer(model, name: str, module, tensors: list, derived_buffers: frozenset[str] = frozenset()
                  ) -> tuple[dict, object]:
    from layerwise_cli.worker.proof.verify_quantized import drop_processing_outputs  # noqa: PLC0415 - torch: heavy, only where a tensor is touched
    from layerwise_cli.worker.repairs.amx_mla import amx_kv_b_proj  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    LAYERWISE_INFO = vllm_compat.layerwise_info()

    def entry(status: str, detail: str = "", compared: list | None = None) -> dict:
        return {"name": name, "status": status, "detail": detail, "compared": compared or []}

    if module is None:
        return entry("mismatch", "no such module in the engine"), None
    info = LAYERWISE_INFO.get(module)
    if info is None or not any(info.restore_metadata):
        return entry("skipped", "vLLM recorded no reload metadata for this layer"), None
    if vllm_compat.is_deferred_attention_layer(module):
        return entry("skipped", "attention layers are processed with the whole model, not alone"), None
    # Buffers derived from another layer's weights are not loaded: checked on their own.
    scratch = scratch_copy(module, info, exclude=derived_buffers)
    amx_emptied = getattr(module, "weight", None) is not None and module.weight.numel() == 0 and \
        name in amx_kv_b_proj(model)
    drop_processing_outputs(scratch, module, info)  # a layer quantized online is copied in checkpoint format
    copied = load_alone(model, name, scratch, tensors)
    # vLLM's count includes buffers computed from the config, which no checkpoint fills (Gemma 4's router
    # `root_size`): SOURCE says nothing of them, so they are neither expected nor compared.
    from_config = _config_buffers(module)
    expected_numel = vllm_compat.get_layer_size(scratch) - sum(
        buffer.numel() for key, buffer in scratch._buffers.items() if buffer is not None and key in from_config)
    if copied < expected_numel and not _fills_its_padding(scratch, copied):
        return entry("skipped", f"SOURCE covers {copied} of the layer's {expected_numel} elements"), None
    process_copy(scratch)
    if amx_emptied:
        # vLLM's AMX MLA backend keeps no kv_b_proj weight (a fresh engine holds it empty too): what it derives
        # from SOURCE's is checked in its attention's packed W_UK/W_UV (`verify_mla`).
        return entry("match", "empty, as vLLM's AMX MLA backend leaves it; its packed W_UK/W_UV are checked "
                     "with its attention", ["weight"]), scratch
    expected = {key: value for key, value in module_fingerprints(scratch).items() if key not in from_config}
    actual = {key: value for key, value in module_fingerprints(module).items()
              if key not in derived_buffers and key not in from_config}
    compared = sorted(expected.keys() | actual.keys())
    differing = [key for key in compared if expected.get(key) != actual.get(key)]
    if differing:
        return entry("mismatch", "differs from SOURCE: " + ", ".join(differing), compared), scratch
    return entry("match", "", compared), scratch


def _config_buffers(module) -> set[str]:
    """MODULE's non-persistent buffers that are no view of a parameter of it or under it: computed from the config."""
    params = {param.untyped_storage().data_ptr() for param in module.parameters()}
    return {key for key, buffer in module._buffers.items() if buffer is not None
            and key in module._non_persistent_buffers_set and buffer.untyped_storage().data_ptr() not in params}


def _fills_its_padding(module, copied: int) -> bool:
    """Whether a layer SOURCE covered only in part is still complete: a padded vocabulary.

    vLLM rounds `VocabParallelEmbedding`/`ParallelLMHead` rows up to a
    multiple of 64; its weight loader copies SOURCE's rows and fills the
    padding rows with zeros itself (`vocab_parallel_embedding.py`,
    `weight_loader`), so the copy holds what a fresh engine holds.
    """
    return isinstance(module, vllm_compat.vocab_parallel_embedding_class()) and copied > 0
