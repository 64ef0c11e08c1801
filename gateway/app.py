"""The app factory: wires store, engine client, registry and admission into
one Starlette app. Everything is built here and passed down; no module
holds state of its own."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import anyio
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth_cache import AuthCache
from gateway.body_limit import BodyLimitMiddleware
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.errors import error_response, install_error_handlers
from gateway.store.base import Store

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class Gateway:
    """Everything a route may use, reached through `deps.gateway_of`."""

    config: GatewayConfig
    store: Store
    engine: EngineClient
    admission: object  # gateway.admission.AdmissionController
    clock: Callable[[], float] = time.monotonic  # rates, deadlines
    wall_clock: Callable[[], dt.datetime] = field(default=lambda: dt.datetime.now(dt.UTC))
    # Told of every request's end (billing's ledger, metrics); see lifecycle.py.
    observers: list = field(default_factory=list)
    # Started after the engine and stopped after it, with the app: objects
    # with `async start()` and `async stop()` (billing's spool flusher).
    background: list = field(default_factory=list)
    draining: bool = False
    in_flight: int = 0  # requests inside an /v1 handler, for the drain
    # Observability (docs/observability.md), each None when off:
    metrics: object | None = None  # gateway.metrics.GatewayMetrics, served at /metrics
    tracing: object | None = None  # gateway.tracing.Tracing
    slo: object | None = None  # gateway.slo.SloMonitor
    # Bounds the worker threads that parse, template and tokenize /v1
    # requests (gateway.prepare); set by create_app from the config.
    prepare_limiter: anyio.CapacityLimiter | None = None
    # Principals and adapter grants in front of the store; built from the
    # config when not given.
    auth: AuthCache | None = None

    def __post_init__(self) -> None:
        if self.auth is None:
            c = self.config
            self.auth = AuthCache(self.store, ttl_s=c.auth_cache_ttl_s, stale_s=c.auth_cache_stale_s,
                                  max_entries=c.auth_cache_max_entries, clock=self.clock)

    @property
    def served_model_name(self) -> str:
        """The base model's id in the API: the configured name, the bundled
        model's own name, or the checkpoint directory's name."""
        if self.config.served_model_name:
            return self.config.served_model_name
        if self.config.engine.model is None:
            return DEFAULT_MODEL_NAME
        return Path(self.config.engine.model).name

    @property
    def registry(self):
        return self.engine.adapter_registry


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the client's if it sent a sane
    one, else a fresh one. Pure ASGI so that streaming bodies pass through.

    It also answers an unexpected exception's 500 (logged by
    `error_response`) when no response has started: Starlette's outermost
    ServerErrorMiddleware would answer without the id and re-raise, and
    uvicorn then drops the keep-alive connection unannounced, so a client's
    next request on it fails. An exception after the response started still
    propagates: that response cannot be finished."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = sent if 0 < len(sent) <= 128 and sent.isprintable() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                raise
            await error_response(exc)(scope, receive, send_with_id)


def create_app(gateway: Gateway) -> Starlette:
    from gateway.routes import admin, health, observability, openai_api, openapi

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await gateway.engine.start()
        if gateway.slo is not None:
            await gateway.slo.start()
        for part in gateway.background:
            await part.start()
        try:
            yield
        finally:
            if gateway.slo is not None:
                await gateway.slo.stop()
            await gateway.engine.shutdown()
            for part in reversed(gateway.background):
                await part.stop()
            await gateway.store.close()
            if gateway.tracing is not None:
                gateway.tracing.shutdown()

    routes = health.routes() + openai_api.routes() + admin.routes() + openapi.routes() + observability.routes()
    app = Starlette(routes=routes, lifespan=lifespan)
    # Starlette's redirect to the other spelling of a path builds its
    # Location from the client's Host header; a wrong path is a plain 404.
    app.router.redirect_slashes = False
    app.state.gateway = gateway
    install_error_handlers(app)
    config = gateway.config
    if gateway.prepare_limiter is None:
        gateway.prepare_limiter = anyio.CapacityLimiter(config.prepare_threads)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_bytes,
                       route_limits={("POST", "/admin/adapters"): config.max_upload_bytes})
    if gateway.tracing is not None:
        from gateway.tracing import TraceMiddleware

        app.add_middleware(TraceMiddleware, tracing=gateway.tracing)
    app.add_middleware(RequestIdMiddleware)
    return app
