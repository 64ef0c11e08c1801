"""`GET /metrics` (Prometheus, no auth, like vLLM's) and `GET /admin/alerts`
(the SLO monitor's firing alerts, admin token)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.deps import gateway_of, require_admin


async def metrics(request: Request) -> Response:
    gw = gateway_of(request)
    if gw.metrics is None:
        return Response("metrics are off on this server\n", status_code=404, media_type="text/plain")
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def alerts(request: Request) -> JSONResponse:
    """Firing alerts in Alertmanager's alert shape, newest last."""
    require_admin(request)
    gw = gateway_of(request)
    firing = gw.slo.firing() if gw.slo is not None else []
    return JSONResponse({"object": "list", "data": [alert.to_json() for alert in firing]})


def routes() -> list[Route]:
    return [Route("/metrics", metrics, methods=["GET"]), Route("/admin/alerts", alerts, methods=["GET"])]
