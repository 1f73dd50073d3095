"""`POST /layerwise/pause`: vLLM's pause, held under a lease that ends by itself when its client stops renewing it.

vLLM's `/pause` lasts until someone sends `/resume`. A reloading client that
dies between the two (OOM, preemption, a scheduler's SIGKILL) leaves the
server serving nothing until a person acts. Here the pause is held under a
lease: the client renews it while it works (`/layerwise/renew`) and ends it
with `/layerwise/resume`; if it stops renewing, the server resumes by itself
once the lease runs out, and logs why. A reload the dead client had started
runs on inside the engine to its end (success, or rollback), and the resume,
a call to the same engine core, is taken only after it: the server then
serves either the old weights or the new ones, whole.

At most one lease at a time: a second client is refused (409) while one is
held. `layerwise serve` adds these routes next to vLLM's dev endpoints, as does
layerwise's vLLM plugin in any `vllm serve` where layerwise is installed
(same API-key rule as the other dev endpoints).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse

from layerwise_cli import PAUSE_LEASE_PATH, RENEW_LEASE_PATH, RESUME_LEASE_PATH
from layerwise_cli.server import metrics

logger = logging.getLogger("layerwise.pause_lease")

# The longest lease a client may ask for, and the modes vLLM's /pause takes.
MAX_LEASE_S = 3600.0
PAUSE_MODES = ("abort", "wait", "keep")


@dataclass
class PauseLease:
    """The pause one client holds: until `deadline` (the event loop's clock), unless renewed."""

    token: str
    deadline: float
    lease_s: float
    began: float = 0.0  # when the pause was asked for (the event loop's clock)
    drain_s: float = 0.0  # how long vLLM's pause took: the in-flight requests finishing (mode wait)
    expiry: asyncio.Task | None = field(default=None, repr=False)
    # Run when the lease runs out, before the resume (the weight-transfer backend ends its client's update).
    on_expiry: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)


def current_lease(app) -> PauseLease | None:
    return getattr(app.state, "layerwise_pause_lease", None)


def _set_lease(app, lease: PauseLease | None) -> None:
    app.state.layerwise_pause_lease = lease


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(content={"error": message}, status_code=status)


def _lease_seconds(raw: str | None) -> float | None:
    try:
        seconds = float(raw) if raw is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 < seconds <= MAX_LEASE_S else None


async def pause_with_lease(raw_request: Request):
    """Pause generation (vLLM's `pause_generation`, MODE) under a lease of LEASE_S seconds; answer its token."""
    app = raw_request.app
    mode = raw_request.query_params.get("mode", "abort")
    lease_s = _lease_seconds(raw_request.query_params.get("lease_s"))
    if mode not in PAUSE_MODES:
        return _error(400, f"unknown pause mode {mode!r}: use one of {', '.join(PAUSE_MODES)}")
    if lease_s is None:
        return _error(400, f"lease_s must be a number of seconds in (0, {MAX_LEASE_S:g}]")
    lease, refusal = await hold_pause(app, mode, lease_s)
    if lease is None:
        return refusal
    return JSONResponse(content={"status": "paused", "token": lease.token, "lease_s": lease_s})


async def hold_pause(app, mode: str, lease_s: float, *, on_expiry: Callable[[], Awaitable[None]] | None = None
                     ) -> tuple[PauseLease | None, JSONResponse | None]:
    """Pause APP's engine (MODE) under a new lease of LEASE_S seconds: (the lease, None), or (None, the refusal).

    ON_EXPIRY runs when the lease runs out unrenewed, before the resume.
    """
    loop = asyncio.get_running_loop()
    held = current_lease(app)
    if held is not None:
        return None, _error(409, f"the server is paused under another client's lease (it ends in "
                                 f"{max(0.0, held.deadline - loop.time()):.0f} s unless renewed)")
    # The lease counts from now, before the pause is taken: a client that dies while a `wait` pause drains the
    # running requests still leaves a pause that ends.
    lease = PauseLease(token=secrets.token_hex(8), deadline=loop.time() + lease_s, lease_s=lease_s, began=loop.time(),
                       on_expiry=on_expiry)
    _set_lease(app, lease)
    lease.expiry = asyncio.create_task(_expire(app, lease))
    try:
        await app.state.engine_client.pause_generation(mode=mode)
        lease.drain_s = loop.time() - lease.began
    except Exception as exc:  # noqa: BLE001 - answered as one line; the lease goes with the failed pause
        await _end(app, lease, reason=f"the pause failed: {exc}")
        return None, _error(500, f"failed to pause generation: {exc}")
    return lease, None


async def end_lease(app, lease: PauseLease, *, reason: str | None = None) -> None:
    """Drop LEASE and resume generation (nothing when LEASE ended already); REASON is logged as a warning."""
    await _end(app, lease, reason=reason)


async def renew_lease(raw_request: Request):
    """Extend the lease named by TOKEN by LEASE_S seconds from now."""
    app = raw_request.app
    lease = current_lease(app)
    token = raw_request.query_params.get("token")
    lease_s = _lease_seconds(raw_request.query_params.get("lease_s"))
    if lease_s is None:
        return _error(400, f"lease_s must be a number of seconds in (0, {MAX_LEASE_S:g}]")
    if lease is None or lease.token != token:
        return _error(409, "no such lease: it ran out (the server resumed by itself) or another client holds it")
    lease.deadline = asyncio.get_running_loop().time() + lease_s
    lease.lease_s = lease_s
    return JSONResponse(content={"status": "renewed", "lease_s": lease_s})


async def resume_lease(raw_request: Request):
    """End the lease named by TOKEN and resume generation (also when it had run out: then already resumed)."""
    app = raw_request.app
    lease = current_lease(app)
    token = raw_request.query_params.get("token")
    if lease is None or lease.token != token:
        if lease is not None:
            return _error(409, "another client holds the pause lease now")
        await app.state.engine_client.resume_generation()
        return JSONResponse(content={"status": "resumed", "lease": "had run out"})
    await _end(app, lease, reason=None)
    return JSONResponse(content={"status": "resumed", "lease": "ended"})


async def _expire(app, lease: PauseLease) -> None:
    """Resume generation once LEASE runs out without being renewed or ended."""
    loop = asyncio.get_running_loop()
    # Checked every second at least: a deadline may be moved (to infinity while a call of the lease is in flight).
    while (left := lease.deadline - loop.time()) > 0:
        await asyncio.sleep(min(left, 1.0))
    if current_lease(app) is lease:
        await _end(app, lease, reason=f"its client did not renew it within {lease.lease_s:g} s")


async def _end(app, lease: PauseLease, *, reason: str | None) -> None:
    """Drop LEASE and resume generation; REASON (None: its client ended it) is logged as a warning."""
    if current_lease(app) is not lease:
        return
    _set_lease(app, None)
    if lease.expiry is not None and lease.expiry is not asyncio.current_task():
        lease.expiry.cancel()
    if reason is not None:
        logger.warning("layerwise pause lease ended: %s; resuming generation", reason)
        if lease.on_expiry is not None and lease.expiry is asyncio.current_task():
            try:
                await lease.on_expiry()
            except Exception as exc:  # noqa: BLE001 - the resume below must happen whatever this says
                logger.warning("layerwise pause lease: ending its client's work failed: %s", exc)
    await app.state.engine_client.resume_generation()
    metrics.record_pause(asyncio.get_running_loop().time() - lease.began, expired=reason is not None,
                         drain_s=lease.drain_s)


def add_pause_lease_routes(app) -> None:
    """Add the three routes to APP (vLLM's FastAPI app)."""
    app.add_api_route(PAUSE_LEASE_PATH, pause_with_lease, methods=["POST"])
    app.add_api_route(RENEW_LEASE_PATH, renew_lease, methods=["POST"])
    app.add_api_route(RESUME_LEASE_PATH, resume_lease, methods=["POST"])
