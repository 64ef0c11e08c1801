"""OpenTelemetry traces: one server span per /v1 request, with child spans
admission, queue, prefill and decode.

The spans follow the GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.usage.*`, `gen_ai.response.finish_reasons`)
plus `loragw.tenant`, `loragw.tier` and `loragw.adapter`. An incoming W3C
`traceparent` makes the server span its child.

Who makes which span:
- `TraceMiddleware` opens the server span around the whole HTTP exchange
  (a stream's last chunk included) and makes it current;
- `admission_span` (called by the route around `AdmissionController.admit`)
  names the server span and times the admission decision;
- `TracingObserver`, a RequestObserver, runs when the request ends, still
  inside the server span: it adds usage and finish reasons, and rebuilds
  queue (arrival -> first scheduled), prefill (-> first token) and decode
  (-> finished) from the engine's timestamps, anchored at the moment the
  gateway admitted the request.

The `TracerProvider` belongs to the gateway (tests hand in one with an
in-memory exporter). `Tracing.from_env` builds the production one from the
standard OTEL_* variables and is off unless OTEL_TRACES_EXPORTER or an OTLP
endpoint is set.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import RateLimited
from gateway.lifecycle import RequestObserver, RequestRecord
from gateway.tenancy import Principal

TRACED_PREFIX = "/v1/"
_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    def __init__(self, provider: TracerProvider):
        self.provider = provider
        self.tracer = provider.get_tracer("loragw")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Tracing | None:
        """The exporter the OTEL_* variables ask for, or None (tracing off).
        OTEL_TRACES_EXPORTER: otlp (the default once an endpoint is set),
        console or none; the OTLP/HTTP exporter reads its own
        OTEL_EXPORTER_OTLP_* settings."""
        exporter_name = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if exporter_name == "none" or (exporter_name == "" and not endpoint):
            return None
        if exporter_name == "console":
            exporter = ConsoleSpanExporter()
        elif exporter_name in ("", "otlp"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: loragw knows otlp, console and none")
        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
        provider = TracerProvider(resource=Resource.create({"service.name": "loragw"}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    def shutdown(self) -> None:
        self.provider.shutdown()


class TraceMiddleware:
    """The server span of every /v1 request, parented on `traceparent`."""

    def __init__(self, app: ASGIApp, tracing: Tracing):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TRACED_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        parent = _PROPAGATOR.extract(headers)
        name = f"{scope['method']} {scope['path']}"
        with self.tracing.tracer.start_as_current_span(
                name, context=parent, kind=SpanKind.SERVER,
                attributes={"http.request.method": scope["method"], "url.path": scope["path"]}) as span:
            request_id = scope.get("state", {}).get("request_id")
            if request_id:
                span.set_attribute("loragw.http_request_id", request_id)

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_traced)


@contextlib.contextmanager
def admission_span(tracing: Tracing | None, principal: Principal, *, model: str | None, chat: bool):
    """Name the current server span after the operation and time the
    admission decision under it; a 429 is recorded with its limit. `model`
    is None for a request refused before its body was read."""
    if tracing is None:
        yield
        return
    operation = "chat" if chat else "text_completion"
    server = trace.get_current_span()
    server.update_name(operation if model is None else f"{operation} {model}")
    server.set_attributes({"gen_ai.operation.name": operation, "loragw.tenant": principal.tenant.name,
                           "loragw.tier": principal.tenant.tier.value})
    if model is not None:
        server.set_attribute("gen_ai.request.model", model)
    with tracing.tracer.start_as_current_span("admission") as span:
        try:
            yield
        except RateLimited as exc:
            span.set_attribute("loragw.rejected_limit", exc.limit)
            raise


class TracingObserver(RequestObserver):
    """Usage, finish reasons and the engine phases, on the request's server
    span (the current span while the request ends)."""

    def __init__(self, tracing: Tracing):
        self.tracing = tracing

    def on_request_end(self, record: RequestRecord) -> None:
        server = trace.get_current_span()
        if not server.is_recording():
            return
        server.set_attributes({
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "gen_ai.response.finish_reasons": [record.finish_reason],
            "loragw.adapter": record.adapter or "",
            "loragw.request_id": record.request_id,
            "loragw.cached_prompt_tokens": record.cached_prompt_tokens,
        })
        if record.finish_reason == "error":
            server.set_status(Status(StatusCode.ERROR))
        m = record.engine_metrics
        if m is None:
            return
        now_ns = time.time_ns()
        arrival_ns = int(record.started_at.timestamp() * 1e9)

        def at(t: float | None) -> int:
            return now_ns if t is None else min(now_ns, arrival_ns + int((t - m.arrival_time) * 1e9))

        context = trace.set_span_in_context(server)
        phases = [("queue", m.arrival_time, m.first_scheduled_time),
                  ("prefill", m.first_scheduled_time, m.first_token_time),
                  ("decode", m.first_token_time, m.finished_time)]
        for name, start, end in phases:
            if start is None:
                break
            span = self.tracing.tracer.start_span(name, context=context, start_time=at(start))
            span.end(end_time=max(at(start), at(end)))
