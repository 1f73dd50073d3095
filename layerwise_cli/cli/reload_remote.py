"""`layerwise reload --url`: reload running vLLM servers over HTTP and show what each did."""

from __future__ import annotations

import threading
from dataclasses import replace

from rich.markup import escape
from rich.table import Table

from layerwise_cli.cli._output import print_json, report_error, stderr, stdout
from layerwise_cli.cli._reload_view import render_report, render_verify, source_label
from layerwise_cli.client.delivery import plan_operation
from layerwise_cli.client.servers.api import HOLDS_NEW, RemoteOptions
from layerwise_cli.client.servers.events import (
    Checked,
    GoingBack,
    Paused,
    Preflighted,
    Reloaded,
    ReloadedBack,
    Resumed,
    ServerEvent,
    Verified,
    Versioned,
)
from layerwise_cli.client.servers.fleet import all_or_nothing
from layerwise_cli.client.servers.reload_servers import ServerResult, holdings, reload_servers
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.units import human_seconds

_HOLDS_TEXT = {
    HOLDS_NEW: "new weights",
    "previous": "previous weights",
    "unverified": "UNVERIFIED (differs)",
    "unknown": "UNKNOWN",
    "mixed": "MIXED (engines differ)",
}


def _event_line(event: ServerEvent, as_json: bool) -> str | None:
    """The stderr line for one server's EVENT (None: nothing to say; with --json, only the fallback warning)."""
    where = escape(event.url)
    match event:
        case Checked(method="vllm", fallback_reason=reason):
            # A warning, not progress: also with --json.
            return (f"[yellow]Warning:[/] {where}: {escape(str(reason))}; falling back to vLLM's own "
                    "reload_weights: per-layer figures are unavailable (vLLM reports none; only the wall time "
                    "is measured)")
        case _ if as_json:
            return None
        case Paused(mode=mode):
            return f"{where}: generation paused ({mode})"
        case Reloaded(report=report):
            return f"{where}: reloaded in {human_seconds(report.wall_s)}"
        case Verified(verify=verify):
            return f"{where}: " + ("verified" if verify.ok else "[red]verify found differences[/]")
        case Versioned(version=version):
            return f"{where}: weight version set to {escape(version)}"
        case Preflighted():
            return f"{where}: pre-flight passed"
        case GoingBack(source=source, because=because):
            return f"{where}: [yellow]reloading it back[/] to {escape(source)} ({escape(because)})"
        case ReloadedBack(source=source):
            return f"{where}: reloaded back to {escape(source)}"
        case Resumed(paused_s=paused_s):
            return f"{where}: generation resumed after {human_seconds(paused_s)} paused"
    return None


def reload_remote(urls: list[str], source: str, options: RemoteOptions, as_json: bool = False,
                  top: int = 0, atomic: bool | None = None) -> int:
    """Reload SOURCE into every server, print one report per server and the verdict.

    Returns:
        The exit code: 0 when every server took SOURCE (and verified, when
        asked), 1 otherwise.
    """
    lock = threading.Lock()

    def on_event(event: ServerEvent) -> None:
        with lock:
            line = _event_line(event, as_json)
            if line is not None:
                stderr.print(line)

    # One commit per operation: a Hub repo id's revision is resolved here, once, before any server is
    # pre-flighted; every server, the verification and a fleet going back read that commit.
    reload_options, pin = plan_operation(source, options.reload)
    options = replace(options, reload=reload_options)
    atomic = all_or_nothing(atomic, len(urls))
    if not as_json:
        rule = ", all or nothing" if atomic and len(urls) > 1 else ""
        stderr.print(f"Reloading {escape(str(pin or source))} into {len(urls)} server(s){rule} ...")
    results = reload_servers(urls, source, options, on_event=on_event, atomic=atomic)
    ok = all(result.ok for result in results)
    if as_json:
        print_json({"ok": ok, "source": source, "commit": pin.commit if pin else None, "atomic": atomic,
                    "servers": [result.to_dict() for result in results],
                    "holdings": holdings(results, source)})
    else:
        for result in results:
            _render_server(result, top)
        _render_summary(results)
    for result in results:
        for warning in result.warnings:
            stderr.print(f"[yellow]Warning:[/] {escape(result.url)}: {escape(warning)}")
    for result in results:
        if result.error:
            report_error(LayerwiseError(result.error, where=result.url))
    if not ok:
        # Say where every server stands, the failed ones included.
        for line in holdings(results, source):
            stderr.print(escape(line), soft_wrap=True)
    return 0 if ok else 1


def _render_server(result: ServerResult, top: int) -> None:
    if result.report is not None and result.method == "layerwise":
        render_report(result.report, title=f"{result.url} reload {source_label(result.report.placement)}", top=top)
    if result.verify is not None:
        render_verify(result.verify, result.url)


def _render_summary(results: list[ServerResult]) -> None:
    table = Table(title="Servers", title_justify="left")
    table.add_column("server", overflow="fold")
    table.add_column("result")
    table.add_column("method")
    table.add_column("reload", justify="right")
    table.add_column("paused", justify="right")
    table.add_column("holds")
    table.add_column("weight version")
    for result in results:
        state = ("[green]ok[/]" if result.ok else "[yellow]reloaded back[/]" if _went_back(result)
                 else "[yellow]not changed[/]" if result.left_alone else f"[red]failed at {result.stage}[/]"
                 + (", reloaded back" if result.reloaded_back else ""))
        reload_s = human_seconds(result.report.wall_s) if result.report is not None else "-"
        table.add_row(escape(result.url), state, "layerwise" if result.method == "layerwise" else "vLLM reload_weights",
                      reload_s, human_seconds(result.paused_s) if result.paused_s else "-",
                      _HOLDS_TEXT.get(result.holds, result.holds),
                      escape(str(result.version_after)) if result.version_after is not None else "-")
    stdout.print(table)
    failed = sum(1 for result in results if not result.ok and not _went_back(result) and not result.left_alone)
    back = sum(1 for result in results if result.reloaded_back)
    alone = sum(1 for result in results if result.left_alone)
    if not failed and not back and not alone:
        stdout.print(f"All {len(results)} server(s) reloaded.")
        return
    others = [f"{back} reloaded back to their previous weights" if back else "",
              f"{alone} left as they were" if alone else ""]
    tail = "; ".join(part for part in others if part)
    stdout.print(f"{failed} of {len(results)} server(s) failed" + (f"; {tail}." if tail else "."))


def _went_back(result: ServerResult) -> bool:
    """Reloaded back whole, for another server's failure (it did not fail itself)."""
    return result.stage == "back" and result.reloaded_back
