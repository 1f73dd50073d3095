"""`layerwise reload`: stream new weights into a vLLM engine in layer order."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import UsageError
from ._options import (
    DtypeOpt,
    EnforceEagerOpt,
    JsonOpt,
    MaxModelLenOpt,
    MemoryFractionOpt,
    OrderOpt,
    QuantizationOpt,
    RevisionOpt,
    TensorParallelOpt,
)
from ._output import handle_errors, print_json, stderr
from ._reload_view import render_report, run_with_progress


@handle_errors
def reload_command(
    weights_path: Annotated[str, typer.Option("--weights-path", help="The new weights: a checkpoint directory, "
                                              ".safetensors file, or Hub repo id.", show_default=False)],
    model: Annotated[str | None, typer.Option("--model", help="Start the engine on BASE (default: the new "
                                              "weights themselves).", metavar="BASE")] = None,
    url: Annotated[list[str] | None, typer.Option("--url", help="Attach to running servers instead of starting "
                                                  "an engine (repeatable).")] = None,
    order: OrderOpt = "layer",
    allow_partial: Annotated[bool, typer.Option("--allow-partial", help="Accept a checkpoint that covers "
                                                "only some parameters.")] = False,
    readahead: Annotated[bool, typer.Option("--readahead/--no-readahead", help="Read the next layer while the "
                                            "engine processes the current one.")] = True,
    revision: RevisionOpt = None,
    dtype: DtypeOpt = "auto",
    tensor_parallel_size: TensorParallelOpt = 1,
    max_model_len: MaxModelLenOpt = None,
    quantization: QuantizationOpt = None,
    enforce_eager: EnforceEagerOpt = None,
    memory_fraction: MemoryFractionOpt = None,
    top: Annotated[int, typer.Option("--top", min=0, help="Show only the first N layers (0: all).")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Reload new weights into a vLLM engine in layer order, with a per-layer report.

    Starts an engine in this process on BASE, checks the new weights against
    it, streams them in layer order and prints what every layer cost.

    Example: layerwise reload --weights-path ./step-200 --model ./step-100 --max-model-len 2048
    """
    if order not in {"layer", "file"}:
        raise UsageError(f"--order must be layer or file, not {order!r}")
    if url:
        from .reload_remote import reload_remote

        raise typer.Exit(reload_remote(url, weights_path, order, allow_partial, revision, as_json))
    from ..engine.local import EngineOptions
    from ..engine.session import prepare_sources, reload_with_progress_path, start_for

    source_dir, base = prepare_sources(weights_path, model, revision, quiet=as_json)
    options = EngineOptions(dtype=dtype, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                            quantization=quantization, enforce_eager=enforce_eager,
                            memory_fraction=memory_fraction)
    if not as_json:
        stderr.print(f"Starting vLLM on {base} ...")
    llm = start_for(base, options)
    from ..engine.progress import new_progress_path

    report = run_with_progress(
        lambda path: reload_with_progress_path(llm, source_dir, order, allow_partial, readahead, path),
        None if as_json else new_progress_path(), f"reload {weights_path}", show=not as_json)
    report.source = weights_path
    if as_json:
        print_json(report.to_dict())
    else:
        render_report(report, title=f"Reload {weights_path}", top=top)
