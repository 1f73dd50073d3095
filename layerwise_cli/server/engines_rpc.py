"""`POST /layerwise/engines_rpc`: vLLM's `/collective_rpc`, answered by every data-parallel engine of the server.

vLLM's own `/collective_rpc` reaches every engine of a data-parallel server
but returns the first engine's answer only: its data-parallel client
(`DPLBAsyncMPClient.call_utility_async` in vllm/v1/engine/core_client.py)
sends the utility call to all engines and keeps `results[0]`. `/pause` and
`/resume` go the same way (every engine pauses and resumes); `/is_paused`
asks every engine and insists they agree. This endpoint makes the same call
through `call_utility_all_async` and answers `{"engines": [[worker results],
...]}`, one list per engine, so that a reload reports, verifies and fails
per engine. `layerwise serve` adds it next to vLLM's dev endpoints (same
body, same API-key rule).

With `"weight_version": TAG` in the body, the server sets its weight version
to TAG once every worker of every engine answered and none said it failed,
in the same request: a client that dies after the reload cannot leave the tag
naming the weights the server held before. With `"reset_prefix_cache": true`
the prefix cache is reset on the same condition. Both happen inside the
engine core's own utility call that runs the workers' method
(`server/versioned_rpc.py`): no scheduler step runs between the new weights
and their name, so an answer's version is exact even when nothing paused the
server. The answer then says `"prefix_cache_reset": true|false`, and
`"one_step": false` where an engine core lacks the method (vLLM started
without layerwise's plugin): the three calls then follow each other. Where an
engine failed and another already took the version, that one gets its
previous version back.

A reload always goes through that one utility call, which times itself:
`layerwise_engine_stall_seconds` is how long the reload kept the engine from
generating, whether the server was paused or not.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from layerwise_cli import ENGINES_RPC_PATH, vllm_compat
from layerwise_cli.server import metrics
from layerwise_cli.server.answer_versions import AnswerVersions
from layerwise_cli.server.pause_lease import add_pause_lease_routes
from layerwise_cli.server.versioned_rpc import CORE_METHOD, workers_failed
from layerwise_cli.server.weight_transfer.routes import add_weight_transfer_routes
from layerwise_cli.worker import rpc

# How often a call in flight checks that the engine is still alive.
ENGINE_POLL_S = 1.0


def attach_engines_rpc() -> None:
    """Add the endpoint wherever vLLM attaches its `/collective_rpc` (only with VLLM_SERVER_DEV_MODE=1)."""
    api_router = vllm_compat.dev_rpc_router_module()

    vllm_attach = api_router.attach_router

    def attach(app) -> None:
        vllm_attach(app)
        app.add_api_route(ENGINES_RPC_PATH, engines_rpc, methods=["POST"])
        add_pause_lease_routes(app)
        add_weight_transfer_routes(app)  # the `layerwise` weight-transfer backend's lease, errors and report
        app.add_middleware(AnswerVersions)  # every completion and chat answer names its weights

    if getattr(vllm_attach, "_layerwise", False):
        return  # attached already in this process (`layerwise serve`, then the plugin)
    attach._layerwise = True

    api_router.attach_router = attach


async def engines_rpc(raw_request: Request):
    """Call a worker method on every worker of every engine; one list of worker results per engine."""
    try:
        body = await raw_request.json()
    except json.JSONDecodeError as exc:
        raise HTTPException(status_code=400, detail=f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("method"), str):
        raise HTTPException(status_code=400, detail="the body must be a JSON object with a 'method'")
    # As vLLM's /collective_rpc: only JSON arguments; the method deserializes what it needs.
    call = (body["method"], body.get("timeout"), tuple(body.get("args", [])), body.get("kwargs", {}))
    version = body.get("weight_version") if isinstance(body.get("weight_version"), str) else None
    reset = body.get("reset_prefix_cache") is True
    engine_client = raw_request.app.state.engine_client
    is_reload = body["method"] == rpc.RELOAD
    start = time.perf_counter()
    try:
        if version is not None or reset or is_reload:  # a reload: also how long it held the engine cores
            answers = await _versioned_call(engine_client, call, version, reset)
        else:
            answers = [{"results": results} for results in await _plain_call(engine_client, call)]
    except HTTPException:
        raise
    except Exception as exc:  # noqa: BLE001 - the engine's one line, as vLLM's handler words it, without a traceback
        return JSONResponse(status_code=500, content={"error": {"message": str(exc), "type": "InternalServerError",
                                                                "code": 500}})
    engines = [[_jsonable(r) for r in (answer["results"] or [])] for answer in answers]
    metrics.record_call(body["method"], engines, time.perf_counter() - start)
    held = [answer["engine_s"] for answer in answers if isinstance(answer.get("engine_s"), float)]
    if held and is_reload:
        metrics.record_stall(max(held))
    content: dict = {"engines": engines}
    if version is not None or reset:
        # Whether each engine core ran the call, the reset and the version in one utility call.
        content["one_step"] = all("versioned" in answer for answer in answers)
    if engines and not any(workers_failed(results) for results in engines):
        if version is not None:
            metrics.record_version(version)
        if reset:
            content["prefix_cache_reset"] = all(answer.get("prefix_cache_reset") for answer in answers)
    else:
        await _version_back(engine_client, answers)
    return JSONResponse(content=content)


async def _plain_call(engine_client, call: tuple) -> list[list]:
    """The worker call CALL on every engine: one list of worker results per engine."""
    gather = vllm_compat.call_utility_all_async(engine_client)
    if gather is None:  # a client that talks to one engine only
        return [await until_engine_dies(engine_client.collective_rpc(*call), engine_client, call[0])]
    return await until_engine_dies(gather("collective_rpc", *call), engine_client, call[0])


async def _versioned_call(engine_client, call: tuple, version: str | None, reset: bool) -> list[dict]:
    """CALL on every engine, each engine core resetting its prefix cache (RESET) and naming its weights VERSION
    in the same utility call when its workers succeeded: one `versioned_rpc.rpc_then_version` answer per engine.

    An engine core without the method (vLLM started without layerwise's plugin) gets the call, then the reset
    and the version as utility calls of their own, as before.
    """
    args = (*call, version, reset)
    gather = vllm_compat.call_utility_all_async(engine_client)
    one = vllm_compat.call_utility_async(engine_client)
    try:
        if gather is not None:
            return await until_engine_dies(gather(CORE_METHOD, *args), engine_client, call[0])
        if one is not None:
            return [await until_engine_dies(one(CORE_METHOD, *args), engine_client, call[0])]
    except Exception as exc:
        if not vllm_compat.lacks_method(str(exc), CORE_METHOD):
            raise
    answers = [{"results": results} for results in await _plain_call(engine_client, call)]
    if any(workers_failed(answer["results"]) for answer in answers):
        return answers
    if reset:
        done = await engine_client.reset_prefix_cache(reset_running_requests=True)
        for answer in answers:
            answer["prefix_cache_reset"] = bool(done)
    if version is not None:
        await engine_client.update_weight_version(version)
    return answers


async def _version_back(engine_client, answers: list[dict]) -> None:
    """After a call that failed on some engine: the engines that took the new version get their previous back."""
    previous = next((answer["previous"] for answer in answers if answer.get("versioned")), None)
    if previous is not None:
        await engine_client.update_weight_version(previous)


async def until_engine_dies(call, engine_client, method: str, *, poll_s: float = ENGINE_POLL_S):
    """CALL's answer, or HTTP 503 once the engine is dead without answering it.

    vLLM's engine client leaves a call in flight waiting for ever when the
    engine core process ends (its answer never comes); the request would then
    also keep the server from stopping (uvicorn waits for it).
    """
    task = asyncio.ensure_future(call)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if getattr(engine_client, "errored", False):
            task.cancel()
            raise HTTPException(status_code=503, detail=f"the engine died during {method} without answering it; "
                                "its server stops (its log says why)")


def _jsonable(result):
    return result if result is None or isinstance(result, dict | list) else str(result)
