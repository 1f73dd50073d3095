"""The command-side steps of an in-process reload: pin and decide the delivery, check the sources, start the engine
(fetching meanwhile), then the public `reload` (`reload_in_process`, what the `reload` command calls)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from layerwise_cli.checkpoint.delta.source import is_remote_step, open_step
from layerwise_cli.checkpoint.hub.pin import HubPin, hub_error
from layerwise_cli.checkpoint.hub.repo import download_checkpoint
from layerwise_cli.checkpoint.sources import looks_like_repo_id, open_checkpoint
from layerwise_cli.checkpoint.store.objects import display_url, is_store_url
from layerwise_cli.client.delivery import DOWNLOAD, PREFETCH, STREAM, decide_delivery, plan_operation
from layerwise_cli.client.engine import in_process
from layerwise_cli.client.engine.in_process import EngineOptions, reload, verify_engine
from layerwise_cli.client.engine.prefetch import Prefetch
from layerwise_cli.engine_cpus import choose_cores
from layerwise_cli.engine_defaults import cuda_available
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.planning.reference import check_against_reference
from layerwise_cli.planning.vllm_mapping import model_class_if_installed
from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.worker.rpc import ReloadOptions


def download_source(repo_id: str, revision: str | None, quiet: bool) -> Path:
    """Download a Hub repo's checkpoint files (`CHECKPOINT_PATTERNS`), with huggingface_hub's progress bar."""
    if quiet:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return download_checkpoint(repo_id, revision)
    except Exception as exc:
        # Given a pinned commit the Hub no longer has, the line names the repo and the commit.
        raise hub_error(exc, repo_id, revision) from exc


def prepare_sources(source: str, base: str | None, revision: str | None, quiet: bool = False, *,
                    allow_partial: bool = False, delivery: str | None = None) -> tuple[str, str]:
    """Pre-flight from the headers alone, before any engine starts.

    SOURCE's headers are validated (a Hub repo's read by range requests at REVISION: pass the commit the
    operation pinned, `plan_operation`, so that a branch moved meanwhile changes nothing; it is downloaded first
    only when DELIVERY says so: the engine starts on it); with a BASE, its headers too, its architecture must
    match, and every SOURCE tensor must be one BASE has, with the same shape and a compatible dtype, and (unless
    `allow_partial`) every BASE tensor that feeds a parent layer must be present; tensors vLLM's loader skips on
    purpose are exempt from both (`planning.skip_rules`). What only the engine knows (which module each tensor
    feeds, tensor-parallel shapes) is checked again inside the workers.

    Args:
        delivery: how SOURCE's bytes arrive, as the operation decided (`client/delivery.py`); None: decided
            here by the same rule, for an in-process engine started on BASE.

    Returns:
        SOURCE as the workers read it (a path on this machine, a URL, or the Hub repo id when it is not
        downloaded: fetched while the engine starts, or streamed) and the model to start the engine on.
    """
    if delivery is None:
        delivery = decide_delivery(source, engine_model=base, in_process=True, bounded_disk=False)
    if is_store_url(source) and base is None:
        raise LayerwiseError("a URL source needs --model: the engine starts on a local or Hub model, then the "
                             "reload streams the URL", where=display_url(source))
    if delivery in (PREFETCH, STREAM):
        # A URL or a Hub run's step may be a delta: opened as the full step it rebuilds (`open_step`).
        worker_source = source
        checkpoint = open_step(source, revision) if is_remote_step(source) else open_checkpoint(source, revision)
    else:
        worker_source = str(download_source(source, revision, quiet)) if delivery == DOWNLOAD else source
        checkpoint = open_step(worker_source)
    if checkpoint.delta is not None:
        raise LayerwiseError("is a sparse delta: it loads only into an engine that holds its base "
                             f"{checkpoint.delta.base_location} (a running server: reload --url, watch, or the "
                             "Python API), never into an engine started for this command", where=source)
    base = base or worker_source
    if base != worker_source:
        base_local = base
        if not Path(base).exists() and looks_like_repo_id(base):
            base_local = str(download_source(base, None, quiet))
        base_checkpoint = open_checkpoint(base_local)
        ours = (checkpoint.config or {}).get("architectures")
        theirs = (base_checkpoint.config or {}).get("architectures")
        if ours and theirs and ours != theirs:
            raise LayerwiseError(f"architecture {ours[0]} does not match the engine's BASE {base} ({theirs[0]})",
                                 where=source)
        # Errors name the source as the user gave it, not the download folder.
        named = replace(checkpoint, source=source)
        config = checkpoint.config or base_checkpoint.config
        # vLLM's skip rules from its model class (the engine about to start imports vLLM anyway).
        names = ours if isinstance(ours, list) and ours else theirs if isinstance(theirs, list) else []
        model_cls = model_class_if_installed(names[0] if names and isinstance(names[0], str) else None)
        mapping = mapping_for_config(config, "auto", model_cls=model_cls)
        check_against_reference(named, base_checkpoint, mapping, allow_partial=allow_partial)
        base = base_local
    return worker_source, base


def reload_as(llm, worker_source: str, shown_as: str, options: ReloadOptions, *, verify: bool = False,
              on_verify: Callable[[], None] | None = None, commit: str | None = None) -> ReloadReport:
    """The public `reload` of WORKER_SOURCE, then `verify_engine`, reported under the name the user gave.

    The command hands the workers the checkpoint as they read it (a Hub repo
    downloaded first, with a progress bar, is its folder); the report names the
    source as the user named it.
    Unlike `reload(..., verify=True)`, a failed verification is returned in the
    report, not raised: the command shows the differences, then exits 1.

    Args:
        llm: the engine (built with layerwise's worker extension).
        worker_source: the checkpoint as the workers read it (a path on this machine, or a Hub repo id or URL
            streamed by range).
        shown_as: the source as the user named it (a path or Hub repo id), for the report.
        options: how to reload (`ReloadOptions`); its `progress_path`, if any, is removed afterwards.
        verify: check the engine against WORKER_SOURCE after the reload; the report
            carries the result, passed or not (the caller decides what a failure means).
        on_verify: called just before the verification starts (for a status line).
        commit: the Hub commit WORKER_SOURCE was read at (None: a path or URL), for the report.

    Returns:
        The merged report of all workers, with `verify` when asked.

    Raises:
        LayerwiseError: the reload failed, or the verification could not run.
    """
    try:
        report = reload(llm, worker_source, options=options)
    finally:
        if options.progress_path:
            Path(options.progress_path).unlink(missing_ok=True)
    verification = None
    if verify:
        if on_verify is not None:
            on_verify()
        revision = options.revision if worker_source == shown_as else None  # a Hub repo read at its pinned commit
        verification = verify_engine(llm, worker_source, revision, allow_unchecked=options.allow_unchecked)
    return replace(report, placement=replace(report.placement, source=shown_as, commit=commit),
                   findings=replace(report.findings, verify=verification))


def reload_in_process(weights_path: str, model: str | None, engine: EngineOptions, options: ReloadOptions, *,
                      verify: bool = False, quiet: bool = False, on_status: Callable[[str], None] = lambda line: None,
                      run: Callable[[Callable[[str | None], ReloadReport]], ReloadReport] | None = None
                      ) -> ReloadReport:
    """The `reload` command without `--url`: pin, decide the delivery, pre-flight, start an engine, reload, stop.

    One pin and one delivery per operation (`plan_operation`), taken first: the download, the prefetch, the
    pre-flight, the reload, `--verify` and any rollback read that commit (or those ETags). A Hub commit the
    engine does not start on arrives while it starts (`prefetch`); the engine is stopped at the end, also
    after a failure.

    Args:
        weights_path: the new weights, as the user named them.
        model: the model the engine starts on (None: WEIGHTS_PATH itself).
        engine: the engine's options.
        options: how to reload; pinned and given its delivery here.
        verify: check the engine against WEIGHTS_PATH after the reload (the report carries the result).
        quiet: no download progress bar.
        on_status: called with one plain line per stage (fetching, starting, verifying), for a status display.
        run: runs the reload given a progress file's path (the command's progress bar); None: without one.

    Returns:
        The merged report, named by WEIGHTS_PATH, with `verify` when asked.

    Raises:
        LayerwiseError: the pre-flight, the fetch, the engine's start or the reload failed.
    """
    options, pin = plan_operation(weights_path, options, engine_model=model, in_process=True)
    source, base = prepare_sources(weights_path, model, options.revision, quiet=quiet,
                                   allow_partial=options.allow_partial, delivery=options.delivery)
    llm = start_engine_fetching(base, engine, pin if options.delivery == PREFETCH else None, on_status)

    def task(progress_path: str | None) -> ReloadReport:
        return reload_as(llm, source, weights_path, replace(options, progress_path=progress_path), verify=verify,
                         on_verify=lambda: on_status("Verifying the engine against the new weights ..."),
                         commit=pin.commit if pin else None)

    try:
        return run(task) if run is not None else task(None)
    finally:
        # Shut the engine down now: left to interpreter exit, multiprocessing waits for the engine process
        # before vLLM's own finalizer stops it.
        in_process.stop_engine(llm)


def start_engine_fetching(base: str, engine: EngineOptions, pin: HubPin | None,
                          on_status: Callable[[str], None] = lambda line: None):
    """Start the engine on BASE; with PIN, fetch that Hub commit's shards into the cache meanwhile (`prefetch`).

    The workers then find the commit in the cache and read it from there. A failed fetch stops the engine.
    """
    prefetch = None
    if pin is not None:
        prefetch = Prefetch(pin, open_checkpoint(pin.repo_id, pin.commit)).start()
        on_status(f"Fetching {pin} ({prefetch.total_bytes / 1e9:.2f} GB) while the engine starts ...")
    engine, cores, confined = engine_on_its_cores(engine, on_status)
    on_status(f"Starting vLLM on {base}{cores} ...")
    try:
        with in_process.thread_confined(confined):
            llm = in_process.start_engine(base, engine)
    except BaseException:
        if prefetch is not None:
            prefetch.cancel()
        raise
    if prefetch is not None:
        try:
            prefetch.finish()
        except BaseException:
            in_process.stop_engine(llm)
            raise
    return llm


def engine_on_its_cores(engine: EngineOptions,
                        on_status: Callable[[str], None]) -> tuple[EngineOptions, str, tuple[int, ...] | None]:
    """ENGINE with its CPU cores chosen on a CPU host (`engine_cpus.choose_cores`: cores no other engine's worker
    holds, or `engine.cpus`), the start line's words about them, and the CPUs its processes start on
    (`CoreChoice.processes`); a warning line when every core is taken."""
    if cuda_available():
        return engine, "", None
    choice = choose_cores(engine.tensor_parallel_size * engine.pipeline_parallel_size, requested=engine.cpus)
    if choice.warning:
        on_status(f"Warning: {choice.warning}")
    return replace(engine, cpus=choice.binding or engine.cpus), f" ({choice.said})", choice.processes
