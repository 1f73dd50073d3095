"""One server's reload over HTTP as separate steps: check, pre-flight, change (pause, reload, verify, version),
go back, finish (resume). `reload_server` runs them in a row; a fleet runs each step on every server first."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

from layerwise_cli.checkpoint.hub.pin import is_commit
from layerwise_cli.client.servers import prefix_cache
from layerwise_cli.client.servers.api import (
    HOLDS_MIXED,
    HOLDS_NEW,
    HOLDS_PREVIOUS,
    HOLDS_UNKNOWN,
    HOLDS_UNVERIFIED,
    RemoteOptions,
    ServerClient,
    _ServerError,
)
from layerwise_cli.client.servers.events import (
    Checked,
    Failed,
    GoingBack,
    OnEvent,
    Paused,
    Preflighted,
    Reloaded,
    ReloadedBack,
    Resumed,
    Verified,
    Versioned,
)
from layerwise_cli.client.servers.lease import LeaseKeeper, step_done
from layerwise_cli.errors import describe_exception, one_line
from layerwise_cli.report.jsonable import jsonable
from layerwise_cli.report.records import rank_label
from layerwise_cli.report.reload_report import ReloadReport
from layerwise_cli.report.verify_result import VerifyResult, verify_failure
from layerwise_cli.worker.rpc import PreflightAnswer, PreflightCall

NO_LEASE_WARNING = ("this server has no pause lease (layerwise's vLLM plugin is not loaded in it): had this client "
                    "died while the server was paused, it would have stayed paused until POST /resume; start it "
                    "with `layerwise serve`, or install layerwise where it runs")

# What a server may hold after a failed change: anything but its previous weights, which a fleet reloads back.
_CHANGED = (HOLDS_NEW, HOLDS_UNVERIFIED, HOLDS_UNKNOWN, HOLDS_MIXED)



@dataclass(frozen=True)
class ServerResult:
    """What happened on one server; built once its reload is done with it."""

    url: str
    ok: bool = False
    error: str | None = None
    # The last step reached: connect, check, preflight, pause, reload, verify, version, back, resume, done.
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
    # A fleet reloaded it back to what it held, because another server failed (`error` says which).
    reloaded_back: bool = False
    # A fleet left it as it was, because another server was refused at pre-flight.
    left_alone: bool = False
    # It still answered when this command was done with it (False: it died, or never answered).
    answering: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "warnings", tuple(self.warnings))
        object.__setattr__(self, "engine_holds", tuple(self.engine_holds))

    def to_dict(self) -> dict:
        """JSON-ready: the server's result with its report and verification (lists for sequences)."""
        data = jsonable(asdict(self))
        data["report"] = self.report.to_dict() if self.report is not None else None
        return data


class ServerReload:
    """One server's reload, a step at a time; every step records its failure instead of raising it.

    Call `check`, optionally `preflight`, `change`, optionally `go_back`, and
    always `finish` (it resumes a paused server whatever happened, and builds
    the result). A step after a failed one does nothing.
    """

    def __init__(self, url: str, source: str, options: RemoteOptions, emit: OnEvent | None = None) -> None:
        self.url = url
        self.source = source
        self.options = options
        self._emit = emit or (lambda event: None)
        self.client = ServerClient(url, api_key=options.api_key, timeout=options.timeout)
        self.stage = "connect"
        self.method, self.fallback_reason = "layerwise", None
        self.report: ReloadReport | None = None
        self.verify: VerifyResult | None = None
        self.holds, self.rolled_back, self.reloaded_back = HOLDS_PREVIOUS, False, False
        self.version_before: str | None = None
        self.version_after: str | None = None
        self.error: str | None = None
        self.changed_ok = False  # every step of `change` passed
        self.left_alone = False
        self.warnings: list[str] = []
        self.engines, self.engine_holds = 1, []
        # Where its weights came from, to reload it back (`preflight`); None: not known.
        self.back: tuple[str, str | None] | None = None
        self.back_missing = "where its weights came from is not known"  # why `back` is None
        self._paused_at: float | None = None
        self._paused_s = 0.0
        self._keeper: LeaseKeeper | None = None
        self._start = time.perf_counter()

    @property
    def failed(self) -> bool:
        return self.error is not None

    @contextmanager
    def _step(self) -> Iterator[None]:
        try:
            yield
        except _ServerError as exc:
            self.error = str(exc)
            self.rolled_back = exc.rolled_back
            self.engine_holds = list(exc.engines)
            if self.holds != HOLDS_UNVERIFIED:
                self.holds = exc.holds
        except Exception as exc:  # noqa: BLE001 - one line per server, never a traceback
            self.error = one_line(str(describe_exception(exc)))
            if self.stage == "reload" and self.holds == HOLDS_PREVIOUS:
                self.holds = HOLDS_UNKNOWN

    def check(self) -> bool:
        """Connect; refuse a server that is paused, or lacks the dev endpoints. Nothing changes. Whether it passed."""
        if self.failed:
            return False
        with self._step():
            # Few round trips before the pause: on a busy server each one waits behind the traffic.
            self.stage = "connect"
            self.client.check_api_key()  # also proves the server answers
            step_done(self.stage)
            self.stage = "check"
            self.version_before = self.client.weight_version()  # also proves the dev endpoints are on
            if self.client.is_paused():
                raise _ServerError("the server is already paused (another reload in progress, or paused by hand); "
                                   "refusing to reload. A pause under layerwise's lease ends by itself; any other, "
                                   "POST /resume to it if it is stale")
            extension = self.client.ping_extension()
            if extension is not None:
                self.method, self.fallback_reason = "vllm", extension
                if self.options.verify:
                    raise _ServerError(f"--verify needs layerwise's worker extension, and {extension}; nothing was "
                                       "changed (start the server with `layerwise serve`, or drop --verify)")
                if self.options.reload.revision:
                    self.warnings.append("vLLM's own reload_weights reads the Hub repo at whatever its default "
                                         "branch names then, not at the commit this reload pinned (--revision "
                                         "is ignored)")
                if not self.options.reload.allow_nonfinite:
                    self.warnings.append("vLLM's own reload_weights does not check tensors for NaN/Inf")
            else:
                self.engines = self.client.engines
                if self.client.engines_warning():
                    self.warnings.append(self.client.engines_warning())
            self._emit(Checked(self.url, self.method, self.fallback_reason))
            step_done(self.stage)
        return not self.failed

    def preflight(self) -> bool:
        """Ask every worker whether SOURCE would reload cleanly, and where what it holds came from. Nothing changes.

        Refuses a server without layerwise's worker extension (it can be neither pre-flighted nor reloaded
        back). One whose previous weights are no longer readable there (a trainer deleted that step) passes,
        with a warning: it keeps the new weights if another server fails.

        A pinned step by URL or from a Hub run is also prepared by it while the server serves: opened, checked,
        a delta rebuilt where the reload would rebuild it (`worker/state/prepared.py`), so that the pause
        holds only the apply.
        """
        if self.failed:
            return False
        with self._step():
            self.stage = "preflight"
            if self.method != "layerwise":
                raise _ServerError(f"an all-or-nothing update needs layerwise's worker extension on every server "
                                   f"(to pre-flight it and to reload it back), and {self.fallback_reason}; nothing "
                                   "was changed (start it with `layerwise serve`, or pass --no-atomic)")
            engines = self.client.ask(PreflightCall(source=self.source, revision=self.options.reload.revision,
                                                    allow_partial=self.options.reload.allow_partial,
                                                    delta_base_check=self.options.reload.delta_base_check,
                                                    allow_nonfinite=self.options.reload.allow_nonfinite))
            answers = [PreflightAnswer.from_json(r) for workers in engines for r in workers]
            failure = next((a for a in answers if not a.ok), None)
            if failure is not None or not answers:
                error = failure.error if failure is not None else "no worker answered"
                if failure is not None and failure.position and len(answers) > 1:
                    error = f"{rank_label(failure.position)}: {error}"
                raise _ServerError(f"pre-flight failed: {error}; nothing was changed")
            backs = {(a.loaded_from, a.loaded_revision) for a in answers}
            back_error = next((a.back_error for a in answers if a.back_error), None)
            if len(backs) > 1:
                sources = ", ".join(sorted(str(back[0]) for back in backs))
                back_error = f"its engines hold weights of different sources ({sources})"
            if back_error is not None:
                # Not refused: a trainer deletes old steps, the one a fleet holds included, and refusing would
                # stall the fleet for good. Said now, and again if it must go back.
                self.back_missing = back_error
                self.warnings.append(f"it could not be reloaded back if another server failed: {back_error}")
            else:
                self.back = backs.pop()
            # A Hub source held at a commit goes back to that commit; a local path only to what it holds now.
            if self.back == (self.source, self.options.reload.revision) and not is_commit(self.back[1]):
                self.warnings.append(f"its weights came from {self.source} itself: had another server failed, it "
                                     "could only have been reloaded back to what that path holds now")
            self._emit(Preflighted(self.url, self.back[0] if self.back else None))
            step_done(self.stage)
        return not self.failed

    def change(self) -> bool:
        """Pause, reload, verify and set the version (no resume: `finish` does). Whether every step passed."""
        if self.failed:
            return False
        options = self.options
        with self._step():
            if options.pause_mode != "none":
                self.stage = "pause"
                # From here on, resume whatever happens: the engine pauses as soon as the request lands,
                # even if the answer (which waits for in-flight requests with `wait`) never reaches us.
                self._paused_at = time.perf_counter()
                if self.client.pause(options.pause_mode, options.pause_lease_s):
                    self._keeper = LeaseKeeper(self.client, options.pause_lease_s)
                else:
                    self.warnings.append(NO_LEASE_WARNING)
                self._emit(Paused(self.url, options.pause_mode, options.pause_lease_s if self._keeper else None))
                step_done(self.stage)

            self.stage = "reload"
            reset = prefix_cache.needs_reset(options.pause_mode, self._keeper)
            self.report = (self.client.layerwise_reload(self.source, options, reset_prefix_cache=reset)
                           if self.method == "layerwise"
                           else self.client.vllm_reload(self.source, options.weight_version, reset_prefix_cache=reset))
            self.holds = HOLDS_NEW
            self._prefix_cache_after_reload(reset)
            self._emit(Reloaded(self.url, self.report))
            step_done(self.stage)

            if options.verify:
                self.stage = "verify"
                self.verify = self.client.verify(self.source, options.reload.revision,
                                                 allow_unchecked=options.reload.allow_unchecked)
                self._emit(Verified(self.url, self.verify))
                if not self.verify.ok:
                    self.holds = HOLDS_UNVERIFIED
                    raise _ServerError(verify_failure(self.verify), holds=HOLDS_UNVERIFIED)
                step_done(self.stage)

            if options.weight_version is not None:
                self.stage = "version"
                if not self.client.version_set_with_reload:  # else the server set it when the reload succeeded
                    self.client.set_weight_version(options.weight_version)
                self.version_after = options.weight_version
                self._emit(Versioned(self.url, options.weight_version))
                step_done(self.stage)
            self.changed_ok = True
        return self.changed_ok

    def _prefix_cache_after_reload(self, asked: bool) -> None:
        """Drop the old weights' KV blocks unless the server did with the reload (ASKED) or the pause did (the
        lease can have been lost during the reload: then it is dropped now)."""
        needed = prefix_cache.needs_reset(self.options.pause_mode, self._keeper)
        self.warnings.extend(prefix_cache.after_reload(self.client, asked, needed))

    def refuse(self, because: str) -> None:
        """Leave this server as it is, because of another server (its result says so)."""
        if not self.failed:
            self.error = f"not changed: {because}"
            self.left_alone = True

    @property
    def may_have_changed(self) -> bool:
        return self.holds in _CHANGED

    def go_back(self, because: str) -> None:
        """Reload what this server held before `change` (another server failed), under its previous version tag."""
        if not self.may_have_changed:
            return
        reason = f"{self.error}; and {because}" if self.failed else because
        if not self.failed:
            self.stage = "back"
        holds = self.holds
        self.error = None
        with self._step():
            if self.back is None:
                raise _ServerError(self.back_missing, holds=holds)
            source, revision = self.back
            self._emit(GoingBack(self.url, source, because))
            # Every layer the change touched is re-read; the others are skipped by the records. What it held was
            # accepted when it was loaded: no NaN/Inf refusal now.
            back = replace(self.options, weight_version=self.version_before,
                           reload=replace(self.options.reload, revision=revision, all_layers=False,
                                          allow_partial=True, allow_nonfinite=True, delta_base_check=False))
            reset = prefix_cache.needs_reset(self.options.pause_mode, self._keeper)
            self.client.layerwise_reload(source, back, reset_prefix_cache=reset)
            self._prefix_cache_after_reload(reset)
            if self.options.verify:
                checked = self.client.verify(source, revision, allow_unchecked=self.options.reload.allow_unchecked)
                if not checked.ok:
                    raise _ServerError(f"reloaded back to {source}, and then {verify_failure(checked)}",
                                       holds=HOLDS_UNKNOWN)
            if self.version_before is not None and not self.client.version_set_with_reload:
                self.client.set_weight_version(self.version_before)
            self.holds, self.reloaded_back, self.rolled_back = HOLDS_PREVIOUS, True, False
            self.version_after = self.version_before
            self._emit(ReloadedBack(self.url, source))
        if not self.failed:
            self.error = f"{reason}; reloaded back to {self.back[0]}"
            return
        if self.holds == HOLDS_PREVIOUS:
            # "Previous" to the failed reload back is what `change` had loaded.
            self.holds = holds
        self.error = f"{reason}; reloading it back failed: {self.error}"

    def finish(self) -> ServerResult:
        """Resume the server if it was paused (also after a failure), and say what it holds now."""
        ok = self.changed_ok and not self.failed
        if self._keeper is not None:
            self._keeper.stop()
            if self._keeper.lost:
                self.warnings.append(f"its pause lease ran out while this client worked ({self._keeper.lost}): "
                                     "the server resumed by itself; pass a longer --pause-lease")
            self._keeper = None
        if self._paused_at is not None:
            try:
                self.client.resume()
                self._paused_s = time.perf_counter() - self._paused_at
                self._emit(Resumed(self.url, self._paused_s))
                step_done("resume")
            except Exception as exc:  # noqa: BLE001 - reported, never raised past the other servers
                message = (f"could not resume generation ({one_line(str(describe_exception(exc)))}): "
                           "the server may still be paused; POST /resume to it")
                if self.error is None:
                    self.stage = "resume"
                ok = False
                self.error = f"{self.error}; {message}" if self.error else message
            self._paused_at = None
        if ok and self.version_after is None:
            self.version_after = self.version_before
            if self.version_before not in (None, "default"):
                self.warnings.append(f"its weight version stays {self.version_before!r}, which named the "
                                     "weights it held before; pass --weight-version TAG to name the new ones")
        answering = self.client.reached
        if not ok and self.client.reached and not self.reloaded_back:
            # After the resume: it costs the paused traffic nothing.
            self.version_after = self.client.weight_version_or_none()
            answering = self.client.answers()
        wall_s = time.perf_counter() - self._start
        self.client.close()
        if self.error:
            self._emit(Failed(self.url, self.error))
        return ServerResult(url=self.url, ok=ok, error=self.error, stage="done" if ok else self.stage,
                            method=self.method, fallback_reason=self.fallback_reason, report=self.report,
                            verify=self.verify, holds=self.holds, version_before=self.version_before,
                            version_after=self.version_after, rolled_back=self.rolled_back,
                            reached=self.client.reached, paused_s=self._paused_s, wall_s=wall_s,
                            warnings=tuple(self.warnings), engines=self.engines,
                            engine_holds=tuple(self.engine_holds), reloaded_back=self.reloaded_back,
                            left_alone=self.left_alone, answering=answering)
