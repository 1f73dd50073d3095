"""Reload running vLLM servers over HTTP: check, pause, reload, verify, set the version, resume."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from layerwise_cli.client.pause_keeper import LeaseKeeper, step_done
from layerwise_cli.client.server_api import (
    HOLDS_MIXED,
    HOLDS_NEW,
    HOLDS_PREVIOUS,
    HOLDS_UNKNOWN,
    HOLDS_UNVERIFIED,
    PAUSE_MODES,
    RemoteOptions,
    ServerClient,
    _ServerError,
)
from layerwise_cli.errors import LayerwiseError, one_line
from layerwise_cli.report.jsonable import jsonable
from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.report.verify_result import VerifyResult, verify_failure
from layerwise_cli.worker.rpc import FingerprintsAnswer, FingerprintsCall

NO_LEASE_WARNING = ("this server has no pause lease (layerwise's vLLM plugin is not loaded in it): had this client "
                    "died while the server was paused, it would have stayed paused until POST /resume; start it "
                    "with `layerwise serve`, or install layerwise where it runs")


@dataclass(frozen=True)
class ServerResult:
    """What happened on one server; built once `reload_server` is done with it."""

    url: str
    ok: bool = False
    error: str | None = None
    # The last step reached: connect, check, pause, reload, verify, version, resume, done.
    stage: str = "connect"
    # layerwise: through the worker extension; vllm: vLLM's own reload_weights (no extension).
    method: str = "layerwise"
    fallback_reason: str | None = None
    report: ReloadReport | None = None
    verify: VerifyResult | None = None
    holds: str = HOLDS_PREVIOUS
    version_before: str | None = None
    version_after: str | None = None
    rolled_back: bool = False
    # Whether the server answered at all (a 401 counts).
    reached: bool = False
    paused_s: float = 0.0
    wall_s: float = 0.0
    warnings: tuple[str, ...] = ()
    # Data-parallel engines reached by the reload (each reported), and, after a failure, what each holds.
    engines: int = 1
    engine_holds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "warnings", tuple(self.warnings))
        object.__setattr__(self, "engine_holds", tuple(self.engine_holds))

    def to_dict(self) -> dict:
        """JSON-ready: the server's result with its report and verification (lists for sequences)."""
        data = jsonable(asdict(self))
        data["report"] = self.report.to_dict() if self.report is not None else None
        return data


def reload_servers(urls: list[str], source: str, options: RemoteOptions | None = None,
                   on_event: Callable[[str, str, dict], None] | None = None) -> list[ServerResult]:
    """Reload SOURCE into every server at once (one thread per server).

    Args:
        urls: server base URLs, e.g. `http://127.0.0.1:8000`.
        source: a checkpoint path as the servers see it, or a Hub repo id.
        options: how to reload (pause mode, version tag, API key, verify, timeout).
        on_event: called as `on_event(url, event, data)` from the server's
            thread at every step (`checked`, `paused`, `reloaded`, `verified`,
            `versioned`, `resumed`, `failed`), for progress output.

    Returns:
        One result per URL, in the order given. Never raises for a server's
        failure: it is in that server's result.
    """
    options = options or RemoteOptions()
    if options.pause_mode not in PAUSE_MODES:
        raise LayerwiseError(f"unknown pause mode {options.pause_mode!r}: use one of {', '.join(PAUSE_MODES)}")
    if len(set(urls)) != len(urls):
        from layerwise_cli.errors import UsageError

        raise UsageError("the same server URL is given twice")
    with ThreadPoolExecutor(max_workers=max(1, len(urls)), thread_name_prefix="layerwise-remote") as pool:
        return list(pool.map(lambda url: reload_server(url, source, options, on_event), urls))


def reload_server(url: str, source: str, options: RemoteOptions | None = None,
                  on_event: Callable[[str, str, dict], None] | None = None) -> ServerResult:
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
    options = options or RemoteOptions()
    emit = on_event or (lambda url, event, data: None)
    # What the result will say, gathered step by step; the result is built once, at the end.
    stage, method, fallback_reason = "connect", "layerwise", None
    report: ReloadReport | None = None
    verify: VerifyResult | None = None
    holds, rolled_back = HOLDS_PREVIOUS, False
    version_before: str | None = None
    version_after: str | None = None
    ok, error, paused_s = False, None, 0.0
    warnings: list[str] = []
    engines, engine_holds = 1, []
    start = time.perf_counter()
    client = ServerClient(url, api_key=options.api_key, timeout=options.timeout)
    paused_at: float | None = None
    keeper: LeaseKeeper | None = None
    try:
        # Few round trips before the pause: on a busy server each one waits behind the traffic.
        stage = "connect"
        client.check_api_key()  # also proves the server answers
        step_done(stage)
        stage = "check"
        version_before = client.weight_version()  # also proves the dev endpoints are on
        if client.is_paused():
            raise _ServerError("the server is already paused (another reload in progress, or paused by hand); "
                               "refusing to reload. A pause under layerwise's lease ends by itself; any other, "
                               "POST /resume to it if it is stale")
        extension = client.ping_extension()
        if extension is not None:
            method, fallback_reason = "vllm", extension
            if options.verify:
                raise _ServerError(f"--verify needs layerwise's worker extension, and {extension}; nothing was "
                                   "changed (start the server with `layerwise serve`, or drop --verify)")
            if options.revision:
                warnings.append("--revision is ignored by vLLM's own reload_weights")
            if not options.allow_nonfinite:
                warnings.append("vLLM's own reload_weights does not check tensors for NaN/Inf")
        else:
            engines = client.engines
            if client.engines_warning():
                warnings.append(client.engines_warning())
        emit(url, "checked", {"method": method, "fallback_reason": fallback_reason})
        step_done(stage)

        if options.pause_mode != "none":
            stage = "pause"
            # From here on, resume whatever happens: the engine pauses as soon as the request lands,
            # even if the answer (which waits for in-flight requests with `wait`) never reaches us.
            paused_at = time.perf_counter()
            if client.pause(options.pause_mode, options.pause_lease_s):
                keeper = LeaseKeeper(client, options.pause_lease_s)
            else:
                warnings.append(NO_LEASE_WARNING)
            emit(url, "paused", {"mode": options.pause_mode, "lease_s": options.pause_lease_s if keeper else None})
            step_done(stage)

        stage = "reload"
        report = (client.layerwise_reload(source, options) if method == "layerwise"
                  else client.vllm_reload(source, options.weight_version))
        holds = HOLDS_NEW
        warnings.extend(_reset_prefix_cache(client))
        emit(url, "reloaded", {"report": report})
        step_done(stage)

        if options.verify:
            stage = "verify"
            verify = client.verify(source, options.revision, allow_unchecked=options.allow_unchecked)
            emit(url, "verified", {"verify": verify})
            if not verify.ok:
                holds = HOLDS_UNVERIFIED
                raise _ServerError(verify_failure(verify), holds=HOLDS_UNVERIFIED)
            step_done(stage)

        if options.weight_version is not None:
            stage = "version"
            if not client.version_set_with_reload:  # else the server set it when the reload succeeded
                client.set_weight_version(options.weight_version)
            version_after = options.weight_version
            emit(url, "versioned", {"version": options.weight_version})
            step_done(stage)
        ok = True
    except _ServerError as exc:
        error = str(exc)
        rolled_back = exc.rolled_back
        engine_holds = list(exc.engines)
        if holds != HOLDS_UNVERIFIED:
            holds = exc.holds
    except Exception as exc:  # noqa: BLE001 - one line per server, never a traceback
        from layerwise_cli.errors import describe_exception

        error = one_line(str(describe_exception(exc)))
        if stage == "reload" and holds == HOLDS_PREVIOUS:
            holds = HOLDS_UNKNOWN
    finally:
        if keeper is not None:
            keeper.stop()
            if keeper.lost:
                warnings.append(f"its pause lease ran out while this client worked ({keeper.lost}): the server "
                                "resumed by itself; pass a longer --pause-lease")
        if paused_at is not None:
            try:
                client.resume()
                paused_s = time.perf_counter() - paused_at
                emit(url, "resumed", {"paused_s": paused_s})
                step_done("resume")
            except Exception as exc:  # noqa: BLE001 - reported, never raised past the other servers
                from layerwise_cli.errors import describe_exception

                message = (f"could not resume generation ({one_line(str(describe_exception(exc)))}): "
                           "the server may still be paused; POST /resume to it")
                if error is None:
                    stage = "resume"
                ok = False
                error = f"{error}; {message}" if error else message
        if ok and version_after is None:
            version_after = version_before
            if version_before not in (None, "default"):
                warnings.append(f"its weight version stays {version_before!r}, which named the "
                                "weights it held before; pass --weight-version TAG to name the new ones")
        elif not ok and client.reached:
            # After the resume: it costs the paused traffic nothing.
            version_after = client.weight_version_or_none()
        wall_s = time.perf_counter() - start
        client.close()
        if error:
            emit(url, "failed", {"error": error})
    return ServerResult(url=url, ok=ok, error=error, stage="done" if ok else stage, method=method,
                        fallback_reason=fallback_reason, report=report, verify=verify, holds=holds,
                        version_before=version_before, version_after=version_after, rolled_back=rolled_back,
                        reached=client.reached, paused_s=paused_s, wall_s=wall_s, warnings=tuple(warnings),
                        engines=engines, engine_holds=tuple(engine_holds))


def holdings(results: list[ServerResult], source: str) -> list[str]:
    """One line per server saying which weights (and version tag) it holds now."""
    lines = []
    for result in results:
        version = f" (weight version {result.version_after!r})" if result.version_after is not None else ""
        if result.holds == HOLDS_NEW:
            what = f"holds {source}{version}"
        elif result.holds == HOLDS_PREVIOUS and not result.reached:
            what = "not reached: not changed by this command"
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


def _reset_prefix_cache(client: ServerClient) -> list[str]:
    """Reset the server's prefix cache; the warnings to report if it could not be."""
    # KV blocks computed with the old weights must not serve prompts after the
    # reload; pause (wait/abort) already dropped them, keep and none did not.
    try:
        if not client.reset_prefix_cache():
            return ["the prefix cache could not be reset (blocks still held); cached prompt "
                    "prefixes may reuse KV computed with the previous weights"]
    except Exception as exc:  # noqa: BLE001 - a warning, not a failure
        return [f"the prefix cache could not be reset: {one_line(str(exc))}"]
    return []


