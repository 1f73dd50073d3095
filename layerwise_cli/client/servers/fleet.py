"""All-or-nothing updates of several servers: every server pre-flighted before any is paused, and put back together.

The rule (`layerwise reload --atomic`, the default for more than one `--url`; `watch` too):

1. Check and pre-flight every server (`ServerReload.check`, `.preflight`): the
   worker plans SOURCE against its engine and says where the weights it holds
   came from. Any refusal: no server is paused, none changes.
2. Change every server at once (pause, reload, verify, version), but resume
   none yet.
3. If any failed (a shard that broke mid-stream, a server killed, --verify),
   every server that may have changed is reloaded back to what it held (its
   previous source, under its previous weight version).
4. Resume every server. Paused traffic never sees two versions; the fleet
   serves one version before and one after.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from layerwise_cli.client.servers.api import RemoteOptions
from layerwise_cli.client.servers.events import OnEvent
from layerwise_cli.client.servers.reload import ServerReload, ServerResult


def reload_fleet(urls: list[str], source: str, options: RemoteOptions,
                 on_event: OnEvent | None = None) -> list[ServerResult]:
    """Reload SOURCE into every server, all or nothing (see the module's rule); one result per URL, in order.

    Never raises for a server's failure: each result says what that server holds now, and why.
    """
    runs = [ServerReload(url, source, options, on_event) for url in urls]
    with ThreadPoolExecutor(max_workers=max(1, len(runs)), thread_name_prefix="layerwise-fleet") as pool:

        def on_each(step: Callable[[ServerReload], object], chosen: list[ServerReload]) -> None:
            list(pool.map(step, chosen))

        try:
            on_each(lambda run: run.check() and run.preflight(), runs)
            refused = [run for run in runs if run.failed]
            if refused:
                because = _because(refused, "before any server changed")
                for run in runs:
                    run.refuse(because)
            else:
                on_each(ServerReload.change, runs)
                failed = [run for run in runs if not run.changed_ok]
                if failed:
                    because = _because(failed, "after the servers began to change")
                    on_each(lambda run: run.go_back(because), [run for run in runs if run.may_have_changed])
        finally:
            # Resumed only now, all of them: also after an interruption.
            results = list(pool.map(ServerReload.finish, runs))
    return results


def all_or_nothing(atomic: bool | None, servers: int) -> bool:
    """Whether an update of SERVERS servers is all or nothing: `--atomic`/`--no-atomic`, else when there are several."""
    return atomic if atomic is not None else servers > 1


def _because(runs: list[ServerReload], when: str) -> str:
    first = runs[0]
    more = f" (and {len(runs) - 1} more)" if len(runs) > 1 else ""
    return f"{first.url} failed at {first.stage}{more} {when}, so no server may change (--atomic)"
