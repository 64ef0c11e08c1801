"""Probes: /health (the process answers) and /ready (it can serve).

Neither touches the store or waits on the engine: /health must answer in
milliseconds even while the engine is saturated, so a busy replica is never
restarted for being busy. /ready turns 503 while the model loads, after it
failed to load, and during the shutdown drain, so a load balancer stops
sending work there.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.deps import gateway_of


def routes() -> list[Route]:
    return [Route("/health", health, methods=["GET"]), Route("/ready", ready, methods=["GET"])]


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> JSONResponse:
    gw = gateway_of(request)
    engine = gw.engine
    if gw.draining:
        reason = "draining for shutdown"
    elif engine.ready:
        return JSONResponse({"status": "ready", "model": gw.served_model_name})
    elif engine.load_error is not None:
        reason = f"the model failed to load: {engine.load_error}"
    else:
        reason = "the model is loading"
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
