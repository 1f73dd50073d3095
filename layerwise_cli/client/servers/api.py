"""The HTTP calls layerwise makes to one vLLM server (its dev-mode endpoints), and what a failure leaves behind."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from layerwise_cli import ENGINES_RPC_PATH, PAUSE_LEASE_PATH, RENEW_LEASE_PATH, RESUME_LEASE_PATH, vllm_compat
from layerwise_cli.client.servers.http_text import error_text as _error_text
from layerwise_cli.client.servers.http_text import excerpt as _excerpt
from layerwise_cli.errors import LayerwiseError, one_line
from layerwise_cli.report.reload_report import ReloadReport, first_failure, merge_reports
from layerwise_cli.report.sections import Findings, Memory, Placement, Timings, Volume
from layerwise_cli.report.verify_result import VerifyResult, merge_verify
from layerwise_cli.worker import rpc
from layerwise_cli.worker.rpc import (
    PingAnswer,
    PingCall,
    ReloadAnswer,
    ReloadCall,
    ReloadOptions,
    VerifyAnswer,
    VerifyCall,
)

PAUSE_MODES = ("wait", "keep", "abort", "none")

# What a server holds after `reload_server`, as far as the tool can tell.
HOLDS_NEW = "new"  # SOURCE, loaded (and verified, when asked)
HOLDS_PREVIOUS = "previous"  # the weights it had before: nothing changed, or rolled back
HOLDS_UNVERIFIED = "unverified"  # loaded, but --verify found layers that differ from SOURCE
HOLDS_UNKNOWN = "unknown"  # the reload may have changed some layers (timeout, lost connection, fallback failure)
HOLDS_MIXED = "mixed"  # data-parallel engines differ: some hold SOURCE, others their previous weights

# The longest wait for the small requests (checks, resume, version), whatever --timeout says.
_SHORT_TIMEOUT_S = 30.0


@dataclass
class RemoteOptions:
    """How to reach and pause each server, around the reload its workers run as `reload` says (`--url`)."""

    # How the servers' workers reload (the same options as in process); `allow_unchecked` also accepts the
    # layers `verify` could not check.
    reload: ReloadOptions = field(default_factory=ReloadOptions)
    # wait: let in-flight requests finish, queue new ones; keep: freeze in-flight
    # requests and continue them after the reload; abort: abort in-flight
    # requests; none: do not pause.
    pause_mode: str = "wait"
    weight_version: str | None = None
    api_key: str | None = None
    verify: bool = False
    # Seconds for each request to a server (the reload and the pause included).
    timeout: float = 600.0
    # Seconds a server with layerwise's pause lease stays paused after this client stops renewing it (it dies).
    pause_lease_s: float = 60.0


class _ServerError(LayerwiseError):
    """A failed step on one server; `holds` says what the server holds afterwards."""

    def __init__(self, message: str, *, holds: str = HOLDS_PREVIOUS, rolled_back: bool = False,
                 engines: list[str] | None = None) -> None:
        super().__init__(message)
        self.holds = holds
        self.rolled_back = rolled_back
        # With several data-parallel engines: what each holds ("engine 0 holds SOURCE", ...).
        self.engines = engines or []


class ServerClient:
    """The HTTP calls `reload_server` makes to one vLLM server (dev mode endpoints)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        import httpx  # noqa: PLC0415 - httpx: 0.13 s to import, only for a server call

        self.url = url.rstrip("/")
        self.timeout = timeout
        self.reached = False
        # Whether the server answers per data-parallel engine (None: not asked yet); engines seen, dp size.
        self.per_engine: bool | None = None
        self.engines = 1
        self.dp_size = 1
        # The pause lease this client holds on the server (`server/pause_lease.py`), if any.
        self.lease_token: str | None = None
        # Whether the server set the weight version itself, with the reload (`engines_rpc`'s `weight_version`).
        self.version_set_with_reload = False
        # Whether the server reset its prefix cache with the last reload (None: it was not asked, or cannot).
        self.prefix_cache_reset_with_reload: bool | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A fresh connection per request: vLLM's server drops a connection after a failed handler (500),
        # and a pooled connection would then fail the next call (the resume, say) with a reset.
        self._http = httpx.Client(base_url=self.url, headers=headers, limits=httpx.Limits(max_keepalive_connections=0),
                                  timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)))

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, *, short: bool = False, what: str | None = None,
                 **kwargs: Any):
        import httpx  # noqa: PLC0415 - httpx: 0.13 s to import, only for a server call

        what = what or f"{method} {path}"
        timeout = min(self.timeout, _SHORT_TIMEOUT_S) if short else self.timeout
        try:
            response = self._http.request(method, path, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                          **kwargs)
        except httpx.ConnectError as exc:
            raise _ServerError(f"cannot connect ({one_line(str(exc)) or 'connection refused'}); is the "
                               "server running at this address?") from None
        except httpx.TimeoutException:
            raise _ServerError(f"no answer to {what} within {timeout:g} s (--timeout)") from None
        except httpx.HTTPError as exc:
            raise _ServerError(f"{what} failed: {one_line(str(exc)) or type(exc).__name__}") from None
        self.reached = True
        if response.status_code == 401:
            raise _ServerError(f"unauthorized (401) on {path}: the server wants an API key; pass the right one "
                               "with --api-key or LAYERWISE_API_KEY")
        return response

    def _json(self, response, what: str) -> Any:
        if response.status_code >= 400:
            raise _ServerError(f"{what} failed: HTTP {response.status_code}: {_error_text(response)}")
        try:
            return response.json()
        except ValueError:
            raise _ServerError(f"{what} answered with something that is not JSON: {_excerpt(response)}") from None

    def check_api_key(self) -> None:
        # vLLM checks the key only on /v1 routes: ask one, so that a wrong key
        # fails here, before anything changes, even on servers whose dev
        # endpoints take no key.
        response = self._request("GET", "/v1/models", short=True)
        self._json(response, "GET /v1/models")

    def weight_version(self) -> str | None:
        response = self._request("GET", "/weight_info", short=True)
        if response.status_code == 404:
            raise _ServerError("the dev endpoints are off (404 on /weight_info): start the server with "
                               "VLLM_SERVER_DEV_MODE=1 (`layerwise serve` does)")
        return self._json(response, "GET /weight_info").get("weight_version")

    def answers(self) -> bool:
        """Whether the server answers at all now (GET /health, any status)."""
        try:
            self._request("GET", "/health", short=True)
        except _ServerError:
            return False
        return True

    def weight_version_or_none(self) -> str | None:
        try:
            return self.weight_version()
        except Exception:  # noqa: BLE001 - best effort, for the closing summary
            return None

    def is_paused(self) -> bool:
        response = self._request("GET", "/is_paused", short=True)
        if response.status_code == 404:
            raise _ServerError("the dev endpoints are off (404 on /is_paused): start the server with "
                               "VLLM_SERVER_DEV_MODE=1 (`layerwise serve` does)")
        return bool(self._json(response, "GET /is_paused").get("is_paused"))

    def collective_rpc(self, method: str, kwargs: dict | None = None, *, short: bool = False) -> list:
        """POST /collective_rpc; one result per worker."""
        response = self._request("POST", "/collective_rpc", json={"method": method, "kwargs": kwargs or {}},
                                 short=short, what=method)
        if response.status_code == 404:
            raise _ServerError("the dev endpoints are off (404 on /collective_rpc): start the server with "
                               "VLLM_SERVER_DEV_MODE=1 (`layerwise serve` does)")
        if response.status_code >= 400:
            raise RpcError(method, response.status_code, _error_text(response))
        if not response.content:
            return []
        return self._json(response, method).get("results") or []

    def engines_rpc(self, method: str, kwargs: dict | None = None, *, short: bool = False,
                    weight_version: str | None = None, reset_prefix_cache: bool = False) -> list[list]:
        """A worker call answered by every data-parallel engine: one list of worker results per engine.

        Through `layerwise serve`'s `ENGINES_RPC_PATH`; a server without it
        (plain vLLM) answers through `/collective_rpc`, which returns the
        first engine's workers only (`per_engine` turns False). WEIGHT_VERSION
        and RESET_PREFIX_CACHE: once every worker answered and none failed, the
        server names the weights and resets its prefix cache in the same
        engine-core step as the call (`server/versioned_rpc.py`); whether the
        reset took is in `prefix_cache_reset_with_reload`.
        """
        self.prefix_cache_reset_with_reload = None
        if self.per_engine is not False:
            body = {"method": method, "kwargs": kwargs or {}}
            if weight_version is not None:
                body["weight_version"] = weight_version
            if reset_prefix_cache:
                body["reset_prefix_cache"] = True
            response = self._request("POST", ENGINES_RPC_PATH, json=body, short=short, what=method)
            if response.status_code != 404:
                self.per_engine = True
                if response.status_code >= 400:
                    raise RpcError(method, response.status_code, _error_text(response))
                answer = self._json(response, method)
                engines = answer.get("engines")
                if not isinstance(engines, list) or not all(isinstance(e, list) for e in engines):
                    raise _ServerError(f"{method}: {ENGINES_RPC_PATH} answered {_excerpt(response)}, not a list "
                                       "per engine")
                self.version_set_with_reload = weight_version is not None
                reset = answer.get("prefix_cache_reset")
                self.prefix_cache_reset_with_reload = reset if isinstance(reset, bool) else None
                return engines
            self.per_engine = False
        return [self.collective_rpc(method, kwargs, short=short)]

    def ask(self, call, *, short: bool = False, weight_version: str | None = None,
            reset_prefix_cache: bool = False) -> list[list]:
        """Send CALL (a call of `layerwise_cli.worker.rpc`) to every worker of every engine (`engines_rpc`)."""
        return self.engines_rpc(call.method, call.kwargs(), short=short, weight_version=weight_version,
                                reset_prefix_cache=reset_prefix_cache)

    def ping_extension(self) -> str | None:
        """None when every worker has layerwise's extension, else why not (one clause).

        Also learns how many data-parallel engines the server runs (`engines`,
        `dp_size`) and whether each answers for itself (`per_engine`).
        """
        try:
            engines = self.ask(PingCall(), short=True)
        except RpcError as exc:
            if vllm_compat.lacks_method(exc.detail, rpc.PING):
                return f"the server has no layerwise worker extension (its workers have no method {rpc.PING})"
            raise _ServerError(f"{rpc.PING} failed inside the server: {exc.detail}") from None
        results = [r for workers in engines for r in workers]
        answers = [PingAnswer.from_json(r) for r in results]
        if not answers or not all(a.ok for a in answers):
            return f"the server has no layerwise worker extension ({rpc.PING} answered {results!r})"
        self.engines = len(engines)
        self.dp_size = max(((a.position or {}).get("dp_size", 1) for a in answers), default=1)
        return None

    def engines_warning(self) -> str | None:
        """Why only some engines are reported, or None."""
        if self.dp_size > self.engines:
            return (f"the server runs {self.dp_size} data-parallel engines, but its /collective_rpc answers for the "
                    "first only (vLLM keeps the first engine's result): the reload reached every engine, and only "
                    "engine 0 is reported and verified. Start it with `layerwise serve` to report each engine")
        return None

    def pause(self, mode: str, lease_s: float) -> bool:
        """Pause the server, under a lease of LEASE_S seconds where it has layerwise's; whether it has one."""
        what = f"POST {PAUSE_LEASE_PATH}?mode={mode}"
        response = self._request("POST", PAUSE_LEASE_PATH, params={"mode": mode, "lease_s": lease_s}, what=what)
        if response.status_code != 404:
            if response.status_code == 409:
                raise _ServerError(f"{_error_text(response)}; refusing to reload")
            self.lease_token = self._json(response, what).get("token")
            return True
        response = self._request("POST", "/pause", params={"mode": mode}, what=f"POST /pause?mode={mode}")
        self._json(response, f"POST /pause?mode={mode}")
        return False

    def renew(self, lease_s: float) -> None:
        """Extend this client's pause lease by LEASE_S seconds from now (`_ServerError` once it ran out)."""
        response = self._request("POST", RENEW_LEASE_PATH, params={"token": self.lease_token, "lease_s": lease_s},
                                 short=True)
        self._json(response, f"POST {RENEW_LEASE_PATH}")

    def resume(self) -> None:
        if self.lease_token is not None:
            response = self._request("POST", RESUME_LEASE_PATH, params={"token": self.lease_token}, short=True)
            self._json(response, f"POST {RESUME_LEASE_PATH}")
            self.lease_token = None
        else:
            response = self._request("POST", "/resume", short=True)
            self._json(response, "POST /resume")
        if self.is_paused():
            raise _ServerError("the server answered the resume, but still says it is paused")

    def reset_prefix_cache(self) -> bool:
        response = self._request("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"},
                                 short=True)
        return bool(self._json(response, "POST /reset_prefix_cache").get("success"))

    def set_weight_version(self, version: str) -> None:
        response = self._request("POST", "/update_weight_version", json={"new_version": version}, short=True)
        self._json(response, "POST /update_weight_version")

    def layerwise_reload(self, source: str, options: RemoteOptions, *,
                         reset_prefix_cache: bool = False) -> ReloadReport:
        # Options left at their defaults are not sent: a server running an older extension still takes the call.
        # The diagnostic switches set in this process travel with it (`ReloadOptions.with_switches`).
        call = ReloadCall(source=source, options=options.reload.with_switches())
        try:
            # The version travels with the reload: a server with layerwise's endpoint sets it on success.
            engines = self.ask(call, weight_version=options.weight_version, reset_prefix_cache=reset_prefix_cache)
        except _ServerError as exc:
            # Timed out or lost: the worker may still be streaming into the engine.
            if isinstance(exc, RpcError):
                raise _ServerError(f"the reload failed inside the server: {exc.detail}",
                                   holds=HOLDS_UNKNOWN) from None
            raise _ServerError(f"{exc}; the reload may still be running on the server",
                               holds=HOLDS_UNKNOWN) from None
        outcomes = [_engine_outcome(results) for results in engines]
        if not engines or any(error is not None for error, _, _ in outcomes):
            raise _engines_failure(outcomes, source)
        return merge_reports([ReloadReport.from_dict(ReloadAnswer.from_json(r).report)
                              for results in engines for r in results])

    def vllm_reload(self, source: str, weight_version: str | None = None, *,
                    reset_prefix_cache: bool = False) -> ReloadReport:
        """vLLM's own `reload_weights(weights_path=SOURCE)`: only its wall time is known."""
        start = time.perf_counter()
        try:
            self.engines_rpc("reload_weights", {"weights_path": source}, weight_version=weight_version,
                             reset_prefix_cache=reset_prefix_cache)
        except RpcError as exc:
            raise _ServerError(f"vLLM's reload_weights failed inside the server: {exc.detail}",
                               holds=HOLDS_UNKNOWN) from None
        except _ServerError as exc:
            raise _ServerError(f"{exc}; vLLM's reload_weights may still be running on the server",
                               holds=HOLDS_UNKNOWN) from None
        wall = time.perf_counter() - start
        return ReloadReport(
            placement=Placement(source=source, order="file", mapping="vLLM's own reload_weights"),
            volume=Volume(bytes=0, tensors=0),
            memory=Memory(peak_buffer_bytes=0, peak_tensor="", predicted_peak_buffer_bytes=0, largest_layer_bytes=0),
            timings=Timings(wall_s=wall),
            findings=Findings(notes=("per-layer figures are unavailable: the server has no layerwise worker "
                                     "extension, so vLLM's own reload_weights ran (wall time measured by the client, "
                                     "HTTP included)",)))

    def verify(self, source: str, revision: str | None, *, allow_unchecked: bool = False) -> VerifyResult:
        start = time.perf_counter()
        try:
            engines = self.ask(VerifyCall(source=source, revision=revision))
            results = [r for workers in engines for r in workers]
        except RpcError as exc:
            raise _ServerError(f"--verify failed inside the server: {exc.detail}", holds=HOLDS_NEW) from None
        except _ServerError as exc:
            raise _ServerError(f"--verify: {exc}", holds=HOLDS_NEW) from None
        answers = [VerifyAnswer.from_json(r) for r in results]
        failures = [r for r, a in zip(results, answers) if not a.ok]
        if failures or not results:
            error = failures[0].get("error") if failures and isinstance(failures[0], dict) else results
            raise _ServerError(f"--verify could not run: {error}", holds=HOLDS_NEW)
        return merge_verify([a.verify for a in answers], wall_s=time.perf_counter() - start,
                            allow_unchecked=allow_unchecked)


def _engine_outcome(results: list) -> tuple[str | None, str, bool]:
    """One engine's reload: (its error or None, what it holds, whether it was rolled back)."""
    error = first_failure(results)
    if error is None:
        return None, HOLDS_NEW, False
    failures = [a for a in map(ReloadAnswer.from_json, results) if not a.ok]
    touched = any(a.engine_touched for a in failures)
    rolled_back = all(a.rolled_back for a in failures if a.engine_touched)
    if not touched:
        return error, HOLDS_PREVIOUS, False
    return error, (HOLDS_PREVIOUS if rolled_back else HOLDS_UNKNOWN), rolled_back


def _engines_failure(outcomes: list[tuple[str | None, str, bool]], source: str) -> _ServerError:
    """The server's failure: one engine's error, and what every engine holds when there are several."""
    if not outcomes:
        return _ServerError("no engine answered the reload; nothing was changed")
    failed = [(index, outcome) for index, outcome in enumerate(outcomes) if outcome[0] is not None]
    index, (error, holds, rolled_back) = failed[0]
    if len(outcomes) == 1:
        tails = {HOLDS_PREVIOUS: "the server was rolled back to its previous weights" if rolled_back
                 else "nothing was changed", HOLDS_UNKNOWN: "some layers may hold the new weights"}
        text = error if "rolled back" in error else f"{error}; {tails[holds]}"
        return _ServerError(one_line(text), holds=holds, rolled_back=rolled_back)
    what = {HOLDS_NEW: f"holds {source}", HOLDS_UNKNOWN: "may hold some new layers"}
    engines = [f"engine {i} " + (what.get(h) or ("rolled back to its previous weights" if back else "unchanged"))
               for i, (_, h, back) in enumerate(outcomes)]
    states = ", ".join(engines)
    more = f" ({len(failed) - 1} more engine(s) failed)" if len(failed) > 1 else ""
    kinds = {h for _, h, _ in outcomes}
    holds = kinds.pop() if len(kinds) == 1 else HOLDS_MIXED
    return _ServerError(one_line(f"data-parallel engine {index} of {len(outcomes)}: {error}{more}; {states}"),
                        holds=holds, rolled_back=all(back for _, h, back in outcomes if h == HOLDS_PREVIOUS),
                        engines=engines)


class RpcError(_ServerError):
    """The server answered /collective_rpc with an error (the worker method raised, or does not exist)."""

    def __init__(self, method: str, status: int, detail: str) -> None:
        super().__init__(f"{method} failed: HTTP {status}: {detail}")
        self.method = method
        self.status = status
        self.detail = detail
