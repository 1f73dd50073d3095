"""Reload running vLLM servers over HTTP: check, pause, reload, verify, set the version, resume."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from layerwise_cli.client.delivery import plan_operation
from layerwise_cli.client.servers.api import (
    HOLDS_MIXED,
    HOLDS_NEW,
    HOLDS_PREVIOUS,
    HOLDS_UNVERIFIED,
    PAUSE_MODES,
    RemoteOptions,
    ServerClient,
)
from layerwise_cli.client.servers.events import OnEvent
from layerwise_cli.client.servers.fleet import all_or_nothing, reload_fleet
from layerwise_cli.client.servers.reload import NO_LEASE_WARNING, ServerReload, ServerResult
from layerwise_cli.errors import LayerwiseError, UsageError
from layerwise_cli.worker.rpc import FingerprintsAnswer, FingerprintsCall

__all__ = ["NO_LEASE_WARNING", "RemoteOptions", "ServerResult", "differing_layers", "holdings", "reload_server",
           "reload_servers", "server_fingerprints"]


def reload_servers(urls: list[str], source: str, options: RemoteOptions | None = None,
                   on_event: OnEvent | None = None,
                   atomic: bool | None = None) -> list[ServerResult]:
    """Reload SOURCE into every server at once (one thread per server).

    All or nothing (`atomic`, the default for more than one server): every
    server is checked and pre-flighted before any is paused; if one fails
    after others changed, those are reloaded back to what they held, and all
    resume only then (`client/servers/fleet.py`). Otherwise each server on its own.

    Args:
        urls: server base URLs, e.g. `http://127.0.0.1:8000`.
        source: a checkpoint path as the servers see it, or a Hub repo id (its revision is resolved to a
            commit first, and every server, pre-flight, verification and reload-back reads that commit).
        options: how to reload (pause mode, version tag, API key, verify, timeout).
        on_event: called with a typed `ServerEvent` (`client/servers/events.py`) from the server's thread at
            every step (`Checked`, `Paused`, `Reloaded`, `Verified`, `Versioned`, `Resumed`, `Failed`; a fleet
            also `Preflighted`, `GoingBack`, `ReloadedBack`), for progress output.
        atomic: all or nothing across the servers; None: when there is more than one.

    Returns:
        One result per URL, in the order given. Never raises for a server's
        failure: it is in that server's result.
    """
    options = options or RemoteOptions()
    if options.pause_mode not in PAUSE_MODES:
        raise LayerwiseError(f"unknown pause mode {options.pause_mode!r}: use one of {', '.join(PAUSE_MODES)}")
    if len(set(urls)) != len(urls):
        raise UsageError("the same server URL is given twice")
    # One commit per operation: every server reads the commit a Hub repo id's revision names now (no request
    # when the caller pinned it already).
    options = replace(options, reload=plan_operation(source, options.reload)[0])

    if all_or_nothing(atomic, len(urls)):
        return reload_fleet(urls, source, options, on_event)
    with ThreadPoolExecutor(max_workers=max(1, len(urls)), thread_name_prefix="layerwise-remote") as pool:
        return list(pool.map(lambda url: reload_server(url, source, options, on_event), urls))


def reload_server(url: str, source: str, options: RemoteOptions | None = None,
                  on_event: OnEvent | None = None) -> ServerResult:
    """Check, pause, reload, verify, set the version and resume one server.

    Nothing on the server changes until it answered, the API key is accepted,
    the dev endpoints are on, and it is not already paused. Generation is
    resumed in every case once it was paused, also after a failure.

    Args:
        url: the server's base URL.
        source: a checkpoint path as the server sees it, or a Hub repo id.
        options: see `RemoteOptions`.
        on_event: see `reload_servers`.

    Returns:
        The server's result (`ok`, `error` as one line, `holds`).
    """
    run = ServerReload(url, source, options or RemoteOptions(), on_event)
    try:
        if run.check():
            run.change()
    finally:
        result = run.finish()
    return result


def holdings(results: list[ServerResult], source: str) -> list[str]:
    """One line per server saying which weights (and version tag) it holds now."""
    lines = []
    for result in results:
        version = f" (weight version {result.version_after!r})" if result.version_after is not None else ""
        if result.holds == HOLDS_NEW:
            what = f"holds {source}{version}"
        elif result.holds == HOLDS_PREVIOUS and not result.reached:
            what = "not reached: not changed by this command"
        elif result.holds == HOLDS_PREVIOUS and result.reloaded_back:
            what = f"reloaded back: holds its previous weights{version}"
        elif result.holds == HOLDS_PREVIOUS and result.rolled_back:
            what = f"rolled back: holds its previous weights{version}"
        elif result.holds == HOLDS_PREVIOUS:
            what = f"not changed: holds its previous weights{version}"
        elif result.holds == HOLDS_MIXED:
            what = f"engines differ: {', '.join(result.engine_holds)}"
        elif result.holds == HOLDS_UNVERIFIED:
            what = f"holds weights that differ from {source} in the layers --verify named{version}"
        else:
            what = f"holds unknown weights: the reload may have changed some layers{version}"
        lines.append(f"{result.url}: {what}")
    return lines


def server_fingerprints(url: str, api_key: str | None = None, timeout: float = 600.0) -> dict[str, str]:
    """The extension's fingerprints of a server's weights (qualified by rank, and engine, when there are several)."""
    client = ServerClient(url, api_key=api_key, timeout=timeout)
    try:
        engines = client.ask(FingerprintsCall())
    finally:
        client.close()
    out: dict[str, str] = {}
    for engine, results in enumerate(engines):
        for rank, item in enumerate(results):
            where = f"engine {engine} worker {rank}" if len(engines) > 1 else f"worker {rank}"
            answer = FingerprintsAnswer.from_json(item)
            if not answer.ok:
                error = answer.error if isinstance(item, dict) else item
                raise LayerwiseError(f"fingerprints failed on {where}: {error}", where=url)
            prefix = (f"engine{engine}:" if len(engines) > 1 else "") + (f"rank{rank}:" if len(results) > 1 else "")
            out.update({prefix + name: digest for name, digest in answer.fingerprints.items()})
    return out


def differing_layers(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The modules whose fingerprints differ between two fingerprint maps (sorted)."""
    keys = ours.keys() | theirs.keys()
    return sorted({_module_of(key) for key in keys if ours.get(key) != theirs.get(key)})


def _module_of(key: str) -> str:
    return key.rsplit("#", 1)[0].rstrip(".") if "#" in key else key.rpartition(".")[0]
