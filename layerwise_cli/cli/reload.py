"""`layerwise reload`: stream new weights into a vLLM engine in layer order."""

from __future__ import annotations

from typing import Annotated, Literal

import typer
from rich.markup import escape

from layerwise_cli.cli._options import (
    ENGINE_DEFAULTS,
    OUTPUT_PANEL,
    PROOF_PANEL,
    RELOAD_PANEL,
    SERVERS_PANEL,
    SOURCE_PANEL,
    AllowNonfiniteOpt,
    BoundedDiskOpt,
    EngineFlags,
    JsonOpt,
    OrderOpt,
    RevisionOpt,
    ServersApiKeyOpt,
    check_quantization,
    takes_engine_flags,
)
from layerwise_cli.cli._output import handle_errors, print_json, stderr
from layerwise_cli.cli._reload_view import render_report, render_verify, run_with_progress, source_label
from layerwise_cli.engine_defaults import cuda_available, executor_refusal
from layerwise_cli.errors import LayerwiseError, UsageError
from layerwise_cli.report.progress import new_progress_path
from layerwise_cli.report.verify_result import verify_failure
from layerwise_cli.worker.rpc import ReloadOptions

# The options only this command takes (the shared ones are in `_options`), each declared once with its help.
_WeightsPathOpt = Annotated[
    str,
    typer.Option("--weights-path", metavar="SOURCE", show_default=False, rich_help_panel=SOURCE_PANEL,
                 help="The new weights: a folder or .safetensors file, a Hub repo id (org/name), a URL (s3://, "
                 "gs://, az://, https://); a delta step with --url."),
]
_ModelOpt = Annotated[
    str | None,
    typer.Option("--model", help="Start the engine on BASE (default: the new weights themselves).", metavar="BASE",
                 rich_help_panel=SOURCE_PANEL),
]
_AllLayersOpt = Annotated[
    bool,
    typer.Option("--all", help="Reload every layer, also those the engine already holds unchanged (skipped by "
                 "default).", rich_help_panel=RELOAD_PANEL),
]
_ReadaheadOpt = Annotated[
    bool,
    typer.Option("--readahead/--no-readahead", help="Read the next layer while the engine processes the current "
                 "one.", rich_help_panel=RELOAD_PANEL),
]
_UrlOpt = Annotated[
    list[str] | None,
    typer.Option("--url", metavar="URL", help="Reload these running servers instead of starting an engine "
                 "(repeatable).", rich_help_panel=SERVERS_PANEL),
]
_PauseModeOpt = Annotated[
    Literal["wait", "keep", "abort", "none"] | None,
    typer.Option("--pause-mode", metavar="MODE", rich_help_panel=SERVERS_PANEL, show_default=False,
                 help="How generation pauses: wait (default; finish in-flight requests, queue new ones), keep "
                 "(continue them on the new weights), abort, or none."),
]
_WeightVersionOpt = Annotated[
    str | None,
    typer.Option("--weight-version", metavar="TAG", rich_help_panel=SERVERS_PANEL,
                 help="Set the servers' weight version to TAG with a successful reload."),
]
_PauseLeaseOpt = Annotated[
    float | None,
    typer.Option("--pause-lease", min=1.0, max=3600.0, metavar="SECONDS", rich_help_panel=SERVERS_PANEL,
                 help="A server with layerwise's pause lease resumes by itself this long after this command stops "
                 "renewing it (default 60).", show_default=False),
]
_AllowPartialOpt = Annotated[
    bool,
    typer.Option("--allow-partial", help="Accept a checkpoint that covers only some parameters.",
                 rich_help_panel=PROOF_PANEL),
]
_VerifyOpt = Annotated[
    bool,
    typer.Option("--verify", rich_help_panel=PROOF_PANEL,
                 help="Afterwards, check layer by layer that the engine (or every server) holds exactly what the "
                 "new weights produce; a difference exits 1."),
]
_AllowUncheckedOpt = Annotated[
    bool,
    typer.Option("--allow-unchecked", rich_help_panel=PROOF_PANEL,
                 help="Accept, and list, what cannot be shown complete or checked (a layer vLLM could not load, a "
                 "stale derived buffer, a peak other than predicted) instead of rolling back."),
]
_TimeoutOpt = Annotated[
    float | None,
    typer.Option("--timeout", min=0.1, metavar="SECONDS", rich_help_panel=SERVERS_PANEL,
                 help="Seconds to wait for each request to a server, the reload included (default 600).",
                 show_default=False),
]
_AtomicOpt = Annotated[
    bool | None,
    typer.Option("--atomic/--no-atomic", rich_help_panel=SERVERS_PANEL,
                 help="All or nothing (the default with more than one --url): every server pre-flighted first, "
                 "those changed reloaded back if one fails.", show_default=False),
]
_TopOpt = Annotated[
    int,
    typer.Option("--top", min=0, metavar="N", help="Show only the first N layers (0: all).",
                 rich_help_panel=OUTPUT_PANEL),
]


@handle_errors
@takes_engine_flags
def reload_command(
    ctx: typer.Context,
    weights_path: _WeightsPathOpt,
    model: _ModelOpt = None,
    revision: RevisionOpt = None,
    bounded_disk: BoundedDiskOpt = False,
    order: OrderOpt = "layer",
    all_layers: _AllLayersOpt = False,
    readahead: _ReadaheadOpt = True,
    engine: EngineFlags = ENGINE_DEFAULTS,
    url: _UrlOpt = None,
    pause_mode: _PauseModeOpt = None,
    weight_version: _WeightVersionOpt = None,
    pause_lease: _PauseLeaseOpt = None,
    api_key: ServersApiKeyOpt = None,
    allow_partial: _AllowPartialOpt = False,
    allow_nonfinite: AllowNonfiniteOpt = False,
    verify: _VerifyOpt = False,
    allow_unchecked: _AllowUncheckedOpt = False,
    timeout: _TimeoutOpt = None,
    atomic: _AtomicOpt = None,
    top: _TopOpt = 0,
    as_json: JsonOpt = False,
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

    Sources (a Hub revision, s3://, a delta step), caches and credentials:
    docs/sources.md; every option: docs/commands/reload.md.
    """
    # The reload's options, built once: the same object reaches the workers, in process or over HTTP.
    options = ReloadOptions(order=order, allow_partial=allow_partial, readahead=readahead, revision=revision,
                            allow_nonfinite=allow_nonfinite, all_layers=all_layers, allow_unchecked=allow_unchecked,
                            bounded_disk=bounded_disk)
    if url:
        from layerwise_cli.cli.reload_remote import reload_remote  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs
        from layerwise_cli.client.servers.reload_servers import RemoteOptions  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

        _refuse_engine_options(ctx, engine, model)
        remote = RemoteOptions(reload=options, pause_mode=pause_mode or "wait", weight_version=weight_version,
                               api_key=api_key, verify=verify, timeout=timeout if timeout is not None else 600.0,
                               pause_lease_s=pause_lease if pause_lease is not None else 60.0)
        raise typer.Exit(reload_remote(url, weights_path, remote, as_json=as_json, top=top, atomic=atomic))
    refuse_server_options({"--pause-mode": pause_mode, "--weight-version": weight_version, "--timeout": timeout,
                           "--pause-lease": pause_lease, "--atomic/--no-atomic": atomic},
                          engine.data_parallel_size)
    from layerwise_cli.client.engine.session import reload_in_process  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    report = reload_in_process(
        weights_path, model, _engine_options(engine), options, verify=verify, quiet=as_json,
        on_status=(lambda line: None) if as_json else (lambda line: stderr.print(escape(line))),
        run=lambda task: run_with_progress(task, None if as_json else new_progress_path(), f"reload {weights_path}",
                                           show=not as_json))
    _show_report(report, weights_path, as_json=as_json, top=top)


def _refuse_engine_options(ctx: typer.Context, engine: EngineFlags, model: str | None) -> None:
    """Refuse, with --url, the options that set the engine this command would start: the servers already run.

    Raises:
        UsageError: naming the options.
    """
    if model is not None:
        raise UsageError("--model starts an engine in this process; with --url the servers already run")
    # In-process engine options, by source, not value: `--dtype auto` is refused too.
    given = engine.given(ctx)
    if given:
        raise UsageError(f"{', '.join(given)} set the engine this command starts; with --url the servers "
                         "already run with the options they were started with")


def _engine_options(engine: EngineFlags):
    """The in-process engine's `EngineOptions` from its flags, after checking its quantization and executor.

    Raises:
        LayerwiseError: an executor backend this machine cannot run.
    """
    from layerwise_cli.client.engine.in_process import EngineOptions  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    check_quantization(engine.quantization)
    refusal = executor_refusal(engine.distributed_executor_backend, cuda_available())
    if refusal:
        raise LayerwiseError(refusal)
    # data_parallel_size is refused above: an engine in this process is one engine.
    return EngineOptions(**{name: value for name, value in engine.as_kwargs().items()
                            if name != "data_parallel_size"})


def _show_report(report, weights_path: str, *, as_json: bool, top: int) -> None:
    """Print the in-process reload's report (JSON or tables) and its --verify; a failed --verify exits 1.

    Raises:
        LayerwiseError: --verify found the engine holding other weights than the new ones.
    """
    if as_json:
        print_json(report.to_dict())
    else:
        render_report(report, title=f"Reload {source_label(report.placement)}", top=top)
        if report.verify is not None:
            render_verify(report.verify, "engine")
    if report.verify is not None and not report.verify.ok:
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
