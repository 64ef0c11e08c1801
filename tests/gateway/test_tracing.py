"""Traces of a live gateway, exported to memory: one server span per request
with admission, queue, prefill and decode children, the GenAI attributes,
an incoming traceparent honoured, and a 429 recorded on its admission span."""

from __future__ import annotations

import time

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from engine.config import EngineConfig
from gateway.config import GatewayConfig
from gateway.tenancy import TenantLimits, Tier
from gateway.tracing import Tracing, TracingObserver
from tests.gateway.live import build_in_process_gateway, seed_tenants, start_live_server, wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def live(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live-tracing")
    db_url = f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    keys = seed_tenants(db_url, {"vip": Tier.PREMIUM, "capped": (Tier.STANDARD, TenantLimits(requests_per_minute=1))})
    engine = EngineConfig.from_flat(model=str(tiny_llama_dir), num_kv_blocks=256, data_dir=str(tmp / "data"))
    gw = build_in_process_gateway(GatewayConfig(db_url=db_url, engine=engine, data_dir=tmp / "data"))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gw.tracing = Tracing(provider)
    gw.observers.append(TracingObserver(gw.tracing))
    server = start_live_server(gw)
    server.keys, server.model, server.exporter = keys, gw.served_model_name, exporter
    yield server
    server.stop()


def post(live, key: str, *, stream: bool = False, headers: dict | None = None) -> httpx.Response:
    body = {"model": live.model, "prompt": "Once upon a time", "max_tokens": 5, "min_tokens": 5,
            "temperature": 0.0, "stream": stream}
    return httpx.post(f"{live.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def finished(exporter) -> list:
    """The finished spans, once the server span is among them: it ends just
    after the response's last bytes, which may be after the client has them."""
    deadline = time.monotonic() + 5
    while not any(s.kind is SpanKind.SERVER for s in exporter.get_finished_spans()):
        assert time.monotonic() < deadline, "no server span ended"
        time.sleep(0.01)
    return exporter.get_finished_spans()


def spans_of_trace(exporter, trace_id: int) -> dict:
    return {s.name: s for s in finished(exporter) if s.context.trace_id == trace_id}


def test_a_completion_is_one_server_span_with_its_phases_under_the_callers_trace(live):
    live.exporter.clear()
    r = post(live, live.keys["vip"], headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 200
    spans = spans_of_trace(live.exporter, int(TRACE_ID, 16))
    server = spans[f"text_completion {live.model}"]
    assert server.kind is SpanKind.SERVER and server.parent.span_id == int(PARENT_ID, 16)
    assert set(spans) == {server.name, "admission", "queue", "prefill", "decode"}
    for name in ("admission", "queue", "prefill", "decode"):
        assert spans[name].parent.span_id == server.context.span_id, name
    a = server.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == live.model
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert (a["loragw.tenant"], a["loragw.tier"], a["loragw.adapter"]) == ("vip", "premium", "")
    assert a["http.response.status_code"] == 200
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert server.start_time <= spans["admission"].start_time <= spans["admission"].end_time <= queue.start_time
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert decode.start_time <= decode.end_time <= server.end_time


def test_a_stream_without_traceparent_starts_its_own_trace(live):
    live.exporter.clear()
    r = post(live, live.keys["vip"], stream=True)
    assert r.status_code == 200 and "[DONE]" in r.text
    [server] = [s for s in finished(live.exporter) if s.kind is SpanKind.SERVER]
    assert server.parent is None and server.attributes["gen_ai.usage.output_tokens"] == 5
    children = {s.name for s in live.exporter.get_finished_spans() if s.parent is not None}
    assert children == {"admission", "queue", "prefill", "decode"}


def test_a_429_is_recorded_on_the_admission_span(live):
    # An earlier test's span must not stand in for this request's below: its
    # span could then end after the clear, among the 429's (seen under load).
    live.exporter.clear()
    assert post(live, live.keys["capped"]).status_code == 200
    # The server span ends just after the response is sent: clearing before
    # it ends would let it land among the 429's spans (seen under load).
    wait_for(lambda: any(s.name.startswith("text_completion ") for s in finished(live.exporter)), 10,
             "the first request's span to end")
    live.exporter.clear()
    assert post(live, live.keys["capped"]).status_code == 429
    spans = {s.name: s for s in finished(live.exporter)}
    # Refused before its body was read, so the span cannot name the model.
    assert set(spans) == {"text_completion", "admission"}
    admission = spans["admission"]
    assert admission.attributes["loragw.rejected_limit"] == "requests_per_minute"
    assert not admission.status.is_ok
    assert spans["text_completion"].attributes["http.response.status_code"] == 429


def test_tracing_is_off_unless_otel_variables_ask_for_it():
    assert Tracing.from_env({}) is None
    assert Tracing.from_env({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}) is None
    console = Tracing.from_env({"OTEL_TRACES_EXPORTER": "console"})
    otlp = Tracing.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert console is not None and otlp is not None
    console.shutdown()
    otlp.shutdown()
