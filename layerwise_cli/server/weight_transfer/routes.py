"""The `layerwise` backend in the API server: the pause lease around an update, failures as one line, the report.

vLLM's RL routes (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) call the backend's engine in every worker and answer `{"message": ...}`. When the
server's backend is `layerwise`, an ASGI middleware (`WeightUpdateBracket`) adds, around them:

- a pause (mode `keep`: requests wait, none is dropped) under a lease from `/start_weight_update` to
  `/finish_weight_update`, so no answer mixes two steps' weights; the lease runs only while no call of the
  update is in flight, and lasts `pause_lease_s` from the end of the last one (`init_info`, 60 s by default).
  A client that dies in between leaves the server serving again when it runs out: the workers' update is
  ended (vLLM's own `finish_weight_update`, no version) and generation resumed, on the weights of the last
  complete update;
- a failure answered as one line (`{"error": {"message": LINE, "type": "BadRequestError", "code": 400}}`), the
  worker's own `LayerwiseError` naming the source and what is wrong, without vLLM's wrapping ("Call to ...
  method failed: Worker failed with error '...'"); the engine kept the weights it had.

`GET /layerwise/update_report` answers the last update's per-layer report (what `reload --json` prints), merged
over the workers, or its error.
"""

from __future__ import annotations

import asyncio
import json
import math

from fastapi import Request
from fastapi.responses import JSONResponse

from layerwise_cli import UPDATE_REPORT_PATH, WEIGHT_TRANSFER_BACKEND
from layerwise_cli.errors import one_line
from layerwise_cli.report.reload_report import ReloadReport, merge_reports
from layerwise_cli.report.verify_result import merge_verify
from layerwise_cli.server.pause_lease import current_lease, end_lease, hold_pause
from layerwise_cli.vllm_weight_transfer import ENGINE_FAILURE_WRAPPERS
from layerwise_cli.worker.rpc import UPDATE_REPORT, ReloadAnswer

INIT, START, UPDATE, FINISH = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                               "/finish_weight_update")
DEFAULT_LEASE_S = 60.0


def uses_layerwise_backend(app) -> bool:
    """Whether APP's engine runs the `layerwise` weight-transfer backend."""
    config = getattr(getattr(app.state, "engine_client", None), "vllm_config", None)
    transfer = getattr(config, "weight_transfer_config", None)
    return getattr(transfer, "backend", None) == WEIGHT_TRANSFER_BACKEND


def engine_failure_line(exc: BaseException) -> str:
    """The worker's own line in a failure vLLM's engine client raised (its wrappers peeled off), on one line."""
    text = str(exc)
    for wrapper in ENGINE_FAILURE_WRAPPERS:
        match = wrapper.match(text)
        if match:
            text = match.group(1)
    return one_line(text) or type(exc).__name__


def failure_answer(line: str, status: int = 400) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "ConflictError" if status == 409 else "InternalServerError"
    return JSONResponse(status_code=status, content={"error": {"message": line, "type": kind, "code": status}})


class WeightUpdateBracket:
    """ASGI middleware on vLLM's RL routes, for the `layerwise` backend only (other backends pass through)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in (INIT, START, UPDATE, FINISH) \
                or not uses_layerwise_backend(scope["app"]):
            return await self.app(scope, receive, send)
        app = scope["app"]
        if path == INIT:
            receive = await _read_lease(app, receive)
        elif path == START:
            refusal = await _take_lease(app)
            if refusal is not None:
                return await refusal(scope, receive, send)
        lease = _update_lease(app)
        if lease is not None:
            lease.deadline = math.inf  # no expiry while a call of the update is in flight
        try:
            await self.app(scope, receive, send)
            failure = None
        except Exception as exc:  # noqa: BLE001 - vLLM's handler would answer 500 with its wrapping
            failure = engine_failure_line(exc)
        if lease is not None:
            lease.deadline = asyncio.get_running_loop().time() + lease.lease_s
            if path == FINISH or (path == START and failure is not None):
                await _end_update_lease(app, lease)
        if failure is not None:
            await failure_answer(failure)(scope, receive, send)


async def _read_lease(app, receive):
    """Read `init_info.pause_lease_s` from the body (the workers refuse a bad one); the body replayed to vLLM."""
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    try:
        lease_s = json.loads(body)["init_info"].get("pause_lease_s", DEFAULT_LEASE_S)
        if isinstance(lease_s, int | float) and not isinstance(lease_s, bool) and 0 < lease_s <= 3600:
            app.state.layerwise_update_lease_s = float(lease_s)
    except (ValueError, KeyError, TypeError, AttributeError):
        pass  # vLLM's route answers a malformed body
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _take_lease(app):
    """Pause generation under the update's lease; the refusal to answer, or None."""
    held = _update_lease(app)
    if held is not None and current_lease(app) is held:
        return failure_answer("a weight update is already in progress (call /finish_weight_update first)", 409)

    async def end_update() -> None:
        # The client is gone: end the workers' update as vLLM's /finish_weight_update does, without a version.
        await app.state.engine_client.finish_weight_update(None)

    lease, refusal = await hold_pause(app, "keep", getattr(app.state, "layerwise_update_lease_s", DEFAULT_LEASE_S),
                                      on_expiry=end_update)
    if lease is None:
        return refusal
    app.state.layerwise_update_lease = lease
    return None


def _update_lease(app):
    """The lease of the update in progress, or None (none, or it ran out)."""
    lease = getattr(app.state, "layerwise_update_lease", None)
    return lease if lease is not None and current_lease(app) is lease else None


async def _end_update_lease(app, lease) -> None:
    app.state.layerwise_update_lease = None
    await end_lease(app, lease)


async def update_report(raw_request: Request):
    """`GET /layerwise/update_report`: the last update's report merged over the workers, or its error."""
    try:
        answers = await raw_request.app.state.engine_client.collective_rpc(UPDATE_REPORT)
    except Exception as exc:  # noqa: BLE001 - one line, as the routes above
        return failure_answer(f"no update report: {engine_failure_line(exc)} (is the server's weight-transfer "
                              f"backend {WEIGHT_TRANSFER_BACKEND!r}?)", 500)
    if not answers or any(a.get("ok") is None for a in answers):
        return JSONResponse(content={"ok": None, "error": "no update yet"})
    parsed = [ReloadAnswer.from_json(a) for a in answers]
    failed = next((a for a in parsed if not a.ok), None)
    if failed is not None:
        return JSONResponse(content={"ok": False, "error": failed.error, "rolled_back": failed.rolled_back})
    reports = [ReloadReport.from_dict(a.report) for a in parsed]
    checks = [a.get("verify") for a in answers]
    verify = None
    if all(checks):  # every worker checked the engine against the source (`verify`)
        accepted = any(r.verify is not None and r.verify.unchecked_accepted for r in reports)
        verify = merge_verify(checks, wall_s=max(r.verify.wall_s for r in reports if r.verify is not None),
                              allow_unchecked=accepted)
    merged = merge_reports(reports, verify=verify)
    return JSONResponse(content={"ok": True, "report": merged.to_dict()})


def add_weight_transfer_routes(app) -> None:
    """Add the report route and the middleware to APP (vLLM's FastAPI app); both act only for this backend."""
    app.add_api_route(UPDATE_REPORT_PATH, update_report, methods=["GET"])
    app.add_middleware(WeightUpdateBracket)
