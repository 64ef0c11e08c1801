"""`GET /metrics` (Prometheus) and `GET /admin/alerts` (the SLO monitor's
firing alerts), both behind the admin token on the public port.

The metrics name tenants and adapters and count each tenant's usage, so a
tenant's API key must not read them (vLLM serves /metrics openly because it
has one tenant). Prometheus either sends the admin token, or scrapes the
`--metrics-port` listener, which serves `metrics_app`: /metrics alone,
without auth, on an interface the operator keeps private."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.deps import gateway_of, require_admin
from gateway.errors import install_error_handlers
from gateway.schemas.admin import AlertOut


async def metrics(request: Request) -> Response:
    require_admin(request)
    return _exposition(request)


async def open_metrics(request: Request) -> Response:
    """The metrics listener's /metrics: reaching the port is the credential."""
    return _exposition(request)


def _exposition(request: Request) -> Response:
    gw = gateway_of(request)
    if gw.metrics is None:
        return Response("metrics are off on this server\n", status_code=404, media_type="text/plain")
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def alerts(request: Request) -> JSONResponse:
    """Firing alerts in Alertmanager's alert shape, newest last."""
    require_admin(request)
    gw = gateway_of(request)
    firing = sorted(gw.slo.firing(), key=lambda alert: alert.starts_at) if gw.slo is not None else []
    # Through the model the OpenAPI document declares, so the two agree.
    data = [AlertOut.model_validate(alert.to_json()).model_dump() for alert in firing]
    return JSONResponse({"object": "list", "data": data})


def routes() -> list[Route]:
    return [Route("/metrics", metrics, methods=["GET"]), Route("/admin/alerts", alerts, methods=["GET"])]


def metrics_app(gateway) -> Starlette:
    """The app of the `--metrics-port` listener. No lifespan: the public
    app starts and stops the gateway."""
    app = Starlette(routes=[Route("/metrics", open_metrics, methods=["GET"])])
    app.state.gateway = gateway
    install_error_handlers(app)
    return app
