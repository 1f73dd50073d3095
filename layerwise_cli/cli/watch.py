"""`layerwise watch`: keep servers on the newest complete step of a training run (a folder, or a Hub repo's ref)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from layerwise_cli.checkpoint.sources import looks_like_repo_id
from layerwise_cli.checkpoint.store.objects import is_store_url
from layerwise_cli.cli._options import OUTPUT_PANEL, PROOF_PANEL, SERVERS_PANEL, ServersApiKeyOpt
from layerwise_cli.cli._output import handle_errors, report_error, stderr
from layerwise_cli.errors import LayerwiseError, UsageError, describe_exception
from layerwise_cli.units import human_bytes, human_seconds

STEPS_PANEL = "Steps"


# The command's arguments and options (--api-key is `reload --url`'s too), each declared once with its help.
_RootArg = Annotated[
    str,
    typer.Argument(help="Where the trainer writes its steps: a folder of step folders, a URL prefix of them "
                   "(s3://bucket/run/, gs://, az://), or a Hub repo id (org/name), each new commit a step.",
                   show_default=False),
]
_UrlOpt = Annotated[
    list[str],
    typer.Option("--url", metavar="URL", rich_help_panel=SERVERS_PANEL,
                 help="A server to keep on the newest step (repeatable).", show_default=False),
]
_PatternOpt = Annotated[
    list[str] | None,
    typer.Option("--pattern", metavar="GLOB", rich_help_panel=STEPS_PANEL, show_default=False,
                 help="Step folder names (repeatable; the step is the last integer in the name). Default: step_*, "
                 "step-*, global_step_*, checkpoint-*, iter_*."),
]
_MarkerOpt = Annotated[
    str,
    typer.Option("--marker", metavar="NAME|auto", rich_help_panel=STEPS_PANEL,
                 help="A step is complete once the file NAME (e.g. STABLE) is in it; auto: once its index and "
                 "shards are complete and unchanged for --settle seconds."),
]
_IntervalOpt = Annotated[
    float | None,
    typer.Option("--interval", min=0.05, metavar="SECONDS", rich_help_panel=STEPS_PANEL, show_default=False,
                 help="Seconds between two looks at ROOT (default 1; 10 for a URL prefix or a Hub repo)."),
]
_RevisionOpt = Annotated[
    str | None,
    typer.Option("--revision", metavar="REF", rich_help_panel=STEPS_PANEL, show_default=False,
                 help="With a Hub repo id: the branch or tag whose commits are the steps (default: main)."),
]
_SettleOpt = Annotated[
    float,
    typer.Option("--settle", min=0.0, metavar="SECONDS", rich_help_panel=STEPS_PANEL,
                 help="With --marker auto: seconds a step must stay unchanged to count as complete."),
]
_KeepOpt = Annotated[
    int | None,
    typer.Option("--keep", min=1, metavar="N", rich_help_panel=STEPS_PANEL, show_default=False,
                 help="Once every server holds the newest step, delete complete steps older than the newest N "
                 "(never one a server holds or needs). Default: delete nothing."),
]
_OnceOpt = Annotated[
    bool,
    typer.Option("--once", rich_help_panel=STEPS_PANEL,
                 help="Bring every server to the newest complete step, then exit (0 when all hold it)."),
]
_PauseModeOpt = Annotated[
    Literal["wait", "keep", "abort", "none"],
    typer.Option("--pause-mode", metavar="MODE", rich_help_panel=SERVERS_PANEL,
                 help="How generation pauses during each reload: wait, keep, abort or none "
                 "(docs/training-loops.md)."),
]
_PauseLeaseOpt = Annotated[
    float,
    typer.Option("--pause-lease", min=1.0, max=3600.0, metavar="SECONDS", rich_help_panel=SERVERS_PANEL,
                 help="A server with layerwise's pause lease resumes by itself this long after this command stops "
                 "renewing it."),
]
_TimeoutOpt = Annotated[
    float,
    typer.Option("--timeout", min=0.1, metavar="SECONDS", rich_help_panel=SERVERS_PANEL,
                 help="Seconds to wait for each request to a server, a reload included."),
]
_AtomicOpt = Annotated[
    bool | None,
    typer.Option("--atomic/--no-atomic", rich_help_panel=SERVERS_PANEL, show_default=False,
                 help="Each step all or nothing (the default with more than one --url): every server pre-flighted "
                 "first, those changed reloaded back if one fails."),
]
_VerifyOpt = Annotated[
    bool,
    typer.Option("--verify", rich_help_panel=PROOF_PANEL,
                 help="After each reload, check layer by layer that the server holds exactly the step's weights."),
]
_AllowUncheckedOpt = Annotated[
    bool,
    typer.Option("--allow-unchecked", rich_help_panel=PROOF_PANEL,
                 help="Accept, and list, what cannot be shown complete or checked, instead of failing the step on "
                 "that server."),
]
_LogOpt = Annotated[
    Path | None,
    typer.Option("--log", metavar="FILE.jsonl", rich_help_panel=OUTPUT_PANEL,
                 help="Append every event, with the full per-server report, to this file.", show_default=False),
]
_JsonOpt = Annotated[
    bool,
    typer.Option("--json", rich_help_panel=OUTPUT_PANEL,
                 help="Print one JSON object per event on stdout; no live status."),
]
# The events a live status table prints above itself: those a reader should still see once the table moved on.
_KEPT_EVENTS = ("reload_failed", "step_skipped", "server_down", "server_back", "step_deleted", "source_down",
                "source_back")


@handle_errors
def watch_command(
    root: _RootArg,
    url: _UrlOpt,
    pattern: _PatternOpt = None,
    marker: _MarkerOpt = "auto",
    interval: _IntervalOpt = None,
    revision: _RevisionOpt = None,
    settle: _SettleOpt = 2.0,
    keep: _KeepOpt = None,
    once: _OnceOpt = False,
    pause_mode: _PauseModeOpt = "wait",
    pause_lease: _PauseLeaseOpt = 60.0,
    api_key: ServersApiKeyOpt = None,
    timeout: _TimeoutOpt = 600.0,
    atomic: _AtomicOpt = None,
    verify: _VerifyOpt = False,
    allow_unchecked: _AllowUncheckedOpt = False,
    log: _LogOpt = None,
    as_json: _JsonOpt = False,
) -> None:
    """Keep servers on the newest complete step of a training run, reloading each new one.

    Lists ROOT every --interval seconds, picks the newest complete step
    directory and reloads it into every server that does not hold it yet
    (a server's weight version is the step's directory name, so a restarted
    watch reloads nothing that is current). Broken steps are reported once and
    skipped; a server that stops answering is retried and brought up to date
    when it returns. With several servers, each step is loaded all or nothing
    (--atomic): the fleet serves two versions for no longer than one reload.
    Ctrl-C or SIGTERM lets a running reload finish (no server is left paused)
    and exits 0.

    ROOT may be a URL prefix (s3://bucket/run/, gs://..., az://...): its step
    folders are found by listing the store, complete by --marker or by a
    complete index, and each is loaded pinned at its objects' ETags.

    ROOT may be a Hub repo id (org/name): each new commit of --revision
    (default: main) is a step, named by its commit and loaded
    at that commit (never the branch); the servers fetch it while they still
    serve. --marker, --pattern and --keep apply to a local root or a URL prefix.

    Example: layerwise watch /runs/exp1/weights --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 --keep 3

    Every option, and what --keep never deletes: docs/commands/watch.md.
    """
    from layerwise_cli.client.watch.entry import Watcher, WatchOptions, server_targets  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    options = WatchOptions(patterns=tuple(pattern) if pattern else WatchOptions().patterns, marker=marker,
                           interval=interval, settle=settle, keep=keep, once=once, pause_mode=pause_mode,
                           pause_lease_s=pause_lease, api_key=api_key, verify=verify,
                           allow_unchecked=allow_unchecked, timeout=timeout, atomic=atomic, revision=revision)
    _check_root(root, marker)
    watcher = Watcher(root, server_targets(url, options), options)
    log_file = _open_log(log)

    def stop(signum, frame) -> None:
        watcher.stop()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    live = None if as_json or not stderr.is_terminal else Live(_status(watcher), console=stderr,
                                                               refresh_per_second=4, transient=False)
    try:
        if live is not None:
            live.start()
        for event in watcher.run():
            _show_event(event, watcher, live, log_file, as_json=as_json)
    finally:
        if live is not None:
            live.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if log_file is not None:
            log_file.close()
    if watcher.failure is not None:
        report_error(LayerwiseError(watcher.failure))
        raise typer.Exit(1)


def _check_root(root: str, marker: str) -> None:
    """Refuse a ROOT that is no folder, URL prefix or Hub repo, and a --marker that is no plain file name.

    Raises:
        LayerwiseError: no such ROOT.
        UsageError: a bad --marker.
    """
    from layerwise_cli.checkpoint.steps.hub_run import is_hub_run  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    if not Path(root).is_dir() and not looks_like_repo_id(root) and not is_store_url(root) and not is_hub_run(root):
        raise LayerwiseError("no such directory (the root the trainer writes steps into)", where=root)
    if marker != "auto" and ("/" in marker or marker in ("", ".", "..")):
        raise UsageError(f"--marker must be a file name or auto, not {marker!r}")


def _show_event(event, watcher, live: Live | None, log_file, *, as_json: bool) -> None:
    """Append EVENT, with its full report, to the --log file, and show it.

    With --json, one JSON object on stdout; on a terminal, the live status
    table refreshed (and the line printed above it for the events a reader
    must still see, `_KEPT_EVENTS`); otherwise one line on stderr.
    """
    if log_file is not None:
        log_file.write(json.dumps(event.to_dict(full=True), default=str) + "\n")
        log_file.flush()
    if as_json:
        sys.stdout.write(json.dumps(event.to_dict(), default=str) + "\n")
        sys.stdout.flush()
    elif live is not None:
        live.update(_status(watcher))
        if event.kind in _KEPT_EVENTS:
            live.console.print(escape(event.line()))
    else:
        stderr.print(escape(event.line()), soft_wrap=True)


def _open_log(path: Path | None):
    if path is None:
        return None
    try:
        return path.open("a", encoding="utf-8")
    except OSError as exc:
        raise describe_exception(exc, where=str(path)) from exc


def _status(watcher) -> Group:
    from layerwise_cli.client.watch.events import short  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    state = watcher.state
    # The heading is a line of its own, wrapped at the terminal's width: a table's title wraps at the table's,
    # which a long watched path would cut in the middle of "newest step ...".
    seen_word, target_word = watcher.source.heading_words
    heading = Text(f"watch {watcher.where}: newest {seen_word} {short(state.newest_seen) or '-'}, "
                   f"{target_word} {short(state.target) or '-'}")
    table = Table()
    table.add_column("server", overflow="fold")
    table.add_column("state")
    table.add_column("holds")
    table.add_column("last reload", justify="right")
    table.add_column("peak", justify="right")
    for name, server in state.servers.items():
        if server["up"] is False:
            what = "[red]down[/]"
        elif server["busy"]:
            what = f"loading {escape(short(server['busy']))}"
        elif server["version"] == state.target:
            what = "[green]current[/]"
        else:
            what = "behind"
        table.add_row(escape(name), what, escape(str(short(server["version"]) or "-")),
                      human_seconds(server["wall_s"]) if server["wall_s"] is not None else "-",
                      human_bytes(server["peak_bytes"]) if server["peak_bytes"] is not None else "-")
    return Group(heading, table)
