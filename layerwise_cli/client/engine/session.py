"""The command-side steps of an in-process reload: resolve sources, check them, then the public `reload`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.checkpoint.sources import looks_like_repo_id, open_checkpoint
from layerwise_cli.checkpoint.store.objects import display_url, is_store_url
from layerwise_cli.client.engine.in_process import reload, verify_engine
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.worker.rpc import ReloadOptions


def download_source(repo_id: str, revision: str | None, quiet: bool) -> Path:
    """Download a Hub repo's checkpoint files (`CHECKPOINT_PATTERNS`), with huggingface_hub's progress bar."""
    from layerwise_cli.checkpoint.hub.repo import download_checkpoint
    if quiet:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from layerwise_cli.checkpoint.hub.pin import hub_error

    try:
        return download_checkpoint(repo_id, revision)
    except Exception as exc:
        # Given a pinned commit the Hub no longer has, the line names the repo and the commit.
        raise hub_error(exc, repo_id, revision) from exc


def prepare_sources(source: str, base: str | None, revision: str | None, quiet: bool = False, *,
                    allow_partial: bool = False) -> tuple[str, str]:
    """Pre-flight from the headers alone, before any engine starts.

    SOURCE's headers are validated (a Hub repo's read by range requests at REVISION: pass the commit the
    operation pinned, `pin_reload`, so that a branch moved meanwhile changes nothing; it is downloaded first
    only when the engine starts on it, no BASE given); with a
    BASE, its headers too, its architecture must match, and every SOURCE
    tensor must be one BASE has, with the same shape and a compatible dtype,
    and (unless `allow_partial`) every BASE tensor that feeds a parent layer
    must be present; tensors vLLM's loader skips on purpose are exempt from
    both (`planning.skip_rules`). What only the engine knows (which module each tensor
    feeds, tensor-parallel shapes) is checked again inside the workers.

    Returns:
        SOURCE as the workers read it (a local path, or the Hub repo id when it is not downloaded: fetch it
        while the engine starts, `hub_prefetch`) and the model to start the engine on.
    """
    if is_store_url(source):
        if base is None:
            raise LayerwiseError("a URL source needs --model: the engine starts on a local or Hub model, then the "
                                 "reload streams the URL", where=display_url(source))
        local, checkpoint = source, open_step(source, revision)
    elif looks_like_repo_id(source) and base is not None and base != source:
        local, checkpoint = source, open_checkpoint(source, revision)
    else:
        local = str(download_source(source, revision, quiet)) if looks_like_repo_id(source) else source
        checkpoint = open_step(local)
    if checkpoint.delta is not None:
        raise LayerwiseError("is a sparse delta: it loads only into an engine that holds its base "
                             f"{checkpoint.delta.base_location} (a running server: reload --url, watch, or the "
                             "Python API), never into an engine started for this command", where=source)
    base = base or local
    if base != local:
        base_local = base
        if not Path(base).exists() and looks_like_repo_id(base):
            base_local = str(download_source(base, None, quiet))
        base_checkpoint = open_checkpoint(base_local)
        ours = (checkpoint.config or {}).get("architectures")
        theirs = (base_checkpoint.config or {}).get("architectures")
        if ours and theirs and ours != theirs:
            raise LayerwiseError(f"architecture {ours[0]} does not match the engine's BASE {base} ({theirs[0]})",
                                 where=source)
        from layerwise_cli.planning.parents import mapping_for_config
        from layerwise_cli.planning.reference import check_against_reference
        from layerwise_cli.planning.vllm_mapping import model_class_if_installed

        # Errors name the source as the user gave it, not the download folder.
        named = replace(checkpoint, source=source)
        config = checkpoint.config or base_checkpoint.config
        # vLLM's skip rules from its model class (the engine about to start imports vLLM anyway).
        names = ours if isinstance(ours, list) and ours else theirs if isinstance(theirs, list) else []
        model_cls = model_class_if_installed(names[0] if names and isinstance(names[0], str) else None)
        mapping = mapping_for_config(config, "auto", model_cls=model_cls)
        check_against_reference(named, base_checkpoint, mapping, allow_partial=allow_partial)
        base = base_local
    return local, base


def reload_as(llm, local_source: str, shown_as: str, options: ReloadOptions, *, verify: bool = False,
              on_verify: Callable[[], None] | None = None, commit: str | None = None) -> ReloadReport:
    """The public `reload` of LOCAL_SOURCE, then `verify_engine`, reported under the name the user gave.

    The command downloads a Hub repo first (with a progress bar) and hands the
    workers the local folder; the report names the source as the user named it.
    Unlike `reload(..., verify=True)`, a failed verification is returned in the
    report, not raised: the command shows the differences, then exits 1.

    Args:
        llm: the engine (built with layerwise's worker extension).
        local_source: the checkpoint as the workers read it (a local path).
        shown_as: the source as the user named it (a path or Hub repo id), for the report.
        options: how to reload (`ReloadOptions`); its `progress_path`, if any, is removed afterwards.
        verify: check the engine against LOCAL_SOURCE after the reload; the report
            carries the result, passed or not (the caller decides what a failure means).
        on_verify: called just before the verification starts (for a status line).
        commit: the Hub commit LOCAL_SOURCE was downloaded at (None: a local path), for the report.

    Returns:
        The merged report of all workers, with `verify` when asked.

    Raises:
        LayerwiseError: the reload failed, or the verification could not run.
    """
    try:
        report = reload(llm, local_source, options=options)
    finally:
        if options.progress_path:
            Path(options.progress_path).unlink(missing_ok=True)
    verification = None
    if verify:
        if on_verify is not None:
            on_verify()
        revision = options.revision if local_source == shown_as else None  # a Hub repo read at its pinned commit
        verification = verify_engine(llm, local_source, revision, allow_unchecked=options.allow_unchecked)
    return replace(report, placement=replace(report.placement, source=shown_as, commit=commit),
                   findings=replace(report.findings, verify=verification))
