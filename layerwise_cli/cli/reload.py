"""`layerwise reload`: stream new weights into a vLLM engine in layer order."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

import typer

from layerwise_cli.cli._options import (
    AllowNonfiniteOpt,
    BoundedDiskOpt,
    DataParallelOpt,
    DtypeOpt,
    EnforceEagerOpt,
    ExecutorBackendOpt,
    JsonOpt,
    MaxModelLenOpt,
    MemoryFractionOpt,
    OrderOpt,
    PipelineParallelOpt,
    QuantizationOpt,
    RevisionOpt,
    TensorParallelOpt,
    check_quantization,
)
from layerwise_cli.cli._output import handle_errors, print_json, stderr
from layerwise_cli.cli._reload_view import render_report, render_verify, run_with_progress, source_label
from layerwise_cli.errors import LayerwiseError, UsageError

# In-process engine options: with --url the servers' engines already run with their own.
_ENGINE_OPTIONS = {"dtype": "--dtype", "tensor_parallel_size": "--tensor-parallel-size",
                   "pipeline_parallel_size": "--pipeline-parallel-size", "data_parallel_size": "--data-parallel-size",
                   "distributed_executor_backend": "--distributed-executor-backend",
                   "max_model_len": "--max-model-len", "quantization": "--quantization",
                   "enforce_eager": "--enforce-eager", "memory_fraction": "--memory-fraction"}


@handle_errors
def reload_command(
    ctx: typer.Context,
    weights_path: Annotated[str, typer.Option("--weights-path", help="The new weights: a checkpoint directory, "
                                              ".safetensors file, or Hub repo id.", show_default=False)],
    model: Annotated[str | None, typer.Option("--model", help="Start the engine on BASE (default: the new "
                                              "weights themselves).", metavar="BASE")] = None,
    url: Annotated[list[str] | None, typer.Option("--url", help="Attach to running servers instead of starting "
                                                  "an engine (repeatable).")] = None,
    order: OrderOpt = "layer",
    allow_partial: Annotated[bool, typer.Option("--allow-partial", help="Accept a checkpoint that covers "
                                                "only some parameters.")] = False,
    allow_nonfinite: AllowNonfiniteOpt = False,
    all_layers: Annotated[bool, typer.Option("--all", help="Reload every layer. By default a layer the engine "
                                             "already holds (same bytes as when layerwise last loaded it, "
                                             "untouched since) is skipped.")] = False,
    readahead: Annotated[bool, typer.Option("--readahead/--no-readahead", help="Read the next layer while the "
                                            "engine processes the current one.")] = True,
    revision: RevisionOpt = None,
    bounded_disk: BoundedDiskOpt = False,
    dtype: DtypeOpt = "auto",
    tensor_parallel_size: TensorParallelOpt = 1,
    pipeline_parallel_size: PipelineParallelOpt = 1,
    data_parallel_size: DataParallelOpt = 1,
    distributed_executor_backend: ExecutorBackendOpt = None,
    max_model_len: MaxModelLenOpt = None,
    quantization: QuantizationOpt = None,
    enforce_eager: EnforceEagerOpt = None,
    memory_fraction: MemoryFractionOpt = None,
    top: Annotated[int, typer.Option("--top", min=0, help="Show only the first N layers (0: all).")] = 0,
    as_json: JsonOpt = False,
    pause_mode: Annotated[Literal["wait", "keep", "abort", "none"] | None, typer.Option(
        "--pause-mode", help="With --url: how generation pauses during the reload. wait (default): finish "
        "in-flight requests, queue new ones; keep: freeze in-flight requests and continue them on the new "
        "weights; abort: abort in-flight requests; none: do not pause.", show_default=False)] = None,
    weight_version: Annotated[str | None, typer.Option(
        "--weight-version", metavar="TAG", help="With --url: set the servers' weight version to TAG after a "
        "successful reload (a server with layerwise's endpoints sets it with the reload itself).")] = None,
    pause_lease: Annotated[float | None, typer.Option(
        "--pause-lease", min=1.0, max=3600.0, metavar="SECONDS", help="With --url: a server with layerwise's "
        "pause lease (`layerwise serve`, or vLLM with layerwise installed) resumes by itself this long after "
        "this command stops renewing its pause (it died). Default 60.", show_default=False)] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LAYERWISE_API_KEY", show_envvar=True, show_default=False,
        help="With --url: the servers' API key, sent as a bearer token.")] = None,
    verify: Annotated[bool, typer.Option(
        "--verify", help="After the reload, check layer by layer (tied heads and buffers derived from weights "
        "included) that the engine, or every server with --url, holds exactly what the new weights must "
        "produce; a difference, or a layer it cannot check, exits 1 and names the layers.")] = False,
    allow_unchecked: Annotated[bool, typer.Option(
        "--allow-unchecked", help="Accept a reload whose completion cannot be shown (a layer vLLM could not "
        "load keeps its previous weights; a buffer derived at load left stale; a measured peak other than the "
        "prediction) and, with --verify, layers it cannot check; the output lists them and says they were "
        "accepted, instead of exiting 1 (rolled back).")] = False,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", min=0.1, help="With --url: seconds to wait for each request to a server, the reload "
        "included (default 600).", show_default=False)] = None,
    atomic: Annotated[bool | None, typer.Option(
        "--atomic/--no-atomic", help="With --url: all or nothing (default with more than one --url). Every "
        "server is pre-flighted before any is paused; if one fails after others changed, those are reloaded "
        "back to what they held; all resume together. --no-atomic: each server on its own.",
        show_default=False)] = None,
) -> None:
    """Reload new weights into a vLLM engine in layer order, with a per-layer report.

    Checks the new weights against BASE's headers (names, shapes, dtypes,
    nothing missing) before anything starts, then starts an engine in this
    process on BASE, checks them against the engine's model, streams them in
    layer order and prints what every layer cost. A layer holding NaN or Inf
    is refused before it is handed over, and the engine rolled back.

    With --url, attaches to running vLLM servers instead (started with
    `layerwise serve`, or any vLLM server with VLLM_SERVER_DEV_MODE=1): pauses
    each, reloads the new weights (a path as the server sees it, or a Hub
    repo id), resumes, all servers at once. With more than one server, all or
    nothing: each is pre-flighted before any is paused, and those that changed
    are reloaded back if another fails (--no-atomic: each on its own).

    Example: layerwise reload --weights-path ./step-200 --model ./step-100 --max-model-len 2048

    Example: layerwise reload --weights-path ./step-200 --model ./step-100 --verify

    Example: layerwise reload --weights-path /ckpt/step-200 --url http://127.0.0.1:8000 --verify
    """
    from layerwise_cli.worker.rpc import ReloadOptions

    # The reload's options, built once: the same object reaches the workers, in process or over HTTP.
    options = ReloadOptions(order=order, allow_partial=allow_partial, readahead=readahead, revision=revision,
                            allow_nonfinite=allow_nonfinite, all_layers=all_layers, allow_unchecked=allow_unchecked,
                            bounded_disk=bounded_disk)
    if url:
        from layerwise_cli.cli.reload_remote import reload_remote
        from layerwise_cli.client.remote import RemoteOptions

        if model is not None:
            raise UsageError("--model starts an engine in this process; with --url the servers already run")
        # By source, not value: `--dtype auto` is refused too. (Typer vendors Click: compare the enum's name.)
        sources = {name: ctx.get_parameter_source(name) for name in _ENGINE_OPTIONS}
        given = [flag for name, flag in _ENGINE_OPTIONS.items()
                 if sources[name] is not None and sources[name].name != "DEFAULT"]
        if given:
            raise UsageError(f"{', '.join(given)} set the engine this command starts; with --url the servers "
                             "already run with the options they were started with")
        remote = RemoteOptions(reload=options, pause_mode=pause_mode or "wait", weight_version=weight_version,
                               api_key=api_key, verify=verify, timeout=timeout if timeout is not None else 600.0,
                               pause_lease_s=pause_lease if pause_lease is not None else 60.0)
        raise typer.Exit(reload_remote(url, weights_path, remote, as_json=as_json, top=top, atomic=atomic))
    refuse_server_options({"--pause-mode": pause_mode, "--weight-version": weight_version, "--timeout": timeout,
                           "--pause-lease": pause_lease, "--atomic/--no-atomic": atomic}, data_parallel_size)
    from layerwise_cli.client.local import EngineOptions, stop_engine
    from layerwise_cli.client.session import prepare_sources, reload_as
    from layerwise_cli.engine_defaults import cuda_available, executor_refusal
    from layerwise_cli.report.progress import new_progress_path

    check_quantization(quantization)
    refusal = executor_refusal(distributed_executor_backend, cuda_available())
    if refusal:
        raise LayerwiseError(refusal)
    from layerwise_cli.client.pinning import pin_reload

    # One commit per operation: a Hub repo id's revision is resolved here, once, before the engine starts; the
    # download, the pre-flight, the reload, --verify and any rollback read that commit.
    options, pin = pin_reload(weights_path, options)
    source_dir, base = prepare_sources(weights_path, model, options.revision, quiet=as_json,
                                       allow_partial=allow_partial)
    engine = EngineOptions(dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                           pipeline_parallel_size=pipeline_parallel_size,
                           distributed_executor_backend=distributed_executor_backend, max_model_len=max_model_len,
                           quantization=quantization, enforce_eager=enforce_eager,
                           memory_fraction=memory_fraction)
    # A Hub commit not downloaded (`prepare_sources` left it remote) arrives while the engine starts.
    fetch = pin if pin is not None and source_dir == weights_path and not options.bounded_disk else None
    llm = start_engine_fetching(base, engine, fetch, quiet=as_json)

    def on_verify() -> None:
        if not as_json:
            stderr.print("Verifying the engine against the new weights ...")

    try:
        report = run_with_progress(
            lambda path: reload_as(llm, source_dir, weights_path, replace(options, progress_path=path),
                                   verify=verify, on_verify=on_verify, commit=pin.commit if pin else None),
            None if as_json else new_progress_path(), f"reload {weights_path}", show=not as_json)
    finally:
        # Shut the engine down now: left to interpreter exit, multiprocessing
        # waits for the engine process before vLLM's own finalizer stops it.
        stop_engine(llm)
    if as_json:
        print_json(report.to_dict())
    else:
        render_report(report, title=f"Reload {source_label(report.placement)}", top=top)
        if report.verify is not None:
            render_verify(report.verify, "engine")
    if report.verify is not None and not report.verify.ok:
        from layerwise_cli.report.verify_result import verify_failure

        raise LayerwiseError(f"{verify_failure(report.verify)}; the engine held the reloaded weights, unverified",
                             where=weights_path)


def refuse_server_options(given: dict[str, object], data_parallel_size: int) -> None:
    """Refuse, in process, what applies only to running servers: GIVEN (flag -> value, None: not given), and
    data parallelism (vLLM runs one engine per process in this mode).

    Raises:
        UsageError: naming the flags.
    """
    flags = [flag for flag, value in given.items() if value is not None]
    if flags:
        raise UsageError(f"{', '.join(flags)} only apply with --url (reloading running servers)")
    if data_parallel_size > 1:
        raise UsageError("--data-parallel-size: vLLM runs one engine per process in this mode (it refuses "
                         "LLM(data_parallel_size>1)); serve with `layerwise serve MODEL -dp N` and reload it with "
                         "--url, which reaches every engine")


def start_engine_fetching(base: str, engine, pin, *, quiet: bool):
    """Start the engine on BASE; with PIN, fetch that Hub commit's shards into the cache meanwhile (`hub_prefetch`).

    The workers then find the commit in the cache and read it from there. A failed fetch stops the engine.
    """
    from layerwise_cli.client.local import start_engine, stop_engine

    prefetch = None
    if pin is not None:
        from layerwise_cli.checkpoint.sources import open_checkpoint
        from layerwise_cli.client.hub_prefetch import Prefetch

        prefetch = Prefetch(pin, open_checkpoint(pin.repo_id, pin.commit)).start()
        if not quiet:
            stderr.print(f"Fetching {pin} ({prefetch.total_bytes / 1e9:.2f} GB) while the engine starts ...")
    engine, cores = _choose_cores(engine, quiet=quiet)
    if not quiet:
        stderr.print(f"Starting vLLM on {base}{cores} ...")
    try:
        llm = start_engine(base, engine)
    except BaseException:
        if prefetch is not None:
            prefetch.cancel()
        raise
    if prefetch is not None:
        try:
            prefetch.finish()
        except BaseException:
            stop_engine(llm)
            raise
    return llm


def _choose_cores(engine, *, quiet: bool):
    """ENGINE with its CPU cores chosen (on a CPU host), and the start line's words about them."""
    from layerwise_cli.engine_cpus import choose_cores
    from layerwise_cli.engine_defaults import cuda_available

    if cuda_available():
        return engine, ""
    choice = choose_cores(engine.tensor_parallel_size * engine.pipeline_parallel_size, requested=engine.cpus)
    if choice.warning and not quiet:
        stderr.print(f"[yellow]Warning:[/] {choice.warning}")
    return replace(engine, cpus=choice.binding or engine.cpus), f" ({choice.said})"
