"""The layer-ordered reload as it runs inside one vLLM worker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch

from layerwise_cli.checkpoint.sources import Checkpoint, looks_like_repo_id, open_checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.planning.plan import Plan, build_plan, simulate_buffering
from layerwise_cli.report.progress import ProgressWriter
from layerwise_cli.report.reload_report import LayerReport, ReloadReport
from layerwise_cli.worker.preflight import preflight, reference_checkpoint
from layerwise_cli.worker.probe import BufferProbe
from layerwise_cli.worker.stream import ReadAheadStats, read_in_order

ORDERS = ("layer", "file")


def resolve_local(source: str, revision: str | None = None) -> Path:
    """A local directory (or file) for SOURCE; Hub repo ids are downloaded (weights and config)."""
    path = Path(source)
    if path.exists():
        return path
    if looks_like_repo_id(source):
        from layerwise_cli.checkpoint.hub import download_checkpoint
        from layerwise_cli.errors import describe_exception

        try:
            return download_checkpoint(source, revision)
        except Exception as exc:
            raise describe_exception(exc, where=source) from exc
    raise LayerwiseError("no such file or directory, and not a Hub repo id (org/name)", where=source)


def tensor_parallel_position() -> tuple[int, int]:
    """This worker's (tensor-parallel size, rank); (1, 0) outside a vLLM worker."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no parallel state: a single process
        return 1, 0


def plan_for_engine(checkpoint: Checkpoint, model: torch.nn.Module, hf_config: dict | None,
                    tensor_parallel_size: int = 1) -> tuple[Plan, dict[str, str]]:
    """Plan the checkpoint with the engine's names.

    Returns the plan and, for each checkpoint tensor, the engine module that
    consumes it (after the model's own checkpoint-name mapper, if any).
    """
    config = checkpoint.config or hf_config
    mapping = mapping_for_config(config, "auto")
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    modules = dict(model.named_modules()) if hasattr(model, "named_modules") else None
    resolved: dict[str, str] = {}
    vllm_names: dict[str, str] = {}
    for entry in checkpoint.tensors:
        name = entry.name
        if mapper is not None:
            name = mapper._map_name(name) or name  # the mapper's per-name API (private in vLLM)
        parent = mapping.parent_of(name)
        if parent is not None:
            if parent.name not in resolved:
                resolved[parent.name] = holder_of_parameters(modules, parent.name) if modules else parent.name
            vllm_names[entry.name] = resolved[parent.name]
    plan = build_plan(checkpoint, mapping, tensor_parallel_size)
    return plan, vllm_names


def holder_of_parameters(modules: dict[str, torch.nn.Module], name: str) -> str:
    """The module that holds the parameters for parent NAME.

    Usually NAME itself. Some vLLM modules delegate to one child that owns the
    weights (vLLM 0.32's `MoERunner` at `mlp.experts` keeps them in
    `mlp.experts.routed_experts`); then that child is the layer vLLM buffers.
    """
    module = modules.get(name)
    if module is None or any(True for _ in module.parameters(recurse=False)):
        return name
    holders = [child for child, sub in modules.items()
               if child.startswith(name + ".") and any(True for _ in sub.parameters(recurse=False))]
    return holders[0] if len(holders) == 1 else name


def stream_reload(worker, source: str, *, order: str = "layer", allow_partial: bool = False,
                  readahead: bool = True, revision: str | None = None,
                  on_engine_touched=None, progress_path: str | None = None,
                  allow_nonfinite: bool = False) -> ReloadReport:
    """Pre-flight SOURCE against this worker's model, then reload it in `order`, measuring.

    Args:
        worker: the vLLM worker (`self` of the worker extension).
        source: a directory or file on this machine, or a Hub repo id.
        order: `layer` (this tool's plan) or `file` (what vLLM's loader reads).
        allow_partial: accept checkpoints that cover only some parameters.
        readahead: read the next layer while the engine loads the current one.
        revision: Hub revision for a repo id.
        on_engine_touched: called once pre-flight passed, just before the
            engine's weights start to change.
        progress_path: a file to append one JSON line per completed layer to
            (rank 0 only), for the command's progress bar.
        allow_nonfinite: load tensors holding NaN or Inf; by default a layer
            holding any is refused before it is handed over (the caller rolls
            back the layers already loaded).

    Returns:
        This worker's report.
    """
    if order not in ORDERS:
        raise LayerwiseError(f"unknown order {order!r}: use layer or file")
    model = worker.model_runner.get_model()
    model_config = worker.model_runner.model_config
    local = resolve_local(source, revision)
    checkpoint = open_checkpoint(str(local))
    checkpoint.source = source
    hf_config = model_config.hf_config.to_dict() if hasattr(model_config.hf_config, "to_dict") else None
    tp_size, tp_rank = tensor_parallel_position()
    plan, vllm_names = plan_for_engine(checkpoint, model, hf_config, tp_size)
    notes = preflight(plan, model, vllm_names, reference_checkpoint(str(model_config.model)),
                      allow_partial=allow_partial)
    stream = plan.layer_order if order == "layer" else plan.file_order
    # The probe and the prediction both speak engine module names.
    engine_stream = [type(item)(item.entry, vllm_names.get(item.entry.name)) for item in stream]
    engine_name = {item.parent: vllm_names.get(item.entry.name, item.parent)
                   for item in plan.layer_order if item.parent is not None}
    # vLLM holds these on this rank until the end of the stream (padded vocabulary, partial fused layers).
    held_here = {engine_name.get(name, name): plan.held[name].reason for name in plan.held_on(tp_rank)}
    predicted = simulate_buffering(engine_stream, order, held_here, rank=tp_rank if tp_size > 1 else None)
    folder = local if local.is_dir() else local.parent
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    stats = ReadAheadStats()
    rank = getattr(worker, "rank", 0) or 0
    progress = ProgressWriter(progress_path if rank == 0 else None, len(plan.layers), plan.total_bytes)
    probe = BufferProbe(model, on_layer_done=lambda name, timing: progress.write(
        {"event": "layer", "name": name, "tensors": timing.tensors, "bytes": timing.bytes}))

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for item, tensor in read_in_order(engine_stream, folder, device=device, readahead=readahead, stats=stats,
                                          check_finite=not allow_nonfinite):
            probe.before_handover(item.entry.name, item.parent, item.entry.nbytes)
            yield item.entry.name, tensor
        probe.finish()
        timer["stream_done"] = time.perf_counter()

    timer: dict[str, float] = {}
    if on_engine_touched is not None:
        on_engine_touched()
    start = time.perf_counter()
    try:
        worker.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
    finally:
        progress.write({"event": "end"})
        progress.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        from layerwise_cli.worker.cpu_fixups import apply_cpu_fixups

        notes.extend(apply_cpu_fixups(model, set(probe.timings)))
    end = time.perf_counter()
    layers = []
    # Layers in the order the stream delivered their first tensor.
    for name in dict.fromkeys(item.parent for item in engine_stream if item.parent is not None):
        timing = probe.timings.get(name)
        if timing is None:
            continue
        done = timing.done if timing.done is not None else end
        layers.append(LayerReport(
            name=name,
            tensors=timing.tensors,
            bytes=timing.bytes,
            load_s=timing.last_handover - timing.first,
            process_s=max(0.0, done - timing.last_handover),
            buffered_bytes_at_completion=timing.buffered_at_completion,
            completed_during_stream=timing.done is not None,
            held_to_end=held_here.get(name),
        ))
    return ReloadReport(
        order=order,
        source=source,
        wall_s=end - start,
        bytes=sum(item.entry.nbytes for item in engine_stream if item.parent is not None),
        tensors=len(engine_stream),
        peak_buffer_bytes=probe.peak,
        peak_tensor=probe.peak_tensor,
        predicted_peak_buffer_bytes=predicted.peak_buffer_bytes,
        largest_layer_bytes=plan.largest_layer_bytes,
        held_to_end_bytes=plan.held_bytes(tp_rank),
        above_largest_layer_because=plan.excess_reason(predicted),
        readahead_peak_bytes=stats.peak_bytes,
        layers=layers,
        rank=getattr(worker, "rank", None),
        unexpected=probe.unexpected,
        mapping=plan.mapping.description,
        device=str(device),
        finalize_s=end - timer.get("stream_done", end),
        notes=notes,
    )


def discard_partial_reload(model: torch.nn.Module) -> None:
    """Drop what a failed reload left in vLLM's layer buffers, so that the next reload starts clean.

    Layers the failed reload never completed stay on the meta device with
    their loaders wrapped; `initialize_layerwise_reload` reuses them as they
    are, so only their buffered tensors and counts must go.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None and info.can_load():
            info.loaded_weights = []
            info.load_numel = 0
