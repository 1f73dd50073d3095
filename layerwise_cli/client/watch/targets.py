"""What `watch` keeps up to date: servers over HTTP, or an engine in this process."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from layerwise_cli.client.engine.in_process import ask_workers, reports_from_results, verify_engine
from layerwise_cli.client.servers.api import HOLDS_NEW, HOLDS_PREVIOUS, HOLDS_UNKNOWN, RemoteOptions, ServerClient
from layerwise_cli.client.servers.fleet import reload_fleet
from layerwise_cli.client.servers.reload import ServerReload
from layerwise_cli.client.servers.reload_servers import reload_server
from layerwise_cli.errors import describe_exception, one_line
from layerwise_cli.report.verify_result import verify_failure
from layerwise_cli.worker.rpc import ReloadAnswer, ReloadCall, ReloadOptions


class TargetDown(Exception):
    """The target did not answer at all (connection refused, no route, timeout)."""


@dataclass(frozen=True)
class Outcome:
    """What one reload did to one target."""

    ok: bool
    # HOLDS_NEW, HOLDS_PREVIOUS, HOLDS_UNVERIFIED or HOLDS_UNKNOWN (see client/servers/api.py).
    holds: str
    error: str | None = None
    # The step failed inside the reload itself (pre-flight, a shard, --verify), not the server around it.
    failed_in_reload: bool = False
    reached: bool = True
    version: str | None = None
    wall_s: float | None = None
    peak_bytes: int | None = None
    paused_s: float | None = None
    report: dict[str, Any] = field(default_factory=dict)


class Target(Protocol):
    """Something that holds weights and can reload a step (a directory, or a Hub repo's commit)."""

    name: str
    # Reloads and probes may run in a thread of their own (servers); an in-process engine runs them inline.
    threaded: bool

    def weight_version(self) -> str | None:
        """The weight version it holds now. Raises TargetDown when it does not answer."""

    def reload(self, source: str, version: str, revision: str | None = None) -> Outcome:
        """Load SOURCE (a step's path; a Hub repo id read at the commit REVISION; a step's URL read at the pin
        REVISION, `etags:...`) and name it VERSION.

        Never raises for a failed reload.
        """


class ServerTarget:
    """A vLLM server started with `layerwise serve` (or with the dev endpoints on)."""

    threaded = True

    def __init__(self, url: str, options: RemoteOptions) -> None:
        self.name = url.rstrip("/")
        self.url = url
        self.options = options

    def weight_version(self) -> str | None:
        client = ServerClient(self.url, api_key=self.options.api_key, timeout=min(self.options.timeout, 30.0))
        try:
            return client.weight_version()
        except Exception as exc:
            if not client.reached:
                raise TargetDown(one_line(str(exc))) from None
            raise
        finally:
            client.close()

    def reload(self, source: str, version: str, revision: str | None = None) -> Outcome:
        """Reload SOURCE into this server alone; a pinned source (REVISION) is pre-flighted first (`_fetch_first`)."""
        options = _step_options(self.options, version, revision)
        if revision is not None:
            return outcome_of(_fetch_first(self.url, source, options))
        return outcome_of(reload_server(self.url, source, options))


def reload_together(targets: list[ServerTarget], source: str, version: str,
                    revision: str | None = None) -> dict[str, Outcome]:
    """Reload SOURCE (at REVISION) into every server of TARGETS all or nothing (`client/servers/fleet.py`).

    Returns:
        Each target's name -> its outcome.
    """
    options = _step_options(targets[0].options, version, revision)
    results = reload_fleet([target.url for target in targets], source, options)
    return {target.name: outcome_of(result) for target, result in zip(targets, results)}


def _step_options(options: RemoteOptions, version: str, revision: str | None) -> RemoteOptions:
    """OPTIONS for one step: its weight version, and the commit (or a URL step's pin) it is read at (None: a
    folder step)."""
    reload = replace(options.reload, revision=revision) if revision is not None else options.reload
    return replace(options, weight_version=version, reload=reload)


def _fetch_first(url: str, source: str, options: RemoteOptions):
    """One server's reload of a pinned source (a Hub commit, a URL step's ETags) with its pre-flight first, as a
    fleet's: the fetch before the pause.

    A server without layerwise's worker extension is left as it is: vLLM's own `reload_weights` would read
    whatever the branch names by then, not the commit, which the server's weight version would then name (and
    it reads no URL at all).
    """
    run = ServerReload(url, source, options)
    try:
        if run.check():
            if run.method != "layerwise":
                run.refuse("loading a pinned source (a Hub commit, a URL's ETags) needs layerwise's worker "
                           f"extension, and {run.fallback_reason} (start it with `layerwise serve`)")
            elif run.preflight():
                run.change()
    finally:
        result = run.finish()
    return result


def outcome_of(result) -> Outcome:
    """A server's `ServerResult` as a watch outcome."""
    report = result.report
    # A server that died during its reload is down, and the step not to blame; nor is it for a server a fleet
    # left alone or reloaded back (another server failed).
    own = result.stage in ("preflight", "reload", "verify") and result.answering and not result.left_alone
    return Outcome(ok=result.ok, holds=result.holds, error=result.error, failed_in_reload=own,
                   reached=result.reached and result.answering, version=result.version_after,
                   wall_s=report.wall_s if report else None,
                   peak_bytes=report.peak_buffer_bytes if report else None,
                   paused_s=result.paused_s or None, report=result.to_dict())


class EngineTarget:
    """A `vllm.LLM` in this process, built with layerwise's worker extension (a trainer-colocated engine)."""

    threaded = False  # vllm.LLM is not thread-safe: reload where the caller iterates
    name = "engine"

    def __init__(self, llm, *, verify: bool = False, options: ReloadOptions | None = None) -> None:
        self.llm = llm
        self.verify = verify
        self.options = options or ReloadOptions()

    def weight_version(self) -> str | None:
        return self.llm.get_weight_version()

    def reload(self, source: str, version: str, revision: str | None = None) -> Outcome:
        start = time.perf_counter()
        options = replace(self.options, revision=revision) if revision is not None else self.options
        try:
            results = ask_workers(self.llm, ReloadCall(source=source, options=options))
        except Exception as exc:  # noqa: BLE001 - one line, like a server's failure
            return Outcome(ok=False, holds=HOLDS_UNKNOWN, error=one_line(str(describe_exception(exc))),
                           failed_in_reload=True)
        failures = [a for a in map(ReloadAnswer.from_json, results) if not a.ok]
        if failures:
            touched = any(a.engine_touched for a in failures)
            rolled_back = all(a.rolled_back for a in failures if a.engine_touched)
            holds = HOLDS_PREVIOUS if not touched or rolled_back else HOLDS_UNKNOWN
            return Outcome(ok=False, holds=holds, error=one_line(failures[0].error or "a worker failed"),
                           failed_in_reload=True, version=self.llm.get_weight_version(),
                           report={"results": [{k: v for k, v in r.items() if k != "traceback"} for r in results]})
        report = reports_from_results(results)
        self.llm.reset_prefix_cache()
        if self.verify:
            checked = verify_engine(self.llm, source, options.revision, allow_unchecked=options.allow_unchecked)
            if not checked.ok:
                return Outcome(ok=False, holds="unverified", error=verify_failure(checked), failed_in_reload=True,
                               version=self.llm.get_weight_version(), report={"report": report.to_dict()})
        self.llm.update_weight_version(version)
        return Outcome(ok=True, holds=HOLDS_NEW, version=version, wall_s=time.perf_counter() - start,
                       peak_bytes=report.peak_buffer_bytes, report={"report": report.to_dict()})


def call_caught(run: Callable[[], object]) -> tuple[bool, object]:
    """RUN's result as (True, value), or what it raised as (False, exception): the loop makes it an event."""
    try:
        return True, run()
    except Exception as exc:  # noqa: BLE001 - the loop turns it into an event
        return False, exc


def error_line(error: object) -> str:
    """An exception (or message) as one line, as `LayerwiseError` words a library's error."""
    return one_line(str(describe_exception(error) if isinstance(error, BaseException) else error))
