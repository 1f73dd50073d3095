"""Keep servers (or an in-process engine) on the newest complete step of a training run: the public entry points.

The loop is `watcher.Watcher`; its options `options.WatchOptions`; what it reloads `targets`; what it
reports `events`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from layerwise_cli.client.servers.api import HOLDS_NEW, PAUSE_MODES, RemoteOptions
from layerwise_cli.client.watch.events import WatchEvent
from layerwise_cli.client.watch.options import WatchOptions
from layerwise_cli.client.watch.targets import EngineTarget, ServerTarget, Target
from layerwise_cli.client.watch.watcher import Watcher
from layerwise_cli.errors import LayerwiseError, UsageError


def server_targets(urls: list[str], options: WatchOptions) -> list[Target]:
    """One `ServerTarget` per URL, reloading with OPTIONS' pause mode, API key, --verify and timeout."""
    if options.pause_mode not in PAUSE_MODES:
        raise UsageError(f"unknown pause mode {options.pause_mode!r}: use one of {', '.join(PAUSE_MODES)}")
    remote = RemoteOptions(reload=options.reload_options(), pause_mode=options.pause_mode,
                           pause_lease_s=options.pause_lease_s, api_key=options.api_key, verify=options.verify,
                           timeout=options.timeout)
    return [ServerTarget(url, remote) for url in urls]


def watch(root: str | Path, *, llm=None, urls: list[str] | None = None, options: WatchOptions | None = None,
          **option_values) -> Iterator[WatchEvent]:
    """Keep an in-process engine (`llm=`) and/or servers (`urls=`) on the newest complete step of ROOT.

    A generator: each item is a `WatchEvent`. Reloads of `llm` run in the
    iterating thread (vLLM's `LLM` is not thread-safe), between polls; stop by
    leaving the loop (`break`), which waits for server reloads in flight.

    Args:
        root: the directory the trainer writes one step directory into per step; a URL prefix of step folders
            (`s3://bucket/run/`, `gs://`, `az://`), found by listing and each loaded pinned at its objects'
            ETags; or a Hub repo id (`org/name`): each new commit of `revision=` (default: the default branch)
            is a step, named by its commit and reloaded at that commit.
        llm: a `vllm.LLM` built with `worker_extension_cls=layerwise_cli.EXTENSION_CLS`.
        urls: server base URLs (`layerwise serve` servers).
        options: a `WatchOptions`; or give its fields as keywords (`marker="STABLE", once=True`).

    Returns:
        An iterator of events; with `once=True` it ends when every target holds the newest
        complete step, and raises `LayerwiseError` if that could not be done.

    Example:
        for event in layerwise_cli.watch("/runs/exp1/weights", llm=llm, marker="STABLE"):
            print(event.line())
        for event in layerwise_cli.watch("org/model", urls=[url_a, url_b], revision="main"):
            print(event.line())
    """
    if options is None:
        options = WatchOptions(**option_values)
    elif option_values:
        raise UsageError("give either options= or option keywords, not both")
    targets: list[Target] = []
    if llm is not None:
        targets.append(EngineTarget(llm, verify=options.verify, options=options.reload_options()))
    targets.extend(server_targets(list(urls or []), options))
    watcher = Watcher(root, targets, options)
    yield from watcher.run()
    if watcher.failure is not None:
        raise LayerwiseError(watcher.failure)


__all__ = ["HOLDS_NEW", "WatchEvent", "WatchOptions", "Watcher", "server_targets", "watch"]
