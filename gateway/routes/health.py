"""Probes: /health (the process answers) and /ready (it can serve).

Neither touches the store or waits on the engine: /health must answer in
milliseconds even while the engines are saturated, so a busy replica is
never restarted for being busy; it reads the workers' last heartbeats and
the tenant limiter's last known state only. /ready turns 503 while the model loads, after it
failed to load, and during the shutdown drain, so a load balancer stops
sending work there.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.deps import gateway_of
from gateway.engine_client import Health


def routes() -> list[Route]:
    return [Route("/health", health, methods=["GET"]), Route("/ready", ready, methods=["GET"])]


async def health(request: Request) -> JSONResponse:
    """200 while some engine is up or still loading for the first time
    ("ok", or "degraded" with the workers that are down, or while the
    tenant limits' Redis is unreachable); 503 when no engine is up
    ("unavailable"). A Redis outage is never a 503 here: restarting the
    replica would not bring Redis back."""
    gw = gateway_of(request)
    fleet = gw.engine.health()
    limiter = gw.admission.limiter_health()
    status = fleet.status
    if status is Health.OK and not limiter.up:
        status = Health.DEGRADED
    body = {"status": status.value, "workers": fleet.workers}
    if limiter.backend != "memory":  # a single gateway's /health is as it always was
        body["tenant_limits"] = ({"backend": limiter.backend, "shared": limiter.shared, "up": limiter.up}
                                 | ({"detail": limiter.detail} if limiter.detail else {}))
    return JSONResponse(body, status_code=503 if status is Health.UNAVAILABLE else 200)


async def ready(request: Request) -> JSONResponse:
    gw = gateway_of(request)
    engine = gw.engine
    fleet = engine.health()
    if gw.draining:
        reason = "draining for shutdown"
    elif engine.ready:
        return JSONResponse({"status": "ready", "model": gw.served_model_name, "health": fleet.status.value,
                             "workers": fleet.workers})
    elif engine.load_error is not None:
        reason = f"the model failed to load: {engine.load_error}"
    elif fleet.status is Health.UNAVAILABLE:
        reason = "no engine worker is up"
    else:
        reason = "the model is loading"
    return JSONResponse({"status": "unavailable", "reason": reason, "workers": fleet.workers}, status_code=503)
